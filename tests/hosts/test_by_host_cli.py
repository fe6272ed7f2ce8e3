"""Whole sampler hosts through the CLI: `python -m tunixlike.train` on several CPU processes on
127.0.0.1 (2 virtual devices each) as one job, real async GRPO steps of the tiny addition model.

The same command runs on every process (the JAX_* variables say which one it is); the last
mesh.sampler_hosts processes only decode, the others only train. Each run costs every process its
start-up and its compiles (2 CPU cores for all of them here), so each test shares its runs between
several claims: the default suite's two tests run three jobs in all, 2 + 2 (twice) and 1 + 3.
"""

import json
import os
import signal
import sys

import numpy as np
import pytest

from multiprocess_job import ROOT, run_processes
from local_job import Signal

# The tiny addition job, rewarded for stopping (rewards with variance from the first step, so that
# the weights change at every step without a warm start), decode programs compiled when first used.
# Its prompts are a file of 256 problems (the held-out 8 carved from them): the built-in task's
# 50,000 generated rows are all formatted at start-up, which costs each process more than its run.
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
ERROR = "tunixlike.train: error: "


def by_host(learner_hosts: int, sampler_hosts: int, devices: int = 2) -> list[str]:
  return [f"--config.mesh.sampler_hosts={sampler_hosts}", f"--config.mesh.sampler_devices={sampler_hosts * devices}",
          f"--config.mesh.learner_devices={learner_hosts * devices}"]


def command(tmp_path) -> list[str]:
  config, data = tmp_path / "config.py", tmp_path / "train.jsonl"
  config.write_text(CONFIG)
  with open(data, "w") as f:
    for i in range(256):
      a, b = 10 + i * 37 % 90, 10 + i * 53 % 90
      f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]}) + "\n")
  return [sys.executable, "-m", "tunixlike.train", "--config", str(config), f"--config.data.train={data}"] + FAST


def even_vocab_checkpoint(tmp_path) -> str:
  """A random tiny checkpoint whose vocabulary (the addition task's characters, padded to an even
  count) splits over 2 tensor-parallel devices: the task's own model has 83 tokens."""
  from flax import nnx
  from tunixlike import models
  from tunixlike.data import char_tokenizer
  tok = char_tokenizer.build()
  model = models.Transformer(models.tiny_config(vocab_size=tok.vocab_size + tok.vocab_size % 2), rngs=nnx.Rngs(0))
  path = models.save_pretrained(model, tmp_path / "hf")
  tok.save(str(path))
  return str(path)


def train(tmp_path, workdir, n: int, flags: list[str], devices: int = 2, **kwargs):
  return run_processes(command(tmp_path) + flags + [f"--workdir={workdir}"], n, tmp_path, devices=devices,
                       timeout_s=kwargs.pop("timeout_s", 300), **kwargs)


def succeeded(results) -> None:
  for i, (rc, out) in enumerate(results):
    assert rc == 0, f"process {i} failed (exit {rc}):\n{out[-5000:]}"


