"""Resume under chaos: the main job killed N times at random moments, against an uninterrupted run.

  python benchmarks/resume_chaos.py [--kills 20] [--seed 0] [--override KEY=VALUE ...] [--deterministic]
      [--out FILE] [--quick]

Prints one JSON object (and writes it to --out). Two runs of the same command, one after the other
(never at once: the machine has 2 cores):
  uninterrupted  `python -m tunixlike.train --config CONFIG --workdir W1 --config.log.progress_bar=false
                 [--config.KEY=VALUE for each --override]`, run to the end;
  chaos          the same command in W2, killed `--kills` times and restarted each time with the same
                 command until it finishes.
Each kill is planned for a phase (warm_start, eval, rl, checkpoint; the four in a seeded random order
per round of four, the first round opening with warm_start then eval) and a signal (SIGKILL and SIGTERM in equal numbers, shuffled by `--seed`), and is
delivered at a random moment within that phase:
  warm_start  a random fraction of the uninterrupted run's warm-start time after it began (the
              "tunixlike: task" line of a fresh launch; it ends with the last "warm start step" line);
  eval        a random fraction of that eval's time in the uninterrupted run after it began (after the
              warm start, or after the step record of a step that ends on an eval.every_steps boundary;
              it ends with its "eval at step N" line);
  rl          after a random number of new learner steps (lines of W/prompts.jsonl), plus a random
              fraction of a step;
  checkpoint  as soon as the n-th new orbax temporary directory (name containing "tmp") of this launch
              appears in W/checkpoints (n random), i.e. mid-save.
The numbers of steps are drawn so that the kills spread over the remaining steps. A phase that cannot
come again in a launch (the warm start and the first eval once a checkpoint exists; an eval when none
is left before the end) is replaced by another at random; a phase that ended before its moment came
is re-planned in the same launch: `kills_planned_by_phase` and `kills_by_phase` (what the run was
doing when the signal arrived, "checkpoint" whenever a save was in progress) show both.
After a SIGTERM the run should save and exit 0 (`sigterm_exit_codes`); a launch that exits non-zero
without being signalled, or outlives a timeout, is a failure (`failures`); after `--max-failures`
consecutive failures the benchmark stops restarting.

Both workdirs are then audited from what the final model's lineage says:
  W/prompts.jsonl  one line per learner step, {"step", "trained": [stream indices], "dropped": [...]};
  final checkpoint meta (W/checkpoints/<step>/meta/metadata): stream.position, stream.outstanding, counters;
  W/metrics.jsonl  one record per RL step (with `loss`), eval (`eval/accuracy`) and warm start.
  prompts_trained_twice  stream indices appearing more than once across all `trained` lists;
  prompts_lost           indices in range(position) in none of trained, dropped, outstanding;
                         a deterministic run's checkpoint keeps its unexamined groups apart (item
                         "rollouts"): they count as outstanding (`carried`);
  stale_drops            total length of the `dropped` lists (extra_stale_drops: chaos - uninterrupted, >= 0);
  duplicate_metric_steps RL steps with more than one record in metrics.jsonl (duplicate_eval_steps: evals;
                         missing_eval_steps: evals of the uninterrupted run the chaos run lacks);
  final_step             last RL step in metrics.jsonl + 1 (final_checkpoint_step: the checkpoint's);
  time_s_monotonic       metrics.jsonl's wall clock never goes back across resumes.
The target is 0 for the first four over 20 kills, with final_step = rl.num_steps.
When the runs are deterministic (`--deterministic`, or `--override rl.deterministic=true`), a resumed
run must also end where the uninterrupted one did, bit for bit, and both are targets too:
  final_params_equal     every array of the two final checkpoints' `state` (parameters and optimizer
                         state), compared byte for byte in a child process (JAX stays out of this one);
  metrics_equal          each RL step's metrics.jsonl record, timings left out (tunixlike.rl.schedule.TIMING_METRICS);
                         metrics_first_difference: the first step that differs, and its keys.
Launch logs stay in the workdirs' parent (--workdir-root; a temporary one is deleted unless --keep).
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import harness
from determinism import first_difference

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PHASES = ("warm_start", "eval", "rl", "checkpoint")
DEFAULT_CONFIG = "configs/addition_grpo.py"
# Frequent checkpoints, so mid-save moments and short redo distances are common.
DEFAULT_OVERRIDES = ["checkpoint.every_steps=10"]
QUICK_OVERRIDES = ["rl.num_steps=12", "checkpoint.every_steps=2", "data.num_eval_examples=16",
                   "log.tensorboard=false", "eval.every_steps=6"]
POLL_S = 0.02  # short enough to see a small model's orbax temporary directory
FALLBACK_PHASE_S = 2.0  # a phase's duration when the uninterrupted run did not show it


def _flags(p):
  p.add_argument("--kills", type=int, default=None, help="signals to deliver (default 20; quick 3)")
  p.add_argument("--config", default=None, help=f"config file[:variant] (default {DEFAULT_CONFIG}; quick :size=tiny)")
  p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for both runs, e.g. rl.num_steps=100 (repeatable; after the defaults)")
  p.add_argument("--deterministic", action="store_true", help="adds --override rl.deterministic=true")
  p.add_argument("--workdir-root", default=None, help="holds both workdirs and the launch logs (kept)")
  p.add_argument("--keep", action="store_true", help="keep a temporary --workdir-root")
  p.add_argument("--max-failures", type=int, default=3, help="consecutive failed launches before giving up")
  p.add_argument("--launch-timeout-s", type=float, default=None, help="one launch's limit (default 1800; quick 300)")
  p.add_argument("--term-timeout-s", type=float, default=180.0, help="time allowed to save and exit after SIGTERM")
  p.add_argument("--kill-timeout-s", type=float, default=60.0, help="time allowed to die after SIGKILL")


# ---- the config's few settings the schedule needs ---------------------------------------------------
def _override_flags(overrides: list[str]) -> list[str]:
  flags = []
  for o in overrides:
    key = o.lstrip("-").removeprefix("config.")
    if "=" not in key:
      raise SystemExit(f"resume_chaos: --override {o!r} is not KEY=VALUE")
    flags.append(f"--config.{key}")
  return flags


def _load_config(spec: str):
  from tunixlike import config as config_lib  # here: the benchmark's own process never starts JAX
  path, _, arg = spec.partition(":")
  return config_lib.load(os.path.join(ROOT, path), arg or None)


def settings(spec: str, flags: list[str]) -> dict:
  """num_steps, eval / checkpoint intervals and warm-start limits, overrides applied (last wins)."""
  cfg = _load_config(spec)
  given = dict(f.removeprefix("--config.").split("=", 1) for f in flags)

  def value(key):
    section, name = key.split(".")
    default = getattr(getattr(cfg, section), name)
    raw = given.get(key)
    if raw is None:
      return default
    if isinstance(default, bool):
      return raw.lower() in ("1", "true", "yes")
    return type(default)(float(raw) if isinstance(default, int) else raw)

  return {"num_steps": value("rl.num_steps"), "eval_every": value("eval.every_steps"),
          "checkpoint_every": value("checkpoint.every_steps"), "warm_max_steps": value("warm_start.max_steps"),
          "warm_target": value("warm_start.target_accuracy"), "deterministic": value("rl.deterministic")}


# ---- reading a workdir ------------------------------------------------------------------------------
def read_jsonl(path: str) -> tuple[list[dict], int]:
  """(records, lines that are not JSON objects: torn by a kill mid-write, or corrupt)."""
  if not os.path.exists(path):
    return [], 0
  records, bad = [], 0
  with open(path, "rb") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        r = json.loads(line)
      except ValueError:
        bad += 1
        continue
      if isinstance(r, dict):
        records.append(r)
      else:
        bad += 1
  return records, bad


def last_record(path: str) -> dict | None:
  """The last whole line of a JSONL file, read from its end (cheap enough to poll)."""
  try:
    with open(path, "rb") as f:
      size = f.seek(0, os.SEEK_END)
      f.seek(max(0, size - 8192))
      tail = f.read()
  except FileNotFoundError:
    return None
  for line in reversed(tail.split(b"\n")[:-1]):  # the part after the last newline may be torn
    try:
      return json.loads(line)
    except ValueError:
      continue
  return None


def tmp_dirs(workdir: str) -> set[str]:
  try:
    return {n for n in os.listdir(os.path.join(workdir, "checkpoints")) if "tmp" in n}
  except FileNotFoundError:
    return set()


def checkpoint_steps(workdir: str) -> list[int]:
  """Finalized checkpoints that hold their meta."""
  d = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(d):
    return []
  return sorted(int(n) for n in os.listdir(d) if n.isdigit() and os.path.exists(os.path.join(d, n, "meta", "metadata")))


# ---- one launch of the training command -------------------------------------------------------------
# Execs the command with PR_SET_PDEATHSIG = SIGKILL (Linux; kept across exec, same pid), so a benchmark
# killed by a timeout takes its training run with it instead of leaving it on the 2 cores.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "try:\n  ctypes.CDLL(None).prctl(1, signal.SIGKILL)\nexcept (OSError, AttributeError):\n  pass\n"
                    "os.execv(sys.argv[1], sys.argv[1:])")


def with_parent(cmd: list[str]) -> list[str]:
  return [sys.executable, "-c", _DIE_WITH_PARENT, *cmd]


class Launch:
  """One process of a run, its timestamped output, and the phase the workdir and output show."""

  def __init__(self, cmd: list[str], workdir: str, log_path: str, env: dict, s: dict):
    self.workdir, self.s = workdir, s
    self.fresh = not checkpoint_steps(workdir)
    self.stale_tmp = tmp_dirs(workdir)  # a killed save's leftovers, removed by orbax on start
    self.lines: list[tuple[float, str]] = []
    self.t0 = time.monotonic()
    self.proc = subprocess.Popen(with_parent(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    self._log_path = log_path
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    self._seen_lines = 0
    self.announced = self.warm_done = self.in_rl = self.finished = False
    self.start_step = None  # the step this launch's RL begins at
    self.steps_done = 0  # learner steps the workdir holds (last prompts.jsonl step + 1), once in RL
    self.evals_done: set[int] = set()
    self.saves_seen: set[str] = set()
    self.saving = False
    self.phase = self.detail = None
    self.transitions: list[tuple[float, str, object]] = []  # (time, phase, detail) at each change
    self.step_times: list[tuple[float, int]] = []  # (time, steps_done) at each change

  def _read(self):
    with open(self._log_path, "w", encoding="utf-8") as log:
      for line in self.proc.stdout:
        self.lines.append((time.monotonic(), line.rstrip("\n")))
        log.write(line)
        log.flush()

  def output(self) -> str:
    return "\n".join(line for _, line in self.lines)

  def _scan_lines(self):
    s = self.s
    while self._seen_lines < len(self.lines):
      _, line = self.lines[self._seen_lines]
      self._seen_lines += 1
      if line.startswith("tunixlike: task"):
        self.announced = True
      elif m := re.match(r"warm start step (\d+):.*held-out accuracy ([\d.]+)", line):
        self.warm_done = int(m[1]) >= s["warm_max_steps"] or float(m[2]) >= s["warm_target"]
      elif m := re.match(r"eval at step (\d+)", line):
        self.evals_done.add(int(m[1]))
        if self.fresh and int(m[1]) == 0:
          self.in_rl, self.start_step = True, 0
      elif m := re.match(r"resumed from .* at step (\d+)", line):
        self.in_rl, self.start_step = True, int(m[1])
      elif line.startswith("held-out accuracy") or "is finished" in line:
        self.finished = True

  def update(self) -> str:
    """Reads what is new; returns the phase (see `_base_phase`; "checkpoint" while a save runs)."""
    now = time.monotonic()
    self._scan_lines()
    if self.in_rl:
      last = last_record(os.path.join(self.workdir, "prompts.jsonl"))
      done = last["step"] + 1 if last and "step" in last else 0
      if done != self.steps_done:
        self.steps_done = done
        self.step_times.append((now, done))
    present = tmp_dirs(self.workdir)
    self.stale_tmp &= present  # orbax reuses the name (<step>.orbax-checkpoint-tmp) once it cleared the leftover
    fresh_tmp = present - self.stale_tmp
    self.saves_seen |= fresh_tmp
    self.saving = bool(fresh_tmp)
    base, detail = self._base_phase()
    if (base, detail) != (self.phase, self.detail):
      self.phase, self.detail = base, detail
      self.transitions.append((now, base, detail))
    return "checkpoint" if self.saving else base

  def _base_phase(self) -> tuple[str, object]:
    """(phase, detail): startup, warm_start, eval (detail: its step), rl, exit or exited."""
    if self.proc.poll() is not None:
      return "exited", None
    if self.finished:
      return "exit", None
    if not self.in_rl:
      if not self.fresh or not self.announced:
        return "startup", None
      return ("eval", 0) if self.warm_done or not self.s["warm_max_steps"] else ("warm_start", None)
    n, every = self.s["num_steps"], self.s["eval_every"]
    if self.steps_done >= n:
      return "eval", n  # the final save, then the final eval
    if every and self.steps_done > self.start_step and self.steps_done % every == 0 \
        and self.steps_done not in self.evals_done:
      return "eval", self.steps_done
    return "rl", None


# ---- durations of the uninterrupted run's phases (the scale of the random moments) ---------------------
def phase_durations(launch: Launch) -> dict:
  spans: dict[tuple, float] = {}
  marks = launch.transitions + [(launch.transitions[-1][0] if launch.transitions else 0.0, "end", None)]
  for (t, phase, detail), (t_next, _, _) in zip(marks, marks[1:]):
    spans[(phase, detail)] = spans.get((phase, detail), 0.0) + t_next - t
  steps = launch.step_times
  step_s = (steps[-1][0] - steps[0][0]) / max(steps[-1][1] - steps[0][1], 1) if len(steps) > 1 else FALLBACK_PHASE_S
  return {"warm_start_s": spans.get(("warm_start", None)),
          "eval_s": {d: v for (p, d), v in spans.items() if p == "eval"},
          "step_s": step_s, "saves_seen": len(launch.saves_seen)}


# ---- the kill schedule ------------------------------------------------------------------------------
class Plan:
  """When to signal this launch: a phase, a signal and the moment within the phase."""

  def __init__(self, planned: str, phase: str, sig: int, rng: random.Random, launch: Launch, remaining_kills: int,
               durations: dict):
    self.planned, self.phase, self.sig, self.durations = planned, phase, sig, durations
    s = launch.s
    start = current_step(launch)
    left = max(s["num_steps"] - start, 1)
    # Kills spread over the steps still to train: a launch gets about left / (kills + 1) of them.
    span = max(1, min(left - 1, round(2 * left / (remaining_kills + 1))))
    self.frac = rng.uniform(0.05, 0.95)
    self.at_step = start + rng.randint(1, span) if left > 1 else s["num_steps"]
    self.nth_save = len(launch.saves_seen) + rng.randint(1, max(1, span // max(s["checkpoint_every"], 1)))
    self.eval_step = _next_eval(s, start, launch)
    self.due: float | None = None

  def ready(self, launch: Launch, now: float) -> bool | None:
    """True: signal now; False: not yet; None: the phase is over without its moment (re-plan)."""
    base, detail = launch.phase, launch.detail
    if self.phase == "checkpoint":
      return launch.saving and len(launch.saves_seen) >= self.nth_save
    if self.phase == "rl":
      if launch.steps_done >= self.at_step and self.due is None:
        self.due = now + self.frac * self.durations["step_s"]
      return self.due is not None and now >= self.due
    want = ("warm_start", None) if self.phase == "warm_start" else ("eval", self.eval_step)
    if (base, detail) == want:
      if self.due is None:
        scale = self.durations["warm_start_s"] if self.phase == "warm_start" else \
            self.durations["eval_s"].get(self.eval_step) or statistics.median(self.durations["eval_s"].values() or [0])
        self.due = now + self.frac * (scale or FALLBACK_PHASE_S)
      return now >= self.due
    if self.due is not None or _past(want, launch):
      return None
    return False


def current_step(launch: Launch) -> int:
  """Learner steps done: the workdir's count once in RL, else the step the launch will resume at."""
  if launch.in_rl:
    return launch.steps_done
  return 0 if launch.fresh else _restored_step(launch.workdir)


