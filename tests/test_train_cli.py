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
    (["--config.rl.bogus=1"], "unknown config key 'rl.bogus' in --config.rl.bogus=1"),
    (["--config.rl.num_steps=abc"], "--config.rl.num_steps=abc"),
    (["--config.rl.num_steps=-3"], "rl.num_steps=-3: must be >= 0"),
    (["--config.mesh.sampler_devices=3"], "mesh.sampler_devices / mesh.sampler_tensor = 3"),
    (["--config.rl.sync_mode=fast"], "rl.sync_mode='fast'"),
])
def test_bad_input_is_one_clear_line_and_status_2(args, expected):
  out = run_cli("--config", "configs/addition_grpo.py", *args, "--check_only")
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr
  assert expected in lines[0]


def test_config_files_work_from_any_directory(tmp_path):
  # addition_ppo.py builds on addition_grpo.py: nothing may depend on the working directory.
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config",
                        os.path.join(ROOT, "configs", "addition_ppo.py") + ":size=tiny", "--check_only"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "config OK" in out.stdout


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
                                                "mesh.learner_devices=8 = 12, but there are 8 devices (on CPU, "
                                                "XLA_FLAGS=--xla_force_host_platform_device_count=12 set before JAX "
                                                "starts makes 12)")


def test_a_missing_xla_flags_is_suggested(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config", "configs/addition_grpo.py",
                        f"--workdir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert one_error_line(out) == ("mesh.sampler_devices=4 + mesh.learner_devices=4 = 8, but there are 1 devices (on CPU, "
                                 "XLA_FLAGS=--xla_force_host_platform_device_count=8 set before JAX starts makes 8)")


def one_error_line(out) -> str:
  assert out.returncode == 2, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tunixlike.train: error: "), out.stderr
  return lines[0].removeprefix("tunixlike.train: error: ")


@pytest.mark.parametrize("source,expected", [
    ("def get_config(:\n  pass\n", "{path}:1: SyntaxError: invalid syntax"),
    ("def get_config(arg=None):\n  raise RuntimeError('no quota')\n",
     "{path}:2: get_config raised RuntimeError: no quota"),
    ("import configs.nothing_here\n", "{path}:1: loading it raised ModuleNotFoundError"),
    ("LEARNING_RATE = 1e-3\n", "{path}: has no get_config function"),
    ("def get_config(arg=None):\n  pass\n", "get_config of {path} returned None instead of a ConfigDict"),
    ("def get_config(arg=None):\n  return {'rl': {'num_steps': 2}}\n",
     "get_config of {path} returned a dict instead of a ConfigDict"),
])
def test_broken_config_file_is_named_in_one_line(tmp_path, source, expected):
  path = tmp_path / "broken.py"
  path.write_text(source)
  # An override too: it must not be what the error is about.
  line = one_error_line(run_cli("--config", str(path), "--config.rl.num_steps=2", "--check_only"))
  assert line.startswith(expected.format(path=path)), line


@pytest.mark.parametrize("args,expected", [
    (["--config.warm_start.batch_size=3"], "warm_start.batch_size=3: must be divisible by the learner fsdp "
                                           "devices (mesh.learner_devices / mesh.learner_tensor = 4)"),
    (["--config.optim.learning_rate=inf"], "optim.learning_rate=inf: must be finite"),
    (["--config.rl.reward_timeout_s=nan"], "rl.reward_timeout_s=nan: must be finite"),
    (["--config.algo.eps_high=-inf"], "algo.eps_high=-inf: must be finite"),
    (["--config.data.path=/does/not/exist"], "data.path='/does/not/exist': is only read by data.task='gsm8k'"),
    (["--config.data.task=gsm8k", "--config.data.path=/does/not/exist"],
     "data.path='/does/not/exist': directory does not exist"),
    (["--config.model.hf_path=/does/not/exist"], "model.hf_path='/does/not/exist': directory does not exist"),
])
def test_values_that_would_fail_later_in_the_run_are_refused_up_front(args, expected):
  line = one_error_line(run_cli("--config", "configs/addition_grpo.py", *args, "--check_only"))
  assert line.startswith(expected), line


def test_warm_start_batch_only_needs_to_divide_when_there_is_a_warm_start():
  out = run_cli("--config", "configs/addition_grpo.py", "--config.warm_start.batch_size=3",
                "--config.warm_start.max_steps=0", "--check_only")
  assert out.returncode == 0, out.stderr


def test_model_directory_problems_are_named(tmp_path):
  hf = tmp_path / "model"
  hf.mkdir()
  check = lambda: one_error_line(run_cli("--config", "configs/addition_grpo.py", f"--config.model.hf_path={hf}",
                                         "--check_only"))
  assert check() == f"model.hf_path='{hf}': directory is empty"
  (hf / "tokenizer.json").write_text("{}")
  assert check() == f"model.hf_path='{hf}': has no config.json"


def test_device_count_is_named_before_rules_derived_from_the_mesh(tmp_path):
  # 6 sampler devices also break "decode slots divisible by the replicas"; the device count is the cause.
  out = run_cli("--config", "configs/addition_grpo.py", "--config.mesh.sampler_devices=6", f"--workdir={tmp_path}")
  assert one_error_line(out).startswith("mesh.sampler_devices=6 + mesh.learner_devices=4 = 10, but there are 8 devices")


def test_help_explains_the_command_and_its_flags():
  out = run_cli("--help")
  assert out.returncode == 0
  assert "python -m tunixlike.train --config configs/addition_grpo.py" in out.stdout
  assert "--workdir" in out.stdout and "check_only" in out.stdout


def test_sft_is_train_with_no_rl_steps():
  run = lambda *args: subprocess.run([sys.executable, "-m", "tunixlike.sft", *args], cwd=ROOT, capture_output=True,
                                     text=True, timeout=120)
  out = run("--config", "configs/addition_grpo.py", "--check_only")  # its warm_start.max_steps > 0
  assert out.returncode == 0 and out.stdout.startswith("config OK; "), out.stderr[-2000:]
  out = run("--config", "configs/addition_grpo.py", "--config.warm_start.max_steps=0", "--check_only")
  assert out.returncode == 2 and out.stderr.strip() == ("tunixlike.sft: error: warm_start.max_steps=0: nothing to train; "
                                                        "set --config.warm_start.max_steps to the supervised steps")
  out = run("--help")
  assert out.returncode == 0 and "Supervised fine-tuning alone" in out.stdout and "--workdir" in out.stdout