def records(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def learner_dir(workdir, process: int) -> str:
  return str(workdir) if process == 0 else os.path.join(str(workdir), f"process_{process}")


def startup_lines(results, learner_hosts: int) -> None:
  """One start-up line per host, its role and its devices (process 0 prints them all)."""
  hosts = [l for l in results[0][1].splitlines() if l.startswith("host ")]
  assert [l.split(", devices")[0] for l in hosts] == [
      f"host {p}: {'learner' if p < learner_hosts else 'sampler'}" for p in range(len(results))]
  for p in range(1, len(results)):
    assert hosts[p] in results[p][1]


def arrivals(out: str, host: int) -> list[tuple[int, str]]:
  """(version, part) of every sync sampler host `host` received and verified (checksum equal)."""
  synced = [l for l in out.splitlines() if l.startswith(f"sampler host {host}: weights v")
            and l.endswith("equal to the learner's")]
  return [(int(l.split(" v")[1].split()[0]), l.split("(")[1].split(")")[0]) for l in synced]


def synced_weights(workdir, host: int) -> dict[str, dict[str, np.ndarray]]:
  """mesh.save_synced_weights: file name -> arrays, as learner host 0 sent them (host 0) or as
  sampler host `host` received them."""
  directory = os.path.join(learner_dir(workdir, host), "synced_weights")
  out = {}
  for name in sorted(os.listdir(directory)):
    with np.load(os.path.join(directory, name), allow_pickle=False) as f:
      out[name] = {k: f[k] for k in f.files}
  return out


def assert_received_exactly(workdir, sampler_hosts) -> dict[str, dict[str, np.ndarray]]:
  """Every sync each sampler host received equals, array by array and bit for bit, what learner
  host 0 sent (float32); returns what was sent."""
  sent = synced_weights(workdir, 0)
  for s in sampler_hosts:
    got = synced_weights(workdir, s)
    assert got and set(got) <= set(sent), (s, sorted(got), sorted(sent))
    for name, arrays in got.items():
      assert sorted(arrays) == sorted(sent[name]), (s, name)
      for key, x in arrays.items():
        assert x.dtype == np.float32 or not np.issubdtype(x.dtype, np.floating), (key, x.dtype)
        assert np.array_equal(x, sent[name][key]), f"sampler host {s}, {name}, {key}: not the learner's"
  return sent


def trained_prompts(workdir, learner_hosts: int, steps: int) -> list[int]:
  """The stream indices trained, from every learner host's prompts.jsonl; each trained every step."""
  trained = []
  for l in range(learner_hosts):
    rows = records(os.path.join(learner_dir(workdir, l), "prompts.jsonl"))
    assert [r["step"] for r in rows] == list(range(steps))
    trained += [i for r in rows for i in r["trained"]]
  return trained


def stopped_at(out: str, workdir) -> int:
  """The step learner host 0 stopped at after a signal, its checkpoint saved there."""
  stopped = [l for l in out.splitlines() if l.startswith("stopped at step ")]
  assert len(stopped) == 1 and "checkpoint saved" in stopped[0], out[-3000:]
  step = int(stopped[0].split()[3].rstrip(";"))
  assert os.path.isdir(workdir / "checkpoints" / str(step))
  return step


@pytest.mark.multihost
def test_two_learner_and_two_sampler_hosts_survive_a_killed_sampler_host_and_a_sigterm_on_a_learner_host(tmp_path):
  """2 learner hosts + 2 sampler hosts. The first run trains until sampler host 3 is killed
  (SIGKILL): every host stops, naming it and the last checkpoint. The same command resumes from
  that checkpoint and trains on until SIGTERM on learner host 1 (not the coordinator's host): the
  learner hosts agree, save and end the run, the sampler hosts follow. Over both runs: every sync
  reached both sampler hosts exactly, the weights changed, no prompt was trained twice."""
  workdir = tmp_path / "run"
  # 16 decode slots per sampler host (2 groups), as in the 1 + 3 test: prefill and insert programs for 1 and 2
  # prompts a call, not 3 more.
  flags = by_host(2, 2) + ["--config.rl.max_staleness=1", "--config.rl.num_steps=20", "--config.sampler.max_concurrent_decodes=32",
                           "--config.mesh.host_timeout_s=10", "--config.mesh.save_synced_weights=true"]
  killed = train(tmp_path, workdir, 4, flags, send=Signal(3, "sampler host 3: weights v2 (model) arrived",
                                                          signal.SIGKILL), name="killed")
  startup_lines(killed, learner_hosts=2)
  for p in (0, 1):  # each learner host: one line naming the dead host and the last checkpoint, then exit 1
    rc, out = killed[p]
    last = out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith(ERROR) and "host 3" in last and "the last checkpoint is " in last, out[-5000:]
    assert sum(l.startswith(ERROR) for l in out.splitlines()) == 1, out[-5000:]
  assert killed[2][0] not in (0, None)  # the sampler host that was alive stopped too
  assert ERROR in killed[2][1] and "host 3" in killed[2][1]
  assert [v for v, _ in arrivals(killed[2][1], 2)][:3] == [0, 1, 2]
  checkpoint = killed[0][1].strip().splitlines()[-1].split("the last checkpoint is ")[1].split(":")[0]
  restored = int(os.path.basename(checkpoint))

  again = train(tmp_path, workdir, 4, flags, name="again",
                send=Signal(1, f"sampler host 2: weights v{restored + 2} (model) arrived", signal.SIGTERM, watch=2))
  succeeded(again)
  assert f"resumed from {checkpoint}" in again[0][1]
  assert "received SIGTERM" in again[1][1]
  steps = stopped_at(again[0][1], workdir)
  assert restored + 2 <= steps < 20
  for s in (2, 3):  # the restored weights first, then one sync per step, each verified
    assert "the learner hosts ended the run" in again[s][1]
    assert [v for v, _ in arrivals(again[s][1], s)] == list(range(restored, steps + 1))
  sent = assert_received_exactly(workdir, (2, 3))
  assert {f"v{v}_model.npz" for v in range(steps + 1)} <= set(sent)
  first, last = sent["v0_model.npz"], sent[f"v{steps}_model.npz"]
  assert any(not np.array_equal(first[k], last[k]) for k in first)  # the weights changed
  trained = trained_prompts(workdir, 2, steps)
  assert len(trained) == len(set(trained)) == steps * 4  # nothing trained twice, every step's batch there
  assert {i % 2 for i in trained} == {0, 1}  # both sampler hosts' shards
  assert [r["step"] for r in records(workdir / "metrics.jsonl") if "loss" in r] == list(range(steps))


@pytest.mark.multihost
def test_one_learner_host_three_sampler_hosts_lora_adapters_only_and_sigterm_on_a_sampler_host(tmp_path):
  """LoRA, 1 learner host + 3 sampler hosts, each decoding tensor-parallel over its 2 devices. The
  first sync carries the model, each later one the adapters only, and every one reaches all three
  sampler hosts exactly. SIGTERM on sampler host 3: the learner host saves and ends the run, every
  sampler host follows."""
  workdir = tmp_path / "run"
  flags = by_host(1, 3) + ["--config.lora.rank=4", "--config.rl.num_steps=20", "--config.checkpoint.every_steps=0",
                           "--config.mesh.save_synced_weights=true", "--config.mesh.sampler_tensor=2",
                           f"--config.model.hf_path={even_vocab_checkpoint(tmp_path)}"]
  results = train(tmp_path, workdir, 4, flags, send=Signal(3, "sampler host 3: weights v3 (adapters) arrived",
                                                           signal.SIGTERM))
  succeeded(results)
  startup_lines(results, learner_hosts=1)
  assert [l.split(", mesh ")[1] for l in results[0][1].splitlines() if l.startswith("host ") and ": sampler," in l] == [
      "{'replica': 1, 'tensor': 2}, weights from host 0"] * 3  # each sampler host decodes tensor-parallel
  assert "sampler host 3 received a signal: finishing the current step, saving a checkpoint" in results[0][1]
  steps = stopped_at(results[0][1], workdir)
  assert 3 <= steps < 20
  for s in (1, 2, 3):
    assert "the learner hosts ended the run" in results[s][1]
    parts = arrivals(results[s][1], s)
    assert parts[0] == (0, "model") and {p for _, p in parts[1:]} == {"adapters"}, parts  # LoRA-only after the first
    assert [v for v, _ in parts] == list(range(len(parts))) and len(parts) >= 4
  sent = assert_received_exactly(workdir, (1, 2, 3))
  adapters = [sent[f"v{v}_adapters.npz"] for v in range(1, steps + 1)]
  assert all(len(a) < len(sent["v0_model.npz"]) for a in adapters)
  assert any(not np.array_equal(adapters[0][k], adapters[-1][k]) for k in adapters[0])  # they trained
  trained = trained_prompts(workdir, 1, steps)
  assert len(trained) == len(set(trained)) == steps * 4
  assert {i % 3 for i in trained} == {0, 1, 2}  # every sampler host's shard


@pytest.mark.multihost
@pytest.mark.multihost_long
def test_at_staleness_0_whole_hosts_train_as_one_process(tmp_path):
  # 1 learner host + 1 sampler host of 2 devices each, and one process with the same 2 + 2 devices:
  # the same prompts, the same sampling noise, the same weights at every step, so the same losses.
  flags = ["--config.rl.max_staleness=0"]
  hosts = train(tmp_path, tmp_path / "hosts", 2, by_host(1, 1) + flags)
  one = train(tmp_path, tmp_path / "one", 1, flags + ["--config.mesh.sampler_devices=2",
                                                     "--config.mesh.learner_devices=2"], devices=4, name="one")
  succeeded(hosts + one)
  got = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "hosts" / "metrics.jsonl") if "loss" in r]
  want = [(r["step"], r["loss"], r["grad_norm"]) for r in records(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
  assert len(got) == 3 and got == want