def _restored_step(workdir: str) -> int:
  steps = checkpoint_steps(workdir)
  return steps[-1] if steps else 0


def _next_eval(s: dict, start: int, launch: Launch) -> int:
  """The eval a launch starting (or now) at `start` meets first: 0 when fresh, then every eval_every."""
  if launch.fresh and not launch.in_rl:
    return 0
  every, n = s["eval_every"], s["num_steps"]
  if every:
    nxt = (start // every + 1) * every
    if nxt < n:
      return nxt
  return n  # the final eval


def _past(want: tuple, launch: Launch) -> bool:
  """True when the launch has gone beyond the phase `want` without being in it."""
  phase, detail = want
  if phase == "warm_start":
    return launch.warm_done or launch.in_rl
  if detail == 0:
    return launch.in_rl
  return launch.steps_done > detail or detail in launch.evals_done


def possible_phases(launch: Launch, s: dict, last_kill: bool) -> list[str]:
  """What this launch can still be caught in (the warm start and first eval only before a checkpoint;
  the final eval only for the last kill, since nothing else can follow it)."""
  step = current_step(launch)
  if step >= s["num_steps"]:
    return ["eval"]
  out = ["rl", "checkpoint"]
  if launch.fresh and not launch.in_rl:
    out += ["eval"] + ([] if launch.warm_done else ["warm_start"])
  elif last_kill or _next_eval(s, step, launch) < s["num_steps"]:
    out.append("eval")
  return sorted(out, key=PHASES.index)


# ---- the runs -------------------------------------------------------------------------------------
def train_command(config: str, workdir: str, flags: list[str]) -> list[str]:
  return [sys.executable, "-m", "tunixlike.train", "--config", config, "--workdir", workdir,
          "--config.log.progress_bar=false", *flags]


def _env() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = harness.xla_flags(8, env.get("XLA_FLAGS", ""))  # the main job's 4 + 4 devices
  return env


def say(message: str):
  print(f"[resume_chaos] {message}", file=sys.stderr, flush=True)


def wait_exit(launch: Launch, timeout_s: float) -> int | None:
  """The exit code, or None after `timeout_s` (the launch is then killed)."""
  try:
    return launch.proc.wait(timeout_s)
  except subprocess.TimeoutExpired:
    launch.proc.kill()
    launch.proc.wait(30)
    return None
  finally:
    launch._reader.join(10)


def uninterrupted_run(cmd, workdir, logs, s, timeout_s) -> tuple[Launch, float, int | None]:
  t0 = time.monotonic()
  launch = Launch(cmd, workdir, os.path.join(logs, "uninterrupted.log"), _env(), s)
  deadline = t0 + timeout_s
  while launch.proc.poll() is None and time.monotonic() < deadline:
    launch.update()
    time.sleep(POLL_S)
  rc = wait_exit(launch, max(deadline - time.monotonic(), 0.1))
  launch.update()
  return launch, time.monotonic() - t0, rc


class Chaos:
  """Launches the run until it finishes, signalling it `kills` times."""

  def __init__(self, cmd, workdir, logs, s, args, durations):
    self.cmd, self.workdir, self.logs, self.s, self.args, self.durations = cmd, workdir, logs, s, args, durations
    self.rng = random.Random(args.seed)
    n = args.kills
    self.signals = [signal.SIGTERM, signal.SIGKILL] * (n // 2 + 1)
    self.signals = self.signals[:n]
    self.rng.shuffle(self.signals)
    # Planned phases, a shuffled round of the four at a time; the first round opens with the warm start
    # and the first eval, which only a run without a checkpoint has.
    self.order: list[str] = []
    while len(self.order) < n:
      round_ = list(PHASES)
      self.rng.shuffle(round_)
      if not self.order:
        round_.sort(key=lambda p: p not in ("warm_start", "eval"))  # stable: rl and checkpoint stay shuffled
        round_[:2] = ["warm_start", "eval"]
      self.order += round_
    self.kills: list[dict] = []
    self.failures: list[dict] = []
    self.launches: list[dict] = []
    self.replans = 0

  def run(self) -> float:
    t0 = time.monotonic()
    consecutive = 0
    while consecutive < self.args.max_failures:
      outcome = self._launch(len(self.launches))
      self.launches.append(outcome)
      if outcome["end"] == "killed":
        consecutive = 0 if outcome["kill"]["exit_code"] is not None else consecutive + 1
        continue
      if outcome["end"] == "finished":
        break
      consecutive += 1
    return time.monotonic() - t0

  def _new_plan(self, launch: Launch, only: str | None = None) -> Plan | None:
    k = len(self.kills)
    if k >= self.args.kills:
      return None
    planned = self.order[k]
    possible = [only] if only else possible_phases(launch, self.s, last_kill=k == self.args.kills - 1)
    phase = planned if planned in possible else self.rng.choice(possible)
    return Plan(planned, phase, self.signals[k], self.rng, launch, self.args.kills - k, self.durations)

  def _launch(self, i: int) -> dict:
    launch = Launch(self.cmd, self.workdir, os.path.join(self.logs, f"chaos_{i:02d}.log"), _env(), self.s)
    info = {"launch": i, "fresh": launch.fresh, "from_step": None if launch.fresh else _restored_step(self.workdir)}
    plan, replans = self._new_plan(launch), 0
    deadline = launch.t0 + self.args.launch_timeout_s
    while launch.proc.poll() is None:
      now = time.monotonic()
      phase = launch.update()
      if now > deadline:
        rc = wait_exit(launch, 0)
        return self._failed(info, launch, "launch timeout", rc)
      verdict = plan.ready(launch, now) if plan else False
      if verdict is None:  # the phase ended before its moment: another one (rl, which always comes, at last)
        replans += 1
        self.replans += 1
        planned = plan.planned
        plan = self._new_plan(launch, only="rl" if replans > 3 else None)
        plan.planned = planned
      elif verdict:
        return {**info, "end": "killed", "kill": self._deliver(launch, plan, phase)}
      time.sleep(POLL_S)
    rc = wait_exit(launch, 10)
    launch.update()
    info.update(exit_code=rc, wall_s=round(time.monotonic() - launch.t0, 2))
    if rc == 0 and launch.finished:
      return {**info, "end": "finished"}
    return self._failed(info, launch, "exited without a signal", rc)

  def _deliver(self, launch: Launch, plan: Plan, phase: str) -> dict:
    saving = sorted(tmp_dirs(launch.workdir) - launch.stale_tmp) if phase == "checkpoint" else None
    t = time.monotonic()
    launch.proc.send_signal(plan.sig)
    rc = wait_exit(launch, self.args.term_timeout_s if plan.sig == signal.SIGTERM else self.args.kill_timeout_s)
    kill = {"n": len(self.kills), "planned": plan.planned, "chosen": plan.phase, "phase": phase,
            "during": launch.phase if phase == "checkpoint" else None, "eval_step": launch.detail,
            "signal": signal.Signals(plan.sig).name, "steps_done": launch.steps_done if launch.in_rl else None,
            "t_in_launch_s": round(t - launch.t0, 2), "exit_code": rc, "exit_s": round(time.monotonic() - t, 2),
            "saving_dirs": saving,
            "saved": "checkpoint saved" in launch.output()}
    self.kills.append(kill)
    say(f"kill {kill['n']}: {kill['signal']} in {phase} (planned {plan.planned}), step {kill['steps_done']}, "
        f"exit {rc} after {kill['exit_s']} s")
    if rc is None:
      self.failures.append({"launch": len(self.launches), "why": f"no exit within the timeout after {kill['signal']}",
                            "output_tail": launch.output()[-1500:]})
    return kill

  def _failed(self, info: dict, launch: Launch, why: str, rc) -> dict:
    failure = {"launch": info["launch"], "why": why, "exit_code": rc, "output_tail": launch.output()[-1500:]}
    self.failures.append(failure)
    say(f"launch {info['launch']} failed: {why} (exit {rc})")
    return {**info, "end": "failed", "exit_code": rc}


# ---- the audit ----------------------------------------------------------------------------------------
def audit(workdir: str, s: dict) -> dict:
  prompts, torn_prompts = read_jsonl(os.path.join(workdir, "prompts.jsonl"))
  metrics, torn_metrics = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  steps = checkpoint_steps(workdir)
  meta = {}
  if steps:
    with open(os.path.join(workdir, "checkpoints", str(steps[-1]), "meta", "metadata")) as f:
      meta = json.load(f)
  stream = meta.get("stream", {})
  position, outstanding = stream.get("position", 0), stream.get("outstanding", [])
  carried = carried_indices(workdir, steps[-1]) if meta.get("carried") else []
  outstanding = [*outstanding, *carried]
  trained = collections.Counter(i for r in prompts for i in r.get("trained", []))
  dropped = collections.Counter(i for r in prompts for i in r.get("dropped", []))
  lost = sorted(set(range(position)) - set(trained) - set(dropped) - set(outstanding))
  twice = sorted(i for i, n in trained.items() if n > 1)
  rl = collections.Counter(r["step"] for r in metrics if "loss" in r)
  evals = collections.Counter(r["step"] for r in metrics if "eval/accuracy" in r)
  times = [r["time_s"] for r in metrics if isinstance(r.get("time_s"), (int, float))]
  backwards = sum(b < a for a, b in zip(times, times[1:]))
  final_evals = [r["eval/accuracy"] for r in metrics if "eval/accuracy" in r and r["step"] == s["num_steps"]]
  log_steps = [r.get("step") for r in prompts]
  counters = meta.get("counters", {})
  return {
      "prompts_lost": len(lost), "prompts_trained_twice": len(twice),
      "stale_drops": sum(dropped.values()), "groups_dropped_counter": counters.get("groups_dropped"),
      "duplicate_metric_steps": sum(n > 1 for n in rl.values()),
      "duplicate_metric_records": sum(n - 1 for n in rl.values()),
      "duplicate_eval_steps": sum(n > 1 for n in evals.values()),
      "final_step": max(rl) + 1 if rl else 0, "final_checkpoint_step": steps[-1] if steps else None,
      "missing_metric_steps": len(set(range(s["num_steps"])) - set(rl)),
      "time_s_monotonic": backwards == 0, "time_s_backward_jumps": backwards,
      "prompt_log_steps_exact": log_steps == list(range(len(log_steps))),
      "prompt_log_steps": len(log_steps), "prompts_trained": sum(trained.values()),
      "prompts_dropped_twice": sum(n > 1 for n in dropped.values()),
      "prompts_trained_and_dropped": len(set(trained) & set(dropped)),
      "indices_past_position": len((set(trained) | set(dropped) | set(outstanding)) - set(range(position))),
      "stream_position": position, "outstanding": len(outstanding), "carried": len(carried), "counters": counters,
      "eval_records": sum(evals.values()), "eval_steps": sorted(evals),
      "warm_start_records": sum("warm_start/steps" in r for r in metrics),
      "final_eval_accuracy": final_evals[-1] if final_evals else None,
      "torn_lines": {"prompts": torn_prompts, "metrics": torn_metrics},
      "examples": {"lost": lost[:10], "trained_twice": twice[:10],
                   "duplicate_metric_steps": sorted(k for k, n in rl.items() if n > 1)[:20],
                   "duplicate_eval_steps": sorted(k for k, n in evals.items() if n > 1)},
  }


def carried_indices(workdir: str, step: int) -> list[int]:
  """The prompts of the rollouts in flight a checkpoint kept (orbax item "rollouts", rl/in_flight.py): a
  deterministic run's are not in the stream's `outstanding`, and they are not lost."""
  from tunixlike import rollout  # numpy only: this process never starts JAX
  with open(os.path.join(workdir, "checkpoints", str(step), "rollouts", "metadata")) as f:
    per_process = json.load(f)["processes"]
  return [g.columns["stream_index"] for kept in per_process for g in rollout.groups_from_json(kept["scored"])] + \
         [rollout.from_json(g)["request"]["columns"]["stream_index"] for kept in per_process for g in kept["in_flight"]]


# ---- a deterministic run ends where the uninterrupted one did -----------------------------------------
# In a child with the runs' devices: orbax restores each array onto the devices it was saved from.
_COMPARE_STATE = """
import json, sys
import jax, numpy as np, orbax.checkpoint as ocp
with ocp.PyTreeCheckpointer() as reader:
  a, b = (jax.tree_util.tree_flatten_with_path(reader.restore(path))[0] for path in sys.argv[1:3])
def same(x, y):
  x, y = np.asarray(x), np.asarray(y)
  return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
paths_equal = [p for p, _ in a] == [p for p, _ in b]
differing = [jax.tree_util.keystr(p) for (p, x), (_, y) in zip(a, b) if not same(x, y)]
print(json.dumps({"equal": bool(a) and paths_equal and not differing, "arrays": len(a),
                  "paths_equal": paths_equal, "differing": differing[:5]}))
"""


def compare_state(clean_dir: str, chaos_dir: str) -> dict:
  """Whether the two runs' final checkpoints hold the same `state`, array by array and bit for bit."""
  steps = [checkpoint_steps(d) for d in (clean_dir, chaos_dir)]
  if not all(steps):
    return {"equal": False, "why": "a run has no checkpoint"}
  paths = [os.path.join(d, "checkpoints", str(st[-1]), "state") for d, st in zip((clean_dir, chaos_dir), steps)]
  done = subprocess.run([sys.executable, "-c", _COMPARE_STATE, *paths], cwd=ROOT, env=_env(), capture_output=True,
                        text=True)
  if done.returncode:
    return {"equal": False, "why": done.stderr[-1500:]}
  return {**json.loads(done.stdout.splitlines()[-1]), "steps": [st[-1] for st in steps]}


def step_metrics(workdir: str) -> list[dict]:
  """Each RL step's metrics record (the last one logged for it), in step order."""
  by_step = {r["step"]: r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))[0] if "loss" in r}
  return [by_step[k] for k in sorted(by_step)]


