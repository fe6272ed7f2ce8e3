"""One process of tests/hosts/test_host_faults.py's forged-entry test (2 processes, sealed store).

Process 1 sends two real groups to learner host 0 through the key-value store, and between them
writes what an outside process could: the first group's sealed bytes again under its key once
host 0 has taken it (a replay), bytes with no seal, and an entry sealed with another secret.
Process 0 takes what arrives (`kv.take_all`, as `LearnerInbox` does) until the second group and prints
  GOT <json [prompt_id, ...]>
  REFUSED <count>
  ELSEWHERE <json {address: whether the coordinator's port answers there}>  (it listens on 127.0.0.1 only)
"""

import json
import os
import socket
import time

import numpy as np


def group(prompt_id):
  from tunixlike.rollout import Completion, RolloutGroup
  c = Completion(token_ids=np.array([1, 2], np.int32), logprobs=np.full(2, -0.5, np.float32),
                 policy_versions=np.zeros(2, np.int32), finish_reason="eos")
  return RolloutGroup(prompt_id=prompt_id, prompt_token_ids=np.array([7], np.int32), completions=[c, c],
                      rewards=np.array([1.0, 0.0], np.float32))


def main():
  from tunixlike import distributed
  from tunixlike.hosts import kv, rendezvous, rollouts, seal, wire
  assert rendezvous.initialize(distributed.DistributedConfig(), rendezvous.Hello({}, 30))
  import jax
  prefix = f"{rollouts.PREFIX}/groups/0/"
  client = kv.client()
  if jax.process_index() == 1:
    key = prefix + "1/0"
    sealed = kv.sealer().seal(key, wire.encode(group("first")))
    client.key_value_set_bytes(key, sealed)
    while True:  # host 0 takes it (and deletes it)
      try:
        client.key_value_try_get_bytes(key)
        time.sleep(0.05)
      except Exception:  # noqa: BLE001 - NOT_FOUND
        break
    client.key_value_set_bytes(key, sealed)  # replayed
    client.key_value_set_bytes(prefix + "1/1", wire.encode(group("unsealed")))
    other = seal.Sealer(b"another secret", b"another run", 1)
    client.key_value_set_bytes(prefix + "1/2", other.seal(prefix + "1/2", wire.encode(group("other secret"))))
    time.sleep(1)  # all three refused before the last real one
    kv.put(prefix + "1/3", wire.encode(group("second")))
    kv.wait("test/done", 60)
  else:
    got = []
    while "second" not in got:
      got += [wire.decode(value).prompt_id for _, value in kv.take_all(prefix)]
      time.sleep(0.05)
    print("GOT " + json.dumps(got), flush=True)
    print(f"REFUSED {kv.refused()}", flush=True)
    port = int(os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
    answers = {}
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "127.0.0.2"), (socket.AF_INET6, "::1")):
      with socket.socket(family) as s:
        answers[address] = s.connect_ex((address, port)) == 0
    print("ELSEWHERE " + json.dumps(answers), flush=True)
    kv.put("test/done", b"")


if __name__ == "__main__":
  main()
