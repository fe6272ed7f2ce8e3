"""Whole sampler hosts through the CLI: `python -m tunixlike.train` on 4 CPU processes on 127.0.0.1
(2 virtual devices each) as one job, real async GRPO steps of the tiny addition model.

The same command runs on every process (the JAX_* variables say which one it is); the last
mesh.sampler_hosts processes only decode, the others only train."""

import json
import os
import signal
import sys

import pytest

from multiprocess_job import ROOT, run_processes

# The tiny addition job, rewarded for stopping (rewards with variance from the first step, so that
# the weights change at every step without a warm start), decode programs compiled when first used.
CONFIG = f"""
import os
from tunixlike import config

def get_config(arg=None):
  c = config.load(os.path.join({ROOT!r}, "configs", "addition_grpo.py"), "size=tiny")
  c.rewards = ({{"fn": "stopped", "weight": 1.0}},)
  c.warm_start.max_steps = 0
  c.sampler.warmup = False
  return c
"""
FAST = ["--config.data.num_eval_examples=8", "--config.log.progress_bar=false", "--config.log.tensorboard=false",
        "--config.rl.num_steps=3", "--config.rl.prompts_per_step=4", "--config.sampler.max_concurrent_decodes=48",
        "--config.checkpoint.every_steps=1"]


def by_host(learner_hosts: int, sampler_hosts: int, devices: int = 2) -> list[str]:
  return [f"--config.mesh.sampler_hosts={sampler_hosts}", f"--config.mesh.sampler_devices={sampler_hosts * devices}",
          f"--config.mesh.learner_devices={learner_hosts * devices}"]


def command(tmp_path) -> list[str]:
  config = tmp_path / "config.py"
  config.write_text(CONFIG)
  return [sys.executable, "-m", "tunixlike.train", "--config", str(config)] + FAST


def train(tmp_path, workdir, n: int, flags: list[str], devices: int = 2, **kwargs):
  return run_processes(command(tmp_path) + flags + [f"--workdir={workdir}"], n, tmp_path, devices=devices,
                       timeout_s=kwargs.pop("timeout_s", 300), **kwargs)


def records(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def learner_dir(workdir, process: int) -> str:
  return str(workdir) if process == 0 else os.path.join(str(workdir), f"process_{process}")


@pytest.mark.multihost
@pytest.mark.parametrize("learner_hosts,sampler_hosts", [(2, 2), pytest.param(1, 3, marks=pytest.mark.multihost_long)])
def test_whole_hosts_train_and_decode_apart(tmp_path, learner_hosts, sampler_hosts):
  n = learner_hosts + sampler_hosts
  workdir = tmp_path / "run"
  results = train(tmp_path, workdir, n, by_host(learner_hosts, sampler_hosts) + ["--config.rl.max_staleness=1"])
  for i, (rc, out) in enumerate(results):
    assert rc == 0, f"process {i} failed (exit {rc}):\n{out[-5000:]}"
  # One start-up line per host: its role and its devices (process 0 prints them all).
  hosts = [l for l in results[0][1].splitlines() if l.startswith("host ")]
  assert [l.split(", devices")[0] for l in hosts] == [
      f"host {p}: {'learner' if p < learner_hosts else 'sampler'}" for p in range(n)]
  for p in range(1, n):
    assert hosts[p] in results[p][1]
  # After every sync (the first weights, then one per step) each sampler host verified that it
  # holds exactly the learner's bits (a checksum of them, computed on both sides).
  for s in range(learner_hosts, n):
    synced = [l for l in results[s][1].splitlines() if l.startswith(f"sampler host {s}: weights v")
              and l.endswith("equal to the learner's")]
    assert [int(l.split(" v")[1].split()[0]) for l in synced] == [0, 1, 2, 3], results[s][1][-3000:]
    checksums = [l.split("checksum ")[1].split()[0] for l in synced]
    assert checksums[-1] != checksums[0]  # the weights changed (a sync of stale weights would not pass)
  # Every learner host trained every step on its share; no prompt trained twice, both shards read.
  trained = []
  for l in range(learner_hosts):
    steps = [r for r in records(os.path.join(learner_dir(workdir, l), "prompts.jsonl"))]
    assert [r["step"] for r in steps] == [0, 1, 2]
    trained += [i for r in steps for i in r["trained"]]
  assert len(trained) == len(set(trained)) == 3 * 4
  assert {i % sampler_hosts for i in trained} == set(range(sampler_hosts))
  losses = [r for r in records(workdir / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in losses] == [0, 1, 2]


@pytest.mark.multihost
@pytest.mark.multihost_long
def test_at_staleness_0_whole_hosts_train_as_one_process(tmp_path):
  # 1 learner host + 1 sampler host of 2 devices each, and one process with the same 2 + 2 devices:
  # the same prompts, the same sampling noise, the same weights at every step, so the same losses.
  flags = ["--config.rl.max_staleness=0"]
  hosts = train(tmp_path, tmp_path / "hosts", 2, by_host(1, 1) + flags)
  one = train(tmp_path, tmp_path / "one", 1, flags + ["--config.mesh.sampler_devices=2",
                                                     "--config.mesh.learner_devices=2"], devices=4, name="one")
  for i, (rc, out) in enumerate(hosts + one):
    assert rc == 0, f"process {i} failed (exit {rc}):\n{out[-5000:]}"
  got = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "hosts" / "metrics.jsonl") if "loss" in r]
  want = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
  assert len(got) == 3 and got == want