def add_determinism(result: dict, clean_dir: str, chaos_dir: str):
  state = compare_state(clean_dir, chaos_dir)
  diff = first_difference(step_metrics(clean_dir), step_metrics(chaos_dir))
  result.update(final_params_equal=state["equal"], final_state=state, metrics_equal=diff is None,
                metrics_first_difference=diff)
  result["targets_met"] = result["targets_met"] and state["equal"] and diff is None


def _count(values) -> dict:
  return dict(sorted(collections.Counter(values).items()))


def summarize(args, cmd_clean, cmd_chaos, s, clean, clean_wall, clean_rc, chaos, chaos_wall, durations) -> dict:
  a, b = audit(chaos.workdir, s), clean
  kills = chaos.kills
  result = {
      "benchmark": "resume_chaos", "kills_requested": args.kills,
      "kills": len(kills), "kills_by_signal": _count(k["signal"] for k in kills),
      "kills_by_phase": _count(k["phase"] for k in kills),
      "kills_planned_by_phase": _count(k["planned"] for k in kills),
      "kills_replanned": chaos.replans,
      "sigterm_exit_codes": _count(str(k["exit_code"]) for k in kills if k["signal"] == "SIGTERM"),
      "sigkill_exit_codes": _count(str(k["exit_code"]) for k in kills if k["signal"] == "SIGKILL"),
      "sigterm_not_zero_by_phase": _count(k["phase"] for k in kills if k["signal"] == "SIGTERM" and k["exit_code"] != 0),
      "restarts": max(len(chaos.launches) - 1, 0), "failures": chaos.failures,
      "finished": bool(chaos.launches) and chaos.launches[-1]["end"] == "finished",
      "prompts_lost": a["prompts_lost"], "prompts_trained_twice": a["prompts_trained_twice"],
      "stale_drops": a["stale_drops"], "extra_stale_drops": max(0, a["stale_drops"] - b["stale_drops"]),
      "duplicate_metric_steps": a["duplicate_metric_steps"], "duplicate_eval_steps": a["duplicate_eval_steps"],
      # Evals the uninterrupted run logged and the chaos run did not (a kill mid-eval that is not redone).
      "missing_eval_steps": sorted(set(b["eval_steps"]) - set(a["eval_steps"])),
      "final_step": a["final_step"], "final_checkpoint_step": a["final_checkpoint_step"], "num_steps": s["num_steps"],
      "time_s_monotonic": a["time_s_monotonic"],
      "wall_s_chaos": round(chaos_wall, 2), "wall_s_uninterrupted": round(clean_wall, 2),
      "uninterrupted_exit_code": clean_rc,
      "chaos": a, "uninterrupted": b,
      "command": shlex.join(cmd_chaos), "command_uninterrupted": shlex.join(cmd_clean),
      "benchmark_command": shlex.join([sys.executable, *sys.argv]),
      "settings": s, "phase_durations_uninterrupted": {
          "warm_start_s": durations["warm_start_s"], "step_s": durations["step_s"],
          "eval_s": {str(k): round(v, 2) for k, v in durations["eval_s"].items()},
          "saves_seen": durations["saves_seen"]},
      "kill_log": kills, "launches": chaos.launches,
  }
  result["targets_met"] = (result["finished"] and a["final_step"] == s["num_steps"] and not any(
      result[k] for k in ("prompts_lost", "prompts_trained_twice", "extra_stale_drops", "duplicate_metric_steps")))
  return result


