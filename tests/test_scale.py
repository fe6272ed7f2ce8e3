"""A real model size, cheaply: a 47M Qwen2-shaped checkpoint (random weights written by transformers,
a Qwen2-format BPE tokenizer) through benchmarks/scale.py and through the training CLI's model.hf_path.
The 0.5B figures are in docs/benchmarks.md (too slow for CI on 2 cores)."""

import json
import os
import subprocess
import sys

import pytest

from test_benchmarks import ROOT, assert_positive

ENV = dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def checkpoint_50m(tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen2_50m")
  subprocess.run([sys.executable, "benchmarks/scale.py", "--write", str(path), "--size", "50m"], cwd=ROOT, env=ENV,
                 check=True, capture_output=True, timeout=300)
  return path


@pytest.mark.slow
def test_scale_benchmark_loads_trains_syncs_and_decodes_50m(checkpoint_50m, tmp_path):
  out = tmp_path / "scale.json"
  # One decode batch of 8 new tokens: a second batch size asserted the same thing at twice the cost. One learner
  # step (--steps 0: the compiling one is the step timed) on rows of 32 tokens, not --quick's 64: that the step
  # runs is what this asserts, not its speed.
  proc = subprocess.run([sys.executable, "benchmarks/scale.py", "--quick", "--size", "50m", "--batches", "8",
                         "--new-tokens", "8", "--train-seq", "32", "--steps", "0", "--checkpoint",
                         str(checkpoint_50m), "--out", str(out)], cwd=ROOT,
                        env=ENV, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout)
  assert r == json.loads(out.read_text())
  assert 40e6 < r["params"] < 55e6  # tied embeddings
  assert 0 <= r["checkpoint_bytes"] - 2 * r["params"] < 2**20  # bf16 on disk, plus the safetensors header
  assert r["layout"]["sampler"] == {"replica": 4, "tensor": 1} and r["layout"]["learner"] == {"fsdp": 4, "tensor": 1}
  # Loading never held a full copy per device on the host.
  assert r["load_memory"]["within_budget"], r["load_memory"]
  assert r["learner"]["loss_finite"]
  assert_positive(r, "load_s")
  assert_positive(r["learner"], "step_s", "mfu")
  assert_positive(r["sync"], "ms")
  assert r["sync"]["bytes_delivered"] == 4 * 2 * r["params"]  # a whole bf16 copy on each of 4 replicas
  assert r["setup"]["batches"] == [8] and r["setup"]["new_tokens"] == 8  # the flags win over --quick's shapes
  assert_positive(r["sampler"]["batch_8"], "decode_tokens_per_s")


@pytest.mark.slow
def test_async_grpo_steps_through_the_cli_with_a_50m_hf_checkpoint(checkpoint_50m, tmp_path):
  cmd = [sys.executable, "-m", "tunixlike.train", "--config", "configs/addition_grpo.py:size=tiny",
         f"--workdir={tmp_path / 'run'}", f"--config.model.hf_path={checkpoint_50m}", "--config.model.param_dtype=bfloat16",
         "--config.warm_start.max_steps=0", "--config.rl.num_steps=2", "--config.data.num_eval_examples=4",
         "--config.sampler.max_new_tokens=4",
         # 4 groups of 2 a step (not 8 of 8) of 4 new tokens in 8 decode slots (not 128): the size of the model
         # is what this test is about.
         "--config.rl.prompts_per_step=4", "--config.algo.group_size=2", "--config.sampler.max_concurrent_decodes=8",
         # The model's ChatML template wraps each prompt: longer than the char tokenizer's 16 tokens.
         "--config.data.max_prompt_length=48", "--config.sampler.max_prefill_length=48"]
  proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  steps = sorted({r["step"] for r in records if "reward/mean" in r})
  assert steps == [0, 1]
