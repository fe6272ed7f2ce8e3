"""Whole hosts per side under faults: one run through kill -9 of either side, a missing peer and busy
ports, then audited for lost and twice-trained prompts (the split-host sibling of resume_chaos.py).

  python benchmarks/host_faults.py [--steps 12] [--host-timeout 10] [--out FILE] [--keep]

The tiny addition job on 1 learner host + 1 sampler host (2 CPU processes of 2 virtual devices on
127.0.0.1, `benchmarks/local_job.py`, a checkpoint every step), launched in one work directory with
the same command each time:
  kill_sampler_host   SIGKILL on the sampler host after its 3rd weight sync: the learner host must exit
                      1 with one line naming host 1;
  kill_learner_host   SIGKILL on learner host 0 (the coordinator's) two syncs after the restored weights:
                      the sampler host must exit 1 with one line (`hosts.watch`), no JAX trace;
  missing_peer        only process 0 started: exit 2 naming process id 1 within mesh.host_timeout_s;
  busy_port           the coordinator's port taken: exit 2 on both, naming the port;
  busy_transfer_port  the sampler host's transfer port (coordinator port + 2) taken: exit 2 on both;
  finish              the same command to rl.num_steps: exit 0 on both.
Each fault records the exit codes, whether every process's last line is its one error line with no
JAX trace or Python traceback (`one_line`), the line, and its wall time. The audit reads the work
directory as resume_chaos.py does (WORKDIR/prompts.jsonl, the final checkpoint's `streams`):
prompts_lost and prompts_trained_twice must be 0, final_step = --steps. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from resume_chaos import checkpoint_steps, read_jsonl  # noqa: E402
import local_job  # noqa: E402

ERROR = "tunixlike.train: error: "
JAX_TRACE = ("Check failure stack trace", "client.h", "RegisterTask", "Traceback")
CONFIG = """
import os
from tunixlike import config

def get_config(arg=None):
  c = config.load(os.path.join({root!r}, "configs", "addition_grpo.py"), "size=tiny")
  c.rewards = ({{"fn": "stopped", "weight": 1.0}},)  # variance from the first step: the weights change
  c.warm_start.max_steps = 0
  c.sampler.warmup = False
  return c
