"""Long rollouts across a restart: the tokens in flight at a checkpoint, kept (checkpoint.keep_rollouts)
or decoded again.

  python benchmarks/resume_rollouts.py [--tokens 2048] [--steps 4] [--stop-after 1] [--signal term|kill]
      [--out FILE] [--quick]

Prints one JSON object. The run: configs/long_context_grpo.py on benchmarks/scale.py's `long` random
checkpoint (it emits a stop token about once in 65,536 tokens, so completions run to their limit) with
completions of `--tokens`, 2 prompts of 2 samples per step, rl.max_staleness=1 (the sampler works a
batch ahead) and a checkpoint every step. Two arms, one after the other on this machine (never at
once): checkpoint.keep_rollouts=true, then false. Each is launched, stopped by `--signal` once
`--stop-after` steps are logged (term: SIGTERM, the run saves on its way out; kill: SIGKILL once that
step's checkpoint is written, the periodic checkpoint is the one resumed), and resumed with the same
command to `--steps`. Per arm, from the checkpoint the resume started from and the launches' logs:
  in_flight_tokens       decoded tokens the rollouts in flight held at that checkpoint (its meta)
  kept_tokens            of those, kept by the checkpoint and continued (the run's counter tokens_kept)
  regenerated_share      1 - kept / in flight: the share decoded again (target <= 0.05 with keep_rollouts)
  first_step_after_resume_s  from the resumed launch's start to its first new step record
  prompts_lost, prompts_trained_twice  benchmarks/resume_chaos.py's audit of the finished run (target 0)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import harness
from resume_chaos import audit, checkpoint_steps, read_jsonl

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _flags(p):
  p.add_argument("--tokens", type=int, default=None, help="completion length (default 2048; quick 256)")
  p.add_argument("--steps", type=int, default=None, help="rl.num_steps (default 4; quick 3)")
  p.add_argument("--stop-after", type=int, default=1, help="steps logged before the signal")
  p.add_argument("--signal", choices=("term", "kill"), default="term")
  p.add_argument("--workdir-root", default=None, help="keeps the checkpoint, workdirs and launch logs")
  p.add_argument("--timeout-s", type=float, default=1800.0, help="one launch's limit")


def _command(a, ckpt: str, workdir: str, keep: bool) -> list[str]:
  overrides = {"model.hf_path": ckpt, "sampler.max_new_tokens": a.tokens, "optim.pack_tokens": 2 * a.tokens + 48,
               "rl.num_steps": a.steps, "rl.prompts_per_step": 2, "rl.max_staleness": 1,
               "checkpoint.every_steps": 1, "checkpoint.keep_rollouts": str(keep).lower(), "seed": a.seed,
               "log.tensorboard": "false"}
  return [sys.executable, "-m", "tunixlike.train", "--config", "configs/long_context_grpo.py",
          *[f"--config.{k}={v}" for k, v in overrides.items()], f"--workdir={workdir}"]


def _launch(cmd: list[str], log: str) -> subprocess.Popen:
  env = dict(os.environ, XLA_FLAGS=harness.xla_flags(8))
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, ready, timeout_s: float, log: str) -> float:
  t0 = time.monotonic()
  while not ready():
    if proc.poll() is not None:
      raise RuntimeError(f"the launch exited ({proc.returncode}) before it was due: {log}\n"
                         + open(log).read()[-2000:])
    if time.monotonic() - t0 > timeout_s:
      proc.kill()
      raise RuntimeError(f"timed out: {log}")
    time.sleep(0.1)
  return time.monotonic() - t0


def arm(a, ckpt: str, root: str, keep: bool) -> dict:
  name = "kept" if keep else "regenerated"
  workdir = os.path.join(root, name)
  shutil.rmtree(workdir, ignore_errors=True)  # a fresh run each time
  cmd = _command(a, ckpt, workdir, keep)
  prompts = os.path.join(workdir, "prompts.jsonl")
  logged = lambda: len(read_jsonl(prompts)[0]) if os.path.exists(prompts) else 0
  first = _launch(cmd, f"{workdir}.1.log")
  _wait(first, lambda: logged() >= a.stop_after, a.timeout_s, f"{workdir}.1.log")
  if a.signal == "kill":  # once the step's checkpoint is written (no orbax temporary directory left)
    done = lambda: a.stop_after in checkpoint_steps(workdir) and not any(
        "tmp" in d for d in os.listdir(os.path.join(workdir, "checkpoints")))
    _wait(first, done, a.timeout_s, f"{workdir}.1.log")
  first.send_signal(signal.SIGTERM if a.signal == "term" else signal.SIGKILL)
  first.wait(a.timeout_s)
  before = logged()
  t0 = time.monotonic()
  second = _launch(cmd, f"{workdir}.2.log")
  first_step_s = _wait(second, lambda: logged() > before, a.timeout_s, f"{workdir}.2.log")
  second.wait(a.timeout_s)
  out = open(f"{workdir}.2.log").read()
  if second.returncode != 0:
    raise RuntimeError(f"the resumed launch failed ({second.returncode}):\n{out[-3000:]}")
  resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", out).group(1))
  with open(os.path.join(workdir, "checkpoints", str(resumed_at), "meta", "metadata")) as f:
    meta = json.load(f)
  final = audit(workdir, {"num_steps": a.steps})
  in_flight = sum(meta.get("in_flight_tokens") or [0])
  kept = final["counters"].get("tokens_kept", 0)
  return {"resumed_at_step": resumed_at, "in_flight_tokens": in_flight, "kept_tokens": kept,
          "regenerated_share": round(1 - kept / in_flight, 4) if in_flight else None,
          "resume_line": next(line for line in out.splitlines() if "resumed from" in line),
          "first_step_after_resume_s": round(first_step_s, 1), "resumed_launch_s": round(time.monotonic() - t0, 1),
          "prompts_lost": final["prompts_lost"], "prompts_trained_twice": final["prompts_trained_twice"],
          "final_step": final["final_step"], "stale_drops": final["stale_drops"]}


def main():
  a = harness.parse(__doc__, _flags, quick="256-token completions, 3 steps")
  a.tokens = a.tokens or (256 if a.quick else 2048)
  a.steps = a.steps or (3 if a.quick else 4)
  root = a.workdir_root or tempfile.mkdtemp(prefix="resume_rollouts_")
  os.makedirs(root, exist_ok=True)
  ckpt = os.path.join(root, "long_ckpt")
  if not os.path.exists(os.path.join(ckpt, "config.json")):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"), "--write", ckpt, "--size", "long"],
                   check=True, cwd=ROOT)
  arms = {"kept": arm(a, ckpt, root, keep=True), "regenerated": arm(a, ckpt, root, keep=False)}
  kept, regen = arms["kept"], arms["regenerated"]
  harness.report({
      "tokens": a.tokens, "steps": a.steps, "signal": a.signal, **arms,
      "first_step_after_resume_ratio": round(kept["first_step_after_resume_s"] / regen["first_step_after_resume_s"], 3),
      "targets_met": (kept["regenerated_share"] is not None and kept["regenerated_share"] <= 0.05
                      and all(x["prompts_lost"] == x["prompts_trained_twice"] == 0 and x["final_step"] == a.steps
                              for x in arms.values())),
      "workdir_root": root}, a)


if __name__ == "__main__":
  main()
