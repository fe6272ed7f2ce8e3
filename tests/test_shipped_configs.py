"""The configs that ship with tunixlike, by name (tunixlike/shipped_configs.py): the same configs as the
repository's files, from any directory, with variants and overrides; listed by --list_configs. The
installed package's copies are tested by tests/test_wheel.py."""

import os
import subprocess
import sys

import pytest

from tunixlike import config as config_lib, shipped_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(cwd, *args):
  return subprocess.run([sys.executable, "-m", "tunixlike.train", *args], cwd=cwd, capture_output=True, text=True,
                        timeout=120)


def test_every_config_and_example_of_the_repository_ships_by_name():
  configs = {f[:-3]: os.path.join(ROOT, "configs", f) for f in os.listdir(os.path.join(ROOT, "configs"))
             if f.endswith(".py") and f != "__init__.py"}
  examples = {d: os.path.join(ROOT, "examples", d, "config.py") for d in os.listdir(os.path.join(ROOT, "examples"))
              if os.path.isfile(os.path.join(ROOT, "examples", d, "config.py"))}
  assert {"addition_grpo", "gsm8k_grpo"} <= set(configs) and {"countdown", "calculator_agent"} <= set(examples)
  assert shipped_configs.paths() == dict(sorted({**configs, **examples}.items()))  # in a checkout: its own files


def test_a_name_loads_what_its_file_loads_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  for name, path in shipped_configs.paths().items():
    assert config_lib.load(name).to_dict() == config_lib.load(path).to_dict(), name
  for tiny in (config_lib.load("addition_grpo:size=tiny"), config_lib.load("addition_grpo", "size=tiny")):
    assert tiny.rl.num_steps == 3
  countdown = config_lib.load("countdown")  # ./train.jsonl is beside the config file, wherever that is
  assert countdown.data.train == os.path.join(ROOT, "examples", "countdown", "train.jsonl")
  assert countdown.rewards[0]["fn"] == os.path.join(ROOT, "examples", "countdown", "rewards.py") + ":correct"


def test_a_file_wins_over_a_name_and_an_unknown_name_lists_the_shipped_ones(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert shipped_configs.find("configs/addition_grpo.py") == "configs/addition_grpo.py"  # a path: as given
  (tmp_path / "addition_grpo").write_text("")
  assert shipped_configs.find("addition_grpo") == "addition_grpo"  # a file here of that name
  with pytest.raises(FileNotFoundError, match=r"--config addition_grpoo: no such file, .*shipped: addition_grpo, "):
    shipped_configs.find("addition_grpoo")


def test_the_command_takes_names_variants_and_overrides_from_any_directory(tmp_path):
  out = run_cli(tmp_path, "--config", "addition_grpo:size=tiny", "--config.rl.num_steps=-1", "--check_only")
  assert out.returncode == 2 and out.stderr.strip() == "tunixlike.train: error: rl.num_steps=-1: must be >= 0"
  out = run_cli(tmp_path, "--config", "countdown:size=tiny", "--config.data.num_eval_examples=8", "--check_only")
  assert out.returncode == 0, out.stderr
  assert "config OK; data.train: 1725 rows read" in out.stdout and "rewards: correct=" in out.stdout
  out = run_cli(tmp_path, "--config=addition_grpoo", "--check_only")
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
  assert "--config addition_grpoo: no such file, and no config of that name ships with tunixlike" in out.stderr
  out = run_cli(tmp_path, "--config", "addition_grpo:size=huge", "--check_only")  # the file's own error, named
  assert out.returncode == 2 and os.path.join(ROOT, "configs", "addition_grpo.py") in out.stderr
  assert "unknown variant 'size=huge'" in out.stderr


def test_list_configs_names_each_with_its_summary():
  out = run_cli(ROOT, "--list_configs")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.strip().splitlines()
  assert lines[0].startswith("Configs that ship with tunixlike: --config NAME[:variant] from any directory")
  names = [line.split()[0] for line in lines[1:]]
  assert names == list(shipped_configs.paths())
  (countdown,) = [line for line in lines[1:] if line.split()[0] == "countdown"]
  assert countdown.split(None, 1)[1].startswith("Async GRPO on Countdown")
  sft = subprocess.run([sys.executable, "-m", "tunixlike.sft", "--list_configs"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
  assert sft.returncode == 0 and sft.stdout == out.stdout, sft.stderr  # train's flags, its own command
