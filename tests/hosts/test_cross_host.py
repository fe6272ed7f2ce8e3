"""Whole sampler hosts and whole learner hosts: real processes on 127.0.0.1 (CPU, 4 virtual devices
each) as one multi-controller job. Weights by cross-host device_put (tests/hosts/cross_host_worker.py);
rollouts and admission through the key-value store, and a hung sampler host (rollouts_worker.py)."""

import json
import os
import sys

import pytest

from multiprocess_job import ROOT, lines as _lines, run_processes

WORKER = os.path.join(ROOT, "tests", "hosts", "cross_host_worker.py")


@pytest.mark.multihost
@pytest.mark.parametrize("learner_hosts,sampler_hosts,tensor", [(2, 2, 2), (1, 3, 4)])
def test_one_device_put_delivers_the_learner_hosts_weights_to_each_sampler_host(tmp_path, learner_hosts,
                                                                                sampler_hosts, tensor):
  # The first processes are learner hosts (one FSDP mesh over all their devices), the others sampler
  # hosts, each served by a learner host (round robin; with one learner host it sends to all three).
  # Their sampler mesh: 2 replicas of 2 tensor-parallel devices, or 1 replica over all 4 (the arrays
  # it splits then cross straight into place: no replica to copy).
  n = learner_hosts + sampler_hosts
  results = run_processes([sys.executable, WORKER, str(sampler_hosts), str(tensor)], n, tmp_path)
  for i, (rc, out) in enumerate(results):
    assert rc == 0 and "DONE" in out, f"process {i} failed (exit {rc}):\n{out[-4000:]}"
  layout = _lines(results[0][1], "LAYOUT")
  assert [l.split(", devices")[0] for l in layout] == [
      f"host {p}: {'learner' if p < learner_hosts else 'sampler'}" for p in range(n)]
  assert layout[0].endswith(f"learner mesh {{'fsdp': {4 * learner_hosts}, 'tensor': 1}} "
                            f"over hosts {list(range(learner_hosts))}")
  senders = {s: (s - learner_hosts) % learner_hosts for s in range(learner_hosts, n)}
  for s, sender in senders.items():
    assert layout[s].endswith(f"mesh {{'replica': {4 // tensor}, 'tensor': {tensor}}}, weights from host {sender}")
    # Each sampler host got exact values, on its own devices, each with the version that was sent.
    # (also through a relay: each sampler host after the first got it from the one before)
    assert _lines(results[s][1], "GOT") == ["full 1", "lora 2", "bf16 3", "relay 4"]
    # bf16: every replicated array is under 1 MiB and crosses in the whole buffer (no gather, no cut);
    # 'big' travels in the sampler's layout, so the bucket waits for its "packed" flag
    assert _lines(results[s][1], "STAGES") == ["place transfer wait_for_pack"]
  # Nobody acknowledged version 5: each sending learner host names the (first) sampler host it waited for.
  for learner in range(learner_hosts):
    first = min(s for s, sender in senders.items() if sender == learner)
    assert _lines(results[learner][1], "TIMEOUT") == [f"weight sync v5 bucket 1/1: host {first} did not answer within 3 s"]
    assert _lines(results[learner][1], "STAGES") == ["ack pack"]


@pytest.mark.multihost
def test_rollouts_reach_the_learner_hosts_within_their_staleness_bound(tmp_path):
  # Processes 0, 1 are learner hosts, 2, 3 sampler hosts; only the key-value store joins them.
  worker = os.path.join(ROOT, "tests", "hosts", "rollouts_worker.py")
  results = run_processes([sys.executable, worker, "2"], 4, tmp_path, timeout_s=120)
  for i, (rc, out) in enumerate(results):
    assert rc == 0 and "DONE" in out, f"process {i} failed (exit {rc}):\n{out[-4000:]}"
  trained = []
  for learner in (0, 1):
    batches = [l.split(" ", 1) for l in _lines(results[learner][1], "BATCH")]
    assert [int(v) for v, _ in batches] == list(range(6))
    for version, groups in batches:
      groups = json.loads(groups)
      assert len(groups) == 2
      # Admission kept every group within the bound: started at most max_staleness=1 versions ago.
      assert all(int(version) - 1 <= admitted <= int(version) for _, admitted in groups), (version, groups)
      trained += [pid for pid, _ in groups]
    counts = json.loads(_lines(results[learner][1], "COUNTS")[0])
    assert counts == {"trained": 12, "dropped_stale": 0, "dropped_filtered": 0}
  sent = [pid for s in (2, 3) for pid in json.loads(_lines(results[s][1], "SENT")[0])]
  assert len(set(trained)) == len(trained) == 24  # nothing trained twice
  assert set(trained) <= set(sent)
  assert {pid.split("/")[0] for pid in trained} == {"2", "3"}  # both sampler hosts contributed


@pytest.mark.multihost
def test_a_hung_sampler_host_stops_the_learner_host_naming_it(tmp_path):
  # Process 0 learns, process 1 samples 6 groups and then hangs (no heartbeat, nothing sent).
  worker = os.path.join(ROOT, "tests", "hosts", "rollouts_worker.py")
  (learner_rc, learner_out), (_, sampler_out) = run_processes([sys.executable, worker, "1", "6"], 2, tmp_path,
                                                              timeout_s=120)
  assert "HANG" in sampler_out
  assert learner_rc == 3, learner_out[-3000:]
  assert _lines(learner_out, "TIMEOUT") == [
      "sampler host 1 sent nothing for more than 5 s (silence_timeout_s): it died or hangs"]
  assert len(_lines(learner_out, "BATCH")) >= 1  # it trained on what arrived before
