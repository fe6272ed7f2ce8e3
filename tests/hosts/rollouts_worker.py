"""One process of tests/hosts/test_cross_host.py's rollout test. argv: learner hosts (the first
processes; the rest are sampler hosts).

Learner hosts train nothing: each takes NUM_STEPS batches from its own `RolloutQueue` (fed by a
`LearnerInbox`) and bumps its version; the sampler version is the slowest learner's (in a run, the
weights' version). Sampler hosts admit groups by `RemoteAdmission`, finish them out of order and
send them. Prints:
  BATCH <version> <json [[prompt_id, admitted_version], ...]>    learner hosts
  COUNTS <json>                                                 learner hosts, at the end
  SENT <json [prompt_id, ...]>                                  sampler hosts
  TIMEOUT <message>   a learner host that stopped waiting for a silent sampler host (argv[2]: the
                      sampler hosts hang after that many groups)
"""

import json
import os
import random
import sys
import threading

import numpy as np

NUM_STEPS, BATCH, STALENESS = 6, 2, 1


def group(prompt_id, version):
  from tunixlike.rollout import Completion, RolloutGroup
  c = Completion(token_ids=np.array([1, 2, 3], np.int32), logprobs=np.full(3, -0.5, np.float32),
                 policy_versions=np.full(3, version, np.int32), finish_reason="eos")
  return RolloutGroup(prompt_id=prompt_id, prompt_token_ids=np.array([7], np.int32), completions=[c, c],
                      rewards=np.array([1.0, 0.0], np.float32), advantages=np.array([1.0, -1.0], np.float32))


def main():
  from tunixlike import distributed
  from tunixlike.hosts import kv, rendezvous, rollouts
  assert rendezvous.initialize(distributed.DistributedConfig(), rendezvous.Hello({}, 30))
  import jax
  n_learners = int(sys.argv[1])
  hang_after = int(sys.argv[2]) if len(sys.argv) > 2 else None  # a sampler host that hangs after this many groups
  me = jax.process_index()
  learners, samplers = list(range(n_learners)), list(range(n_learners, jax.process_count()))
  client = kv.client()
  if me in learners:
    from tunixlike.rl.queue import RolloutQueue
    queue = RolloutQueue(BATCH, STALENESS)
    inbox = rollouts.LearnerInbox(queue, me, sampler_hosts=samplers, silence_timeout_s=5).start()
    for version in range(NUM_STEPS):
      try:
        batch = queue.get_batch(version, timeout_s=60)
      except Exception as e:
        try:
          inbox.check()  # the inbox's error names the host; the queue's only says it stopped
        except kv.HostTimeout as named:
          print(f"TIMEOUT {named}", flush=True)
          os._exit(3)  # at once: jax.distributed's shutdown would wait for the hung host
        raise e
      print(f"BATCH {version} " + json.dumps([[g.prompt_id, g.admitted_version] for g in batch]), flush=True)
      client.key_value_set(f"test/version/{me}", str(version + 1), allow_overwrite=True)
    inbox.close()
    print("COUNTS " + json.dumps(queue.counts()), flush=True)
  else:
    rng = random.Random(me)
    adm = rollouts.RemoteAdmission(samplers.index(me), len(samplers), learners, batch_groups=BATCH,
                                   max_staleness=STALENESS, host=me, timeout_s=60)
    running, sent, k = [], [], 0

    def version():
      return min(int(client.key_value_try_get(f"test/version/{l}")) if _has(client, l) else 0 for l in learners)

    while not adm.stopped:
      v = version()
      if adm.try_admit(v):
        running.append(group(f"{me}/{k}", v))
        k += 1
      elif running or rng.random() < 0.5:
        threading.Event().wait(0.002)
      if hang_after is not None and k >= hang_after:
        print("HANG", flush=True)
        threading.Event().wait()  # stuck: no heartbeat, nothing sent
      if running and rng.random() < 0.6:  # out of order: any running group may finish next
        g = running.pop(rng.randrange(len(running)))
        adm.send(g)
        sent.append(g.prompt_id)
    print("SENT " + json.dumps(sent), flush=True)
  client.wait_at_barrier("test/end", 60_000)
  print("DONE", flush=True)


def _has(client, learner):
  try:
    client.key_value_try_get(f"test/version/{learner}")
    return True
  except Exception:  # NOT_FOUND before the learner's first step
    return False


if __name__ == "__main__":
  main()