def main():
  args = harness.parse(__doc__, _flags, quick="tiny variant, 12 steps, 3 kills; a few minutes",
                       seed="seeds the phases, signals and moments")
  args.kills = args.kills if args.kills is not None else (3 if args.quick else 20)
  args.launch_timeout_s = args.launch_timeout_s or (300.0 if args.quick else 1800.0)
  config = args.config or (DEFAULT_CONFIG + (":size=tiny" if args.quick else ""))
  flags = _override_flags((QUICK_OVERRIDES if args.quick else DEFAULT_OVERRIDES) + args.override
                         + (["rl.deterministic=true"] if args.deterministic else []))
  s = settings(config, flags)
  root = args.workdir_root or tempfile.mkdtemp(prefix="resume_chaos_")
  clean_dir, chaos_dir, logs = (os.path.join(root, n) for n in ("uninterrupted", "chaos", "logs"))
  for d in (clean_dir, chaos_dir):
    if os.path.exists(d):
      raise SystemExit(f"resume_chaos: {d} exists; use a new --workdir-root")
  os.makedirs(logs, exist_ok=True)
  try:
    cmd_clean, cmd_chaos = train_command(config, clean_dir, flags), train_command(config, chaos_dir, flags)
    say(f"uninterrupted run: {shlex.join(cmd_clean)}")
    clean_launch, clean_wall, clean_rc = uninterrupted_run(cmd_clean, clean_dir, logs, s, args.launch_timeout_s)
    durations = phase_durations(clean_launch)
    say(f"uninterrupted run: exit {clean_rc} in {clean_wall:.0f} s; phases {durations}")
    chaos = Chaos(cmd_chaos, chaos_dir, logs, s, args, durations)
    chaos_wall = chaos.run()
    result = summarize(args, cmd_clean, cmd_chaos, s, audit(clean_dir, s), clean_wall, clean_rc, chaos,
                       chaos_wall, durations)
    if s["deterministic"]:
      say("comparing the two runs' final checkpoints and metrics")
      add_determinism(result, clean_dir, chaos_dir)
    result["workdir_root"] = root if (args.workdir_root or args.keep) else None
  finally:
    if not (args.workdir_root or args.keep):
      shutil.rmtree(root, ignore_errors=True)
  harness.report(result, args, default=str)


if __name__ == "__main__":
  main()
