"""Two processes on 127.0.0.1 (CPU, gloo collectives, 4 virtual devices each): multi-controller JAX.

Each process runs tests/multihost_worker.py: 2 sampler + 2 learner devices per host, one learner
mesh over both hosts, a few async RL steps, then per-process checks that the sampler holds exactly
the learner's weights, a combined eval and a multi-process checkpoint round trip. The test compares
what the two processes print. Every wait has a timeout; both processes are killed on any failure.
"""

import json
import os
import sys

import pytest

from multiprocess_job import ROOT, lines as _lines, run_processes

WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
TIMEOUT_S = 240


@pytest.mark.slow
def test_two_processes_train_in_lockstep_and_sync_weights_to_their_samplers(tmp_path):
  results = run_processes([sys.executable, WORKER, "3", str(tmp_path / "run")], 2, tmp_path, timeout_s=TIMEOUT_S)
  outs = [out for _, out in results]
  for i, (rc, out) in enumerate(results):
    assert rc == 0 and "DONE" in out, f"process {i} failed (exit {rc}):\n{out[-4000:]}"

  for i, out in enumerate(outs):
    assert _lines(out, "PROCESS")[0].startswith(f"{i} sampler {{'replica': 2, 'tensor': 1}} "
                                                "learner {'fsdp': 4, 'tensor': 1}")
    assert len(_lines(out, "SYNC_OK")) == 1, out[-2000:]
    assert _lines(out, "CKPT_OK") == ["3"]
  # One global train step per batch: both processes see the same losses and gradient norms.
  losses = [json.loads(_lines(out, "LOSSES")[0]) for out in outs]
  assert [step for step, *_ in losses[0]] == [0, 1, 2]
  assert losses[0] == losses[1]
  # Each host evaluated its own half of the held-out prompts; the combined numbers agree.
  evals = [json.loads(_lines(out, "EVAL")[0]) for out in outs]
  assert evals[0] == evals[1] and evals[0]["eval/num_prompts"] == 8


def test_weight_sync_buckets_bound_the_gathered_bytes():
  from tunixlike.rl import weight_sync
  assert weight_sync.buckets([5, 5, 5, 20, 1, 1], 10) == [[0, 1], [2], [3], [4, 5]]
  assert weight_sync.buckets([], 10) == []
  with pytest.raises(ValueError, match="bucket_bytes=0"):
    weight_sync.buckets([1], 0)


def test_distributed_settings_come_from_config_then_environment(monkeypatch):
  from tunixlike import distributed
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  got = distributed.resolve(distributed.DistributedConfig(process_id=1))
  assert (got.coordinator_address, got.num_processes, got.process_id) == ("10.0.0.1:1234", 4, 1)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "four")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='four'"):
    distributed.resolve(distributed.DistributedConfig())
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
  # Several processes without a coordinator: a clear error before jax.distributed is touched.
  with pytest.raises(ValueError, match="coordinator_address"):
    distributed.initialize(distributed.DistributedConfig())
  with pytest.raises(ValueError, match="distributed.process_id=2"):
    distributed.DistributedConfig(num_processes=2, process_id=2)


def test_one_process_is_a_no_op():
  from tunixlike import distributed
  assert distributed.initialize(distributed.DistributedConfig()) is False
  assert distributed.allgather([1.0, 2.0]).tolist() == [[1.0, 2.0]]
  assert distributed.any_process(True) and not distributed.any_process(False)
  assert distributed.allgather_json({"a": [1, 2]}) == [{"a": [1, 2]}]
