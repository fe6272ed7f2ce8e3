"""The CLI parses and validates; bad input prints one line naming the problem and exits 2."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "tunixlike.train", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)


def test_valid_config_passes_check():
  out = run_cli("--config", "configs/addition_grpo.py", "--config.rl.max_staleness=2", "--check_only")
  assert out.returncode == 0, out.stderr
  assert "config OK" in out.stdout


@pytest.mark.parametrize("args,expected", [
    (["--config.rl.bogus=1"], "unknown config key 'bogus' in --config.rl.bogus=1"),
    (["--config.rl.num_steps=abc"], "--config.rl.num_steps=abc"),
    (["--config.rl.num_steps=-3"], "rl.num_steps=-3: must be > 0"),
    (["--config.mesh.sampler_devices=3"], "mesh.sampler_devices / mesh.sampler_tensor = 3"),
    (["--config.rl.sync_mode=fast"], "rl.sync_mode='fast'"),
])
def test_bad_input_is_one_clear_line_and_status_2(args, expected):
  out = run_cli("--config", "configs/addition_grpo.py", *args, "--check_only")
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr
  assert expected in lines[0]


def test_missing_config_file_and_bad_variant():
  out = run_cli("--config", "configs/does_not_exist.py", "--check_only")
  assert out.returncode == 2 and "configs/does_not_exist.py" in out.stderr
  out = run_cli("--config", "configs/addition_grpo.py:size=huge", "--check_only")
  assert out.returncode == 2 and "unknown variant" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_submesh_sizes_that_do_not_add_up_to_the_devices(tmp_path):
  out = run_cli("--config", "configs/addition_grpo.py", "--config.mesh.learner_devices=8",
                "--config.warm_start.max_steps=0", f"--workdir={tmp_path}")
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1] == ("tunixlike.train: error: mesh.sampler_devices=4 + "
                                                "mesh.learner_devices=8 = 12, but there are 8 devices")


def test_help_explains_the_command_and_its_flags():
  out = run_cli("--help")
  assert out.returncode == 0
  assert "python -m tunixlike.train --config configs/addition_grpo.py" in out.stdout
  assert "--workdir" in out.stdout and "check_only" in out.stdout