@pytest.mark.multihost
def test_a_killed_sampler_host_stops_the_run_naming_it_and_the_same_command_resumes(tmp_path):
  workdir = tmp_path / "run"
  flags = by_host(2, 2) + ["--config.rl.max_staleness=1", "--config.rl.num_steps=4", "--config.mesh.host_timeout_s=10"]
  killed = train(tmp_path, workdir, 4, flags, kill=(3, "sampler host 3: weights v2 arrived", signal.SIGKILL), name="killed")
  rc, out = killed[0]
  assert rc == 1, out[-5000:]
  last = out.strip().splitlines()[-1]
  assert last.startswith("tunixlike.train: error: ") and "host 3" in last and "the last checkpoint is " in last, last
  assert killed[2][0] != 0  # the sampler host that was alive stopped too
  # The same command again resumes from the last checkpoint and finishes the run.
  again = train(tmp_path, workdir, 4, flags, name="again")
  for i, (rc, out) in enumerate(again):
    assert rc == 0, f"process {i} failed (exit {rc}):\n{out[-5000:]}"
  assert "resumed from" in again[0][1]
  trained = [i for l in range(2) for r in records(os.path.join(learner_dir(workdir, l), "prompts.jsonl"))
             for i in r["trained"]]
  assert len(trained) == len(set(trained)) == 4 * 4  # nothing trained twice, every step's batch there
  steps = [r["step"] for r in records(workdir / "metrics.jsonl") if "loss" in r]
  assert steps == [0, 1, 2, 3]


@pytest.mark.multihost
def test_sigterm_on_a_sampler_host_saves_and_stops_every_host(tmp_path):
  workdir = tmp_path / "run"
  flags = by_host(1, 1) + ["--config.rl.num_steps=20", "--config.checkpoint.every_steps=0"]
  results = train(tmp_path, workdir, 2, flags, kill=(1, "sampler host 1: weights v1 arrived", signal.SIGTERM))
  for i, (rc, out) in enumerate(results):
    assert rc == 0, f"process {i} failed (exit {rc}):\n{out[-5000:]}"
  out = results[0][1]
  assert "sampler host 1 received a signal: finishing the current step, saving a checkpoint" in out
  stopped = [l for l in out.splitlines() if l.startswith("stopped at step ")]
  assert len(stopped) == 1 and "checkpoint saved" in stopped[0], out[-3000:]
  step = int(stopped[0].split()[3].rstrip(";"))
  assert 1 <= step < 20 and os.path.isdir(workdir / "checkpoints" / str(step))
