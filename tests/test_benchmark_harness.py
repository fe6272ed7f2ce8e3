"""benchmarks/harness.py: the flags, device set-up and report every benchmark shares."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def harness(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  import harness
  return harness


def test_shared_flags_and_the_report(harness, tmp_path, capsys):
  out = tmp_path / "r.json"
  args = harness.parse("doc", lambda p: p.add_argument("--steps", type=int, default=4),
                       ["--quick", "--seed", "3", "--out", str(out), "--steps", "5"])
  assert (args.quick, args.seed, args.steps, args.out) == (True, 3, 5, str(out))
  printed = harness.report({"figure": 1.5}, args)
  assert json.loads(capsys.readouterr().out) == printed == json.loads(out.read_text())
  assert printed["figure"] == 1.5 and printed["seed"] == 3 and printed["quick"] is True
  assert printed["environment"]["devices"] == len(__import__("jax").devices())  # this process started JAX
  assert [len(v) for v in printed["load_average"].values()] == [3, 3]
  assert harness.parse(None, argv=[]).seed == 0


def test_host_devices_sets_the_count_before_jax_starts(harness):
  assert harness.xla_flags(2, "--xla_foo=1") == "--xla_foo=1 --xla_force_host_platform_device_count=2"
  env = harness.device_env(4, {"XLA_FLAGS": "--xla_foo=1"})
  assert env == {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=4", "NPROC": "16"}
  assert harness.device_env(4, {"NPROC": "3"})["NPROC"] == "3"  # the user's setting wins
  with pytest.raises(RuntimeError, match="before importing jax"):
    harness.host_devices(2)  # this test process has imported jax
  code = ("import sys; sys.path.insert(0, 'benchmarks'); import harness; harness.host_devices(3); import jax; "
          "print(jax.device_count())")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.stdout.split() == ["3"], proc.stderr[-2000:]
