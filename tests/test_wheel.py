"""The wheel runs outside a checkout: built from a copy of the repository's files, installed into a fresh
environment (tests/fresh_install.py) after the copy is deleted, and run from a directory with no
repository around it: the main job's tiny variant by config name, `tunixlike.eval` on its workdir and
`tunixlike.export`; the examples' data, rewards and agent are read from the installed package."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import fresh_install

# The main job as small as a run gets: one RL step of 4 prompts from the untrained model, 8 held-out prompts.
SMALL = ["--config.rl.num_steps=1", "--config.rl.prompts_per_step=4", "--config.warm_start.max_steps=0",
         "--config.data.num_eval_examples=8", "--config.sampler.max_concurrent_decodes=32",
         "--config.log.progress_bar=false", "--config.log.tensorboard=false"]


def run(python, cwd, *args, timeout=300):
  env = fresh_install.install_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, (args, out.stderr[-3000:])
  return out


@pytest.mark.slow
def test_the_installed_wheel_trains_evaluates_and_exports_by_config_name(tmp_path):
  source = fresh_install.source_copy(tmp_path / "source")
  dist = tmp_path / "dist"
  run(sys.executable, tmp_path, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source))
  (wheel,) = dist.glob("tunixlike-*.whl")
  files = set(zipfile.ZipFile(wheel).namelist())
  modules = {p.relative_to(source).as_posix() for p in (source / "tunixlike").rglob("*.py")}
  assert modules <= files, sorted(modules - files)  # a folder without __init__.py would be left out
  assert {"tunixlike/configs/addition_grpo.py", "tunixlike/data/gsm8k/test.jsonl",
          "tunixlike/examples/countdown/train.jsonl", "tunixlike/examples/countdown/rewards.py",
          "tunixlike/examples/calculator_agent/agent.py"} <= files
  shutil.rmtree(source)  # nothing below can read the tree the wheel came from

  venv = tmp_path / "venv"
  python = fresh_install.fresh_venv(venv)
  run(python, tmp_path, "-m", "pip", "install", "--no-deps", "-q", str(wheel))
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  package = pathlib.Path(run(python, elsewhere, "-c", "import tunixlike; print(tunixlike.__file__)").stdout.strip())
  assert package.is_relative_to(venv), package  # the wheel's, not this checkout's or an editable install's
  listed = run(python, elsewhere, "-m", "tunixlike.train", "--list_configs").stdout
  assert str(package.parent / "configs") in listed.splitlines()[0]
  assert {"addition_grpo", "countdown", "calculator_agent"} <= {l.split()[0] for l in listed.splitlines()[1:]}

  # The examples' files beside their installed configs: countdown's ./train.jsonl and ./rewards.py (read and
  # called by --check_only), calculator_agent's ./agent.py (loaded as the run loads it).
  out = run(python, elsewhere, "-m", "tunixlike.train", "--config", "countdown:size=tiny", "--check_only")
  assert out.stdout.startswith("config OK; data.train: 1725 rows read") and "rewards: correct=" in out.stdout
  load_agent = ("import inspect; from tunixlike import config; from tunixlike.rewards import loader; "
                "agent = loader.load(config.load('calculator_agent').rl.agent, key='rl.agent'); "
                "print(inspect.getsourcefile(agent))")
  agent = run(python, elsewhere, "-c", load_agent)
  assert pathlib.Path(agent.stdout.strip()) == package.parent / "examples" / "calculator_agent" / "agent.py"
  run(python, elsewhere, "-m", "tunixlike.train", "--config", "addition_grpo:size=tiny", *SMALL, "--workdir", "run")
  records = [json.loads(line) for line in open(elsewhere / "run" / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [0]

  result = json.loads(run(python, elsewhere, "-m", "tunixlike.eval", "--checkpoint", "run").stdout)
  assert result["step"] == 1 and result["num_prompts"] == 8 and 0.0 <= result["accuracy"] <= 1.0
  run(python, elsewhere, "-m", "tunixlike.export", "--workdir", "run", "--out", "hf")
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(elsewhere / "hf"))
