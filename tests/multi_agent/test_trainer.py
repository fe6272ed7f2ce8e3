"""Multi-agent runs as a user meets them: the CLI in a subprocess, stopped with SIGTERM and resumed."""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELF_PLAY = ["--config", "configs/self_play.py:size=tiny", "--config.log.progress_bar=false",
             "--config.log.tensorboard=false"]
# The scripted env of tests/multi_agent/relay.py by import path: policy a takes two turns, b one of two samples,
# rewards are text lengths, so both policies train every step.
RELAY = [*SELF_PLAY, "--config.multi_agent.env=tests/multi_agent/relay.py:Relay",
         "--config.multi_agent.policies=({'name': 'a', 'group_size': 1, 'turns': 2}, {'name': 'b', 'group_size': 2})",
         "--config.multi_agent.eval_policy=a", "--config.checkpoint.every_steps=3"]


def start(workdir, *args):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.Popen([sys.executable, "-m", "tunixlike.train", *args, f"--workdir={workdir}"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def records(path):
  return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


def meta(workdir, step):
  return json.load(open(f"{workdir}/checkpoints/{step}/meta/metadata"))


@pytest.mark.slow
def test_a_tiny_self_play_run_logs_each_policy_and_checkpoints_both(tmp_path):
  workdir = str(tmp_path / "run")
  out, _ = start(workdir, *SELF_PLAY).communicate(timeout=600)
  assert "multi-agent: self_play with policies proposer (1 samples a turn), solver (4 samples a turn)" in out, out[-3000:]
  assert re.search(r"held-out accuracy \d\.\d+ -> \d\.\d+", out), out[-3000:]
  metrics = records(f"{workdir}/metrics.jsonl")
  steps = [r for r in metrics if "loss" in r]
  assert [r["step"] for r in steps] == [0, 1, 2]
  for r in steps:  # the untrained proposer's problems are rarely valid: every step trains it
    assert {"proposer/loss", "proposer/reward", "proposer/version", "proposer/staleness_max"} <= set(r)
    assert r["proposer/staleness_max"] <= 1
  assert [r["step"] for r in metrics if "eval/accuracy" in r] == [0, 3]
  log = records(f"{workdir}/prompts.jsonl")
  assert [r["step"] for r in log] == [0, 1, 2] and [len(r["trained"]) for r in log] == [4, 4, 4]
  final = meta(workdir, 3)
  assert final["step"] == 3 and final["versions"]["proposer"] == 3 and set(final["versions"]) == {"proposer", "solver"}
  assert final["versions"]["solver"] == sum(r.get("solver/turns", 0) > 0 for r in steps)
  # One orbax item holds every policy's learner state.
  state = json.load(open(f"{workdir}/checkpoints/3/state/_METADATA"))
  saved = {ast.literal_eval(key)[0] for key in state["tree_metadata"]}
  assert saved == {"proposer", "solver"}, saved


@pytest.mark.slow
def test_sigterm_mid_run_then_the_same_command_resumes_with_exact_accounting(tmp_path):
  workdir, steps = str(tmp_path / "run"), 60
  args = [*RELAY, f"--config.rl.num_steps={steps}"]
  proc = start(workdir, *args)
  deadline = time.monotonic() + 300
  while not records(f"{workdir}/prompts.jsonl"):
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.monotonic() < deadline, "no step within 300 s"
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  stopped = int(re.search(r"stopped at step (\d+); checkpoint saved", out).group(1))
  assert 1 <= stopped < steps
  kept = meta(workdir, stopped)
  assert kept["versions"] == {"a": stopped, "b": stopped}  # both policies step every batch (each has turns)
  in_flight = kept["records"]["outstanding"]

  out, _ = start(workdir, *args).communicate(timeout=600)
  assert f"resumed from {workdir}/checkpoints/{stopped} at step {stopped}" in out, out[-3000:]
  assert f"regenerating {len(in_flight)} episodes that were in flight" in out
  log = records(f"{workdir}/prompts.jsonl")
  assert [r["step"] for r in log] == list(range(steps))  # steps continue; none twice
  trained = [i for r in log for i in r["trained"]]
  dropped = [i for r in log for i in r["dropped"]]
  assert len(trained) == len(set(trained)) == steps * 4  # no episode trained twice
  final = meta(workdir, steps)
  assert set(trained) | set(dropped) | set(final["records"]["outstanding"]) == set(range(final["records"]["position"]))
  assert set(in_flight) <= set(trained) | set(dropped) | set(final["records"]["outstanding"])  # replayed, not lost
  assert final["versions"] == {"a": steps, "b": steps}
  assert final["counters"]["episodes_regenerated"] == len(in_flight)
  assert final["counters"]["episodes_trained"] == steps * 4
  rl = [r for r in records(f"{workdir}/metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in rl] == list(range(steps))
  assert [r["a/version"] for r in rl] == list(range(1, steps + 1))  # the restored versions go on
  # checkpoint.keep latest ones and the best (no replay points: a multi-agent run records no schedule).
  kept_steps = sorted(int(d) for d in os.listdir(f"{workdir}/checkpoints") if d.isdigit())
  assert 0 not in kept_steps and kept_steps[-1] == steps and not os.path.exists(f"{workdir}/schedule.jsonl")
  # Once more: the run is finished, and says so.
  out, _ = start(workdir, *args).communicate(timeout=600)
  assert f"is finished (step {steps} of rl.num_steps={steps}); nothing to do" in out, out[-3000:]


@pytest.mark.parametrize("args,expected", [
    (["--config.multi_agent.episodes_per_step=0"], "multi_agent.episodes_per_step=0: must be an int >= 1"),
    (["--config.multi_agent.env=chess"], "multi_agent.env='chess': must be 'self_play' or an import path"),
    (["--config.multi_agent.eval_policy=critic"], "multi_agent.eval_policy='critic': must name one of"),
    (["--config.multi_agent.policies=({'name': 'proposer', 'group_size': 1}, {'name': 'solver', 'group_size': 4, "
      "'sampler': {'temperature': -1.0}})"], "multi_agent.policies[1].sampler.temperature=-1.0: must be"),
    (["--config.rl.env=calculator"], "rl.env='calculator': is not supported with multi_agent.env='self_play'"),
    (["--config.multi_agent.env=no_such_module:Env"], "multi_agent.env='no_such_module:Env': importing no_such_module"),
])
def test_a_bad_multi_agent_key_is_one_line_and_status_2(args, expected):
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", *SELF_PLAY, *args, "--check_only"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and expected in lines[0], out.stderr


@pytest.mark.slow
def test_an_env_that_cannot_be_loaded_is_named_before_any_training(tmp_path):
  out, _ = start(str(tmp_path / "run"), *SELF_PLAY, "--config.multi_agent.env=no_such_module:Env").communicate(
      timeout=300)
  lines = out.strip().splitlines()
  assert lines[-1].startswith("tunixlike.train: error: multi_agent.env='no_such_module:Env'"), out[-3000:]
  assert "eval at step" not in out


@pytest.mark.slow
def test_a_crash_saves_the_last_good_states_and_the_python_api_resumes_from_them(tmp_path):
  """`tunixlike.train` runs multi-agent configs too; a hook that raises stops the run after saving."""
  import tunixlike

  workdir = str(tmp_path / "run")
  config = tunixlike.load_config(os.path.join(ROOT, "configs/self_play.py:size=tiny"),
                                 {"log.progress_bar": False, "log.tensorboard": False})
  seen = []

  def breaks(info):
    seen.append((info.step, info.version, len(info.trained)))
    if info.step == 1:
      raise RuntimeError("a hook broke")

  with pytest.raises(RuntimeError, match="a hook broke"):
    tunixlike.train(config, workdir, hooks=[breaks])
  assert [s[:2] for s in seen] == [(0, 1), (1, 2)] and all(n >= 4 for _, _, n in seen)  # a turn group per turn
  assert meta(workdir, 2)["step"] == 2  # the state after the step whose hook raised
  summary = tunixlike.train(config, workdir, hooks=[lambda info: seen.append(info.step)])
  assert seen[-1] == 2 and summary["step"] == 3
  log = records(f"{workdir}/prompts.jsonl")
  assert [r["step"] for r in log] == [0, 1, 2]
  trained = [i for r in log for i in r["trained"]]
  assert len(trained) == len(set(trained)) == 12
