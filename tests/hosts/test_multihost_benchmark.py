"""Smoke test of benchmarks/multihost.py: 2 then 3 processes, then the RL job in both layouts on 2,
--quick, one sane JSON object."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.multihost
def test_multihost_benchmark_compares_the_three_paths(tmp_path):
  out = tmp_path / "multihost.json"
  proc = subprocess.run([sys.executable, os.path.join("benchmarks", "multihost.py"), "--quick", "--out", str(out)],
                        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  r = json.loads(proc.stdout)
  assert r == json.loads(out.read_text()) and r["quick"] is True
  for key in ("by_host_full_s", "per_host_full_s", "by_host_lora_s", "per_host_lora_s", "socket_full_s",
              "by_host_full_bytes_per_s", "socket_full_bytes_per_s", "raw_1dev_full_s", "raw_4dev_full_s",
              "fan_out_direct_s", "fan_out_relay_s", "fan_out_4dev_all_gather_s", "fan_out_4dev_copies_s",
              "rl_per_host_s_per_step", "rl_by_host_s_per_step", "rl_per_host_learner_step_s",
              "rl_by_host_learner_step_s", "by_host_full_cpu_s", "socket_full_cpu_s", "raw_4dev_full_cpu_s",
              "by_host_tp_full_s", "by_host_tp_full_cpu_s"):
    assert math.isfinite(r[key]) and r[key] > 0, key
  assert r["by_host_vs_socket_bandwidth"] == pytest.approx(r["by_host_full_bytes_per_s"] / r["socket_full_bytes_per_s"])
  assert r["by_host_vs_socket_cpu"] == pytest.approx(r["by_host_full_cpu_s"] / r["socket_full_cpu_s"])
  # LoRA-only against both full syncs (replicated and tensor-parallel sampler host), side by side
  assert r["by_host_full_vs_lora_time"] == pytest.approx(r["by_host_full_s"] / r["by_host_lora_s"])
  assert r["by_host_tp_full_vs_lora_time"] == pytest.approx(r["by_host_tp_full_s"] / r["by_host_lora_s"])
  assert r["lora_bytes"] < r["full_bytes"] == 4 * 2**20
  # where the time went, on both sides of the profiled sync
  assert set(r["by_host_full_stages_s"]) == {"pack", "ack", "wait_for_pack", "transfer", "gather", "unpack", "place"}
  # a tensor-parallel sampler host receives each device's part in place: nothing to gather or cut
  assert set(r["by_host_tp_full_stages_s"]) == {"pack", "ack", "wait_for_pack", "transfer", "place"}
  # the adapters cross as one whole buffer, asked for at once: no "packed" flag, no gather or cut
  assert set(r["by_host_lora_stages_s"]) == {"pack", "ack", "transfer", "place"}
  assert r["by_host_tp_vs_socket_bandwidth"] == pytest.approx(r["by_host_tp_full_bytes_per_s"]
                                                              / r["socket_full_bytes_per_s"])
  assert r["by_host_tp_vs_replicated_full_time"] == pytest.approx(r["by_host_tp_full_s"] / r["by_host_full_s"])
  assert r["fan_out_winner"] == min(("direct", "relay"), key=lambda name: r[f"fan_out_{name}_s"])
  # the same RL job in both layouts, every step measured, with each side's busy fraction
  assert r["rl_per_host_steps"] == r["rl_by_host_steps"] == r["rl_steps"] == 5
  for layout in ("per_host", "by_host"):
    for side in ("learner", "sampler"):
      assert 0 < r[f"rl_{layout}_{side}_busy_frac"] <= 1, (layout, side)
  assert r["rl_by_host_vs_per_host_step_time"] == pytest.approx(r["rl_by_host_s_per_step"] / r["rl_per_host_s_per_step"])
