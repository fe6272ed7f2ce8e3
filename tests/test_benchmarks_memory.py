"""Smoke test of benchmarks/memory.py: --quick runs end to end, offload moves bytes, not numbers."""

import json
import os
import subprocess
import sys

import pytest
from test_benchmarks import assert_shared_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_memory_benchmark(tmp_path):
  out = tmp_path / "memory.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join("benchmarks", "memory.py"), "--quick", "--steps", "1",
                         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout)
  assert r == json.loads(out.read_text())
  assert_shared_keys(r)
  sizes, none, both = r["component_bytes"], r["settings"]["none"], r["settings"]["all"]
  assert sizes["optimizer"] > sizes["reference"] > sizes["critic"] > 0
  total = sum(none["bytes_between_steps"].values())
  assert none["bytes_between_steps"] == {"device": total, "host": 0} and none["bytes_moved_per_step"] == 0
  offloaded = sizes["reference"] + sizes["optimizer"] + sizes["critic"]
  assert both["bytes_between_steps"] == {"device": total - offloaded, "host": offloaded}
  assert both["bytes_moved_per_step"] == 2 * offloaded
  assert both["memory_kind"] == "pinned_host" and both["loss_equal_to_no_offload"]
  assert none["step_s"] > 0 and both["step_s"] > 0
  assert r["peak_device_memory_reported"] is False  # CPU keeps no memory stats