"""


def command(scratch: str, workdir: str, steps: int, host_timeout_s: float) -> list[str]:
  config, data = os.path.join(scratch, "config.py"), os.path.join(scratch, "train.jsonl")
  with open(config, "w") as f:
    f.write(CONFIG.format(root=os.path.abspath(ROOT)))
  with open(data, "w") as f:
    for i in range(256):
      a, b = 10 + i * 37 % 90, 10 + i * 53 % 90
      f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]}) + "\n")
  return [sys.executable, "-m", "tunixlike.train", "--config", config, f"--config.data.train={data}",
          f"--workdir={workdir}", "--config.data.num_eval_examples=8", "--config.log.progress_bar=false",
          "--config.log.tensorboard=false", f"--config.rl.num_steps={steps}", "--config.rl.prompts_per_step=4",
          "--config.sampler.max_concurrent_decodes=16", "--config.checkpoint.every_steps=1",
          f"--config.mesh.host_timeout_s={host_timeout_s:g}", "--config.mesh.sampler_hosts=1",
          "--config.mesh.sampler_devices=2", "--config.mesh.learner_devices=2"]


def outcome(results, t0: float) -> dict:
  lines, one_line = [], True
  for rc, out in results:
    errors = [l[len(ERROR):] for l in out.splitlines() if l.startswith(ERROR)]
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc not in (0, -signal.SIGKILL):
      one_line &= last.startswith(ERROR) and not any(t in out for t in JAX_TRACE)
    lines.append(errors[-1] if errors else None)
  return {"exit_codes": [rc for rc, _ in results], "one_line": one_line, "lines": lines,
          "wall_s": round(time.monotonic() - t0, 1)}


def launch(argv, scratch: str, name: str, **kwargs) -> dict:
  t0 = time.monotonic()
  results = local_job.run(argv, kwargs.pop("n", 2), devices=2, timeout_s=kwargs.pop("timeout_s", 300),
                          log_dir=scratch, name=name, cwd=ROOT, wait_all=True, **kwargs)
  return outcome(results, t0)


def busy(port: int):
  s = socket.socket()
  s.bind(("127.0.0.1", port))  # bound, not listening: taken, and a connection is refused
  return s


def audit(workdir: str, num_steps: int) -> dict:
  """resume_chaos.audit's counts for whole sampler hosts: sampler host i of S reads stream indices k * S + i."""
  prompts, torn = read_jsonl(os.path.join(workdir, "prompts.jsonl"))
  metrics, _ = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  steps = checkpoint_steps(workdir)
  with open(os.path.join(workdir, "checkpoints", str(steps[-1]), "meta", "metadata")) as f:
    streams = json.load(f)["streams"]
  s = len(streams)
  read = {k * s + i for i, st in enumerate(streams) for k in range(st["position"])}
  outstanding = {x for st in streams for x in st["outstanding"]}
  trained = collections.Counter(i for r in prompts for i in r.get("trained", []))
  dropped = collections.Counter(i for r in prompts for i in r.get("dropped", []))
  rl = collections.Counter(r["step"] for r in metrics if "loss" in r)
  return {"prompts_lost": len(read - set(trained) - set(dropped) - outstanding),
          "prompts_trained_twice": sum(n > 1 for n in trained.values()),
          "prompts_trained": sum(trained.values()), "stale_drops": sum(dropped.values()),
          "duplicate_metric_steps": sum(n > 1 for n in rl.values()), "final_step": max(rl) + 1 if rl else 0,
          "final_checkpoint_step": steps[-1], "torn_prompt_lines": torn}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--host-timeout", type=float, default=10.0)
  p.add_argument("--out")
  p.add_argument("--keep", action="store_true", help="keep the work directory and the launch logs")
  args = p.parse_args()
  scratch = tempfile.mkdtemp(prefix="host_faults_")
  workdir = os.path.join(scratch, "w")
  argv = command(scratch, workdir, args.steps, args.host_timeout)
  faults = {}
  t0 = time.monotonic()
  faults["kill_sampler_host"] = launch(argv, scratch, "kill_sampler_host",
                                       send=local_job.Signal(1, "weights v3 ", signal.SIGKILL))
  restored = (checkpoint_steps(workdir) or [0])[-1]
  faults["kill_learner_host"] = launch(argv, scratch, "kill_learner_host",
                                       send=local_job.Signal(0, f"weights v{restored + 2} ", signal.SIGKILL, watch=1))
  faults["missing_peer"] = launch(argv, scratch, "missing_peer", only=[0])
  port = local_job.free_port(following=2)
  with busy(port):
    faults["busy_port"] = launch(argv, scratch, "busy_port", env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"})
  port = local_job.free_port(following=2)
  with busy(port + 2):
    faults["busy_transfer_port"] = launch(argv, scratch, "busy_transfer_port",
                                          env={"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"})
  faults["finish"] = launch(argv, scratch, "finish")
  expected = {"kill_sampler_host": [1, -9], "kill_learner_host": [-9, 1], "missing_peer": [2], "busy_port": [2, 2],
              "busy_transfer_port": [2, 2], "finish": [0, 0]}
  result = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "host_timeout_s": args.host_timeout,
            "faults": faults, "audit": audit(workdir, args.steps), "wall_s": round(time.monotonic() - t0, 1)}
  result["all_as_expected"] = (all(faults[k]["exit_codes"] == v and faults[k]["one_line"] for k, v in expected.items())
                               and result["audit"]["prompts_lost"] == 0 and result["audit"]["prompts_trained_twice"] == 0
                               and result["audit"]["final_step"] == args.steps)
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  if args.keep:
    print(f"kept {scratch}", file=sys.stderr)
  else:
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
  main()
