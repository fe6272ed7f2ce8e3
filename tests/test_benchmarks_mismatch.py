"""Smoke test of benchmarks/mismatch.py: --quick runs end to end, the mask closes the gap, routing is measured."""

import json
import math
import os
import subprocess
import sys

import pytest
from test_benchmarks import assert_shared_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_mismatch_benchmark(tmp_path):
  out = tmp_path / "mismatch.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join("benchmarks", "mismatch.py"), "--quick", "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout)
  assert r == json.loads(out.read_text())
  assert_shared_keys(r)
  routing = r["routing"]["settings"]
  same = routing["float32_sampler/staleness=0"]
  assert same["with_replay"]["max_abs_log_ratio"] < 1e-4  # fp32 rounding only
  stale = routing["float32_sampler/staleness=1"]
  for entry in routing.values():
    for mode in ("with_replay", "without_replay"):
      stats = entry[mode]
      assert all(math.isfinite(v) for v in stats.values())
      assert 0 <= stats["routing_disagreement"] <= stats["routing_token_disagreement"] <= 1
  # One Adam step flips some routers; replay then changes the learner's log-probs of those tokens.
  assert stale["without_replay"]["routing_token_disagreement"] > 0 and stale["replay_effect"]["flipped_tokens"] > 0
  assert stale["replay_effect"]["mean_abs_logp_change_flipped"] > 0
  assert abs(stale["train_step_routing_disagreement"] - same["with_replay"]["routing_disagreement"]) < 1e-6
  for dtype in ("float32_sampler", "bfloat16_sampler"):
    full, trunc = r["settings"][dtype]["top_p=1.0"], r["settings"][dtype]["top_p=0.8"]
    assert full["kept_vocab_frac"] == 1.0 and 0 < trunc["kept_vocab_frac"] < 1
    assert full["with_mask"] == full["without_mask"]  # nothing truncated: the mask changes nothing
    for entry in (full, trunc):
      for stats in (entry["with_mask"], entry["without_mask"]):
        assert all(math.isfinite(v) for v in stats.values()) and 0 <= stats["frac_outside_band"] <= 1
  f32 = r["settings"]["float32_sampler"]["top_p=0.8"]
  assert f32["with_mask"]["max_abs_log_ratio"] < 1e-2  # fp32 rounding (decode with a KV cache vs full forward)
  assert f32["without_mask"]["mean_abs_log_ratio"] > 10 * f32["with_mask"]["mean_abs_log_ratio"]
  assert f32["without_mask"]["mean_log_ratio"] < 0  # the full softmax gives kept tokens less mass
