"""A user's config that names only the data, the answer column and the reward: does RL learn with the
library's defaults?

  python benchmarks/defaults.py [--tasks countdown,sort,spell] [--timeout-s 600] [--override KEY=VALUE ...]
                                [--workdir-root DIR] [--out FILE] [--quick]

For each task the benchmark writes a user's files into its own folder: train.jsonl and test.jsonl,
rewards.py (a 0/1 verifier) and config.py, which sets data.train, data.eval, data.prompt_field,
data.answer_field, data.num_eval_examples and rewards, nothing else. Then it runs
`python -m tunixlike.train --config DIR/config.py --workdir DIR/run` (one task at a time: the machine
has 2 cores), stopped by SIGINT at `--timeout-s` (the checkpoint it leaves counts as the end), and reads
DIR/run/metrics.jsonl: held-out accuracy after the supervised stage (the eval at RL step 0), the best
and the last RL eval, the wall clock of the whole command.

The tasks, each a different answer length (tokens of the char tokenizer, with the end token):
  countdown  examples/countdown's data and `correct` reward: reach the target from three numbers
             ("3 5 7 to 22:" -> "3*5=15,15+7=22"), 6-15 tokens
  sort       four distinct letters of a..h in order ("sort hbea:" -> "abeh"), 5 tokens
  spell      a number's digits as words ("spell 407:" -> "four zero seven"), 4-18 tokens
Target (issue 51): each ends at least 10 points above its supervised accuracy within 10 minutes.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time

import harness
from tunixlike.metrics import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(REPO, "examples", "countdown")
# The lines in which the run says what it chose for the keys the config leaves None.
CHOSEN = ("optim.learning_rate=", "sampler.temperature=", "warm_start.max_steps=", "sampler.max_new_tokens=")
WORDS = "zero one two three four five six seven eight nine".split()

EXACT_REWARD = '''\
"""0/1: the completion's first line, stripped, equals the answer column."""


def exact(completions, answer):
  return [float(c.split("\\n")[0].strip() == a) for c, a in zip(completions, answer, strict=True)]
'''

CONFIG = '''\
"""{name}: only the data, the answer column and the reward; every other key is the library's default."""
import os

from tunixlike import config

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(arg=None):
  config.parse_arg(arg)
  c = config.default_config_dict()
  c.data.task = None
  c.data.train = {train!r}
  c.data.eval = {eval!r}
  c.data.prompt_field = {prompt!r}
  c.data.answer_field = {answer!r}
  c.data.num_eval_examples = {num_eval}
  c.rewards = [dict(fn={reward!r}, weight=1.0)]
  return c
'''


def sort_rows(rng: random.Random) -> list[dict]:
  rows = [{"problem": f"sort {''.join(p)}:", "answer": "".join(sorted(p))}
          for p in itertools.permutations("abcdefgh", 4)]
  rng.shuffle(rows)
  return rows


def spell_rows(rng: random.Random) -> list[dict]:
  rows = [{"problem": f"spell {n}:", "answer": " ".join(WORDS[int(d)] for d in str(n))} for n in range(1000)]
  rng.shuffle(rows)
  return rows


def write_jsonl(path: str, rows) -> None:
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def write_task(name: str, folder: str, rng: random.Random, num_eval: int) -> str:
  """The user's files of task `name` in `folder`; returns its config's path."""
  os.makedirs(folder, exist_ok=True)
  if name == "countdown":
    spec = dict(train=os.path.join(COUNTDOWN, "train.jsonl"), eval=os.path.join(COUNTDOWN, "test.jsonl"),
                prompt="problem", answer="solution", reward=os.path.join(COUNTDOWN, "rewards.py") + ":correct")
  else:
    rows = (sort_rows if name == "sort" else spell_rows)(rng)
    write_jsonl(os.path.join(folder, "test.jsonl"), rows[:200])
    write_jsonl(os.path.join(folder, "train.jsonl"), rows[200:])
    with open(os.path.join(folder, "rewards.py"), "w") as f:
      f.write(EXACT_REWARD)
    spec = dict(train="./train.jsonl", eval="./test.jsonl", prompt="problem", answer="answer",
                reward="./rewards.py:exact")
  path = os.path.join(folder, "config.py")
  with open(path, "w") as f:
    f.write(CONFIG.format(name=name, num_eval=num_eval, **spec))
  return path


def evals(metrics_path: str) -> list[tuple[int, float]]:
  """(RL step, held-out accuracy) of every RL eval in a metrics.jsonl."""
  return [(r["step"], r["eval/accuracy"]) for r in read_jsonl(metrics_path) if "eval/accuracy" in r]


def run_task(folder: str, config_path: str, args) -> dict:
  workdir = os.path.join(folder, "run")
  cmd = [sys.executable, "-m", "tunixlike.train", "--config", config_path, "--workdir", workdir,
         "--config.log.progress_bar=false", *(f"--config.{o}" for o in args.override)]
  log_path = os.path.join(folder, "train.log")
  start = time.monotonic()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=harness.device_env(8))
    try:
      rc = proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:  # the budget: Ctrl-C leaves a checkpoint, as a user's would
      proc.send_signal(signal.SIGINT)
      rc = proc.wait()
  wall = time.monotonic() - start
  with open(log_path) as f:
    lines = f.read().splitlines()
  points = evals(os.path.join(workdir, "metrics.jsonl"))
  start_acc = next((a for s, a in points if s == 0), None)
  last = points[-1] if points else (None, None)
  best = max(points, key=lambda p: p[1]) if points else (None, None)
  return {"command": shlex.join(cmd), "exit_code": rc, "wall_s": round(wall, 1),
          "chosen": [l for l in lines if l.startswith(CHOSEN)],
          "supervised_accuracy": start_acc, "final_step": last[0], "final_accuracy": last[1],
          "gain_points": None if start_acc is None or last[1] is None else round(100 * (last[1] - start_acc), 1),
          "best_step": best[0], "best_accuracy": best[1], "evals": points,
          "stopped_by": ("budget" if wall >= args.timeout_s else "unlearning guard" if rc == 1 and any(
              "unlearning" in l for l in lines[-3:]) else "end" if rc == 0 else f"exit {rc}"),
          "last_lines": lines[-2:]}


def main():
  args = harness.parse(__doc__, lambda p: (
      p.add_argument("--tasks", default="countdown,sort,spell"),
      p.add_argument("--timeout-s", type=float, default=600.0, help="the run's wall-clock budget (SIGINT then)"),
      p.add_argument("--override", action="append", default=[], help="KEY=VALUE, e.g. rl.num_steps=2"),
      p.add_argument("--workdir-root", default=None, help="the tasks' folders (default: a new temporary one)")),
      quick="two RL steps and 16 held-out prompts a task")
  root = args.workdir_root or os.path.join("/tmp", f"tunixlike-defaults-{os.getpid()}")
  if args.quick:
    args.override += ["rl.num_steps=2", "warm_start.max_steps=4", "warm_start.eval_every=2"]
  rng = random.Random(args.seed)
  results = {}
  for name in args.tasks.split(","):
    folder = os.path.join(root, name)
    config_path = write_task(name, folder, rng, num_eval=16 if args.quick else 200)
    results[name] = run_task(folder, config_path, args)
  gains = [r["gain_points"] for r in results.values()]
  harness.report({"tasks": results, "target_points": 10.0, "timeout_s": args.timeout_s,
                  "met": all(g is not None and g >= 10.0 for g in gains), "workdir_root": root}, args)


if __name__ == "__main__":
  main()
