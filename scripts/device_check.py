"""The one-shot device check's parts, each in its own process with its own time limit (see device_check.sh).

  python3 scripts/device_check.py --out DIR [--small]

Prints the versions and the card first (one JSON line), then ONE JSON object with every part's
result; a part that fails or runs out of time records its error text and the others still run.
Logs and each part's files are written under --out. --small (DEVICE_CHECK_SMALL=1) is the dry run:
the same logic on CPU with the tiny variants, to exercise the script where no accelerator is.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "chex",
            "grain", "ml-collections", "transformers", "torch", "tokenizers", "safetensors", "numpy", "pytest")
TOTAL_S = 440  # the whole check within 8 minutes with room to spare, installation (before this script) included


def versions() -> dict:
  out = {}
  for name in PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  out["python"] = sys.version.split()[0]
  return out


def tail(text: str, n: int = 3000) -> str:
  return text if len(text) <= n else "..." + text[-n:]


class Part:
  """One part: a command run with a time limit, its output in DIR/NAME.log."""

  def __init__(self, name: str, cmd: list[str], out: pathlib.Path, limit_s: float, env: dict):
    self.name, self.cmd, self.limit_s = name, cmd, limit_s
    self.log = out / f"{name}.log"
    self._file = open(self.log, "w")
    self.start = time.perf_counter()
    self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._file, stderr=subprocess.STDOUT,
                                 start_new_session=True)

  def wait(self) -> dict:
    """{'rc', 'wall_s', 'timed_out'}: a part past its limit is killed (its whole process group)."""
    timed_out = False
    try:
      rc = self.proc.wait(timeout=max(1.0, self.limit_s - (time.perf_counter() - self.start)))
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(self.proc.pid, 9)
      rc = self.proc.wait()
    self._file.close()
    return {"rc": rc, "wall_s": round(time.perf_counter() - self.start, 1), "timed_out": timed_out,
            "command": " ".join(self.cmd), "log": str(self.log)}

  def output(self) -> str:
    return self.log.read_text(errors="replace")


def env_for(small: bool, **extra) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
  if small:  # the dry run: one CPU device, like one accelerator
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  else:  # "" = every platform JAX finds (tests/conftest.py would otherwise pick the CPU)
    env["JAX_PLATFORMS"] = ""
    env.pop("XLA_FLAGS", None)
  return env


def card(small: bool) -> dict:
  out = {}
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
  except (OSError, subprocess.TimeoutExpired) as e:
    out["nvidia_smi"] = f"unavailable: {e}"
  probe = ("import jax; d = jax.devices(); print(repr([str(x) for x in d])); print(d[0].device_kind); "
           "print(jax.default_backend())")
  try:
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env_for(small))
    lines = r.stdout.strip().splitlines()
    out.update(jax_devices=lines[0], device_kind=lines[1], backend=lines[2]) if r.returncode == 0 and len(lines) == 3 \
        else out.update(jax_error=tail(r.stderr))
  except subprocess.TimeoutExpired as e:
    out["jax_error"] = f"timed out: {e}"
  return out


def tests_result(part: Part, status: dict, xml: pathlib.Path) -> dict:
  out = dict(status)
  try:
    suites = ET.parse(xml).getroot().iter("testsuite")
    counts = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
    for s in suites:
      for k in counts:
        counts[k] += int(s.get(k, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    out.update(counts)
    out["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for c in ET.parse(xml).getroot().iter("testcase")
                           if c.find("failure") is not None or c.find("error") is not None]
  except (OSError, ET.ParseError) as e:
    out["error"] = f"no junit report ({e}): " + tail(part.output())
  if out.get("failures") or out.get("errors"):
    out["failure_text"] = tail(part.output(), 4000)
  return out


def job_result(part: Part, status: dict, workdir: pathlib.Path) -> dict:
  out = dict(status)
  metrics = workdir / "metrics.jsonl"
  records = []
  if metrics.exists():
    for line in metrics.read_text().splitlines():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        pass  # a torn last line of a killed run
  rewards = [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r]
  evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
  if rewards:
    first, last = rewards[: min(10, len(rewards))], rewards[-min(10, len(rewards)):]
    out["reward_first_10_steps"] = round(sum(v for _, v in first) / len(first), 4)
    out["reward_last_10_steps"] = round(sum(v for _, v in last) / len(last), 4)
    out["last_rl_step"] = rewards[-1][0]
  warm = [r for r in records if "warm_start/accuracy" in r]
  if warm:
    out["warm_start"] = {"steps": warm[-1].get("warm_start/steps"), "accuracy": warm[-1]["warm_start/accuracy"]}
  if evals:
    out["heldout_accuracy"] = {str(s): round(v, 4) for s, v in evals}
    out["heldout_before"], out["heldout_after"] = evals[0][1], evals[-1][1]
  out["learns"] = bool(len(evals) >= 2 and evals[-1][1] > evals[0][1] and rewards
                       and out["reward_last_10_steps"] > out["reward_first_10_steps"])
  if status["rc"] != 0:
    out["error"] = tail(part.output())
  return out


def scale_result(part: Part, status: dict, report: pathlib.Path) -> dict:
  out = dict(status)
  try:
    out.update(json.loads(report.read_text()))
  except (OSError, json.JSONDecodeError) as e:
    out["error"] = f"no report ({e})"
  if status["rc"] != 0:
    out["error"] = tail(part.output())
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--small", action="store_true", default=os.environ.get("DEVICE_CHECK_SMALL") == "1")
  p.add_argument("--budget-s", type=float, default=None, help="seconds this script may take (default: 450; "
                 "--small: 1500, for a shared CPU)")
  a = p.parse_args()
  a.budget_s = a.budget_s or (1500 if a.small else TOTAL_S - 20)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  left = lambda: a.budget_s - (time.perf_counter() - start)  # noqa: E731
  result = {"check": "device_check", "small": a.small, "versions": versions()}
  result["card"] = card(a.small)
  print(json.dumps({"versions": result["versions"], "card": result["card"]}), flush=True)
  py = sys.executable

  # 1 and 2 together (both are small on an accelerator; neither takes all its memory), then 3 alone.
  shared = env_for(a.small, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  gpu_tests = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                     if "pytest.mark.gpu" in f.read_text(errors="replace"))
  if a.small:  # the dry run exercises the logic: one quick file stands for the subset
    gpu_tests = ["tests/rl/test_weight_sync.py"]
  xml = out / "tests.xml"
  # tests/conftest.py defaults JAX_PLATFORMS to cpu; set but empty, JAX picks the accelerator itself.
  test_env = dict(shared, JAX_PLATFORMS="") if not a.small else shared
  # On an H100 the subset compiles each test's programs for the GPU: about 9 s a test (2026-11-28).
  tests = Part("tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--durations=10",
                         f"--junitxml={xml}", *gpu_tests], out, min(250, left()) if not a.small else left(), test_env)
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="device-check-job-"))  # its checkpoints stay out of --out
  job_cmd = [py, "-m", "tunixlike.train", "--config",
             "configs/addition_grpo.py" + (":size=tiny" if a.small else ""), f"--workdir={workdir}",
             "--config.mesh.layout=colocated", "--config.mesh.sampler_devices=1", "--config.mesh.learner_devices=0",
             "--config.model.dtype=bfloat16"]
  if not a.small:  # held-out accuracy every 50 steps; 150 steps fit the time limit
    job_cmd += ["--config.rl.num_steps=150", "--config.eval.every_steps=50"]
  job = Part("main_job", job_cmd, out, min(150, left()) if not a.small else left(), shared)
  result["tests"] = dict(tests_result(tests, tests.wait(), xml), jax_platforms=test_env.get("JAX_PLATFORMS"))
  result["main_job"] = job_result(job, job.wait(), workdir)
  if (workdir / "metrics.jsonl").exists():
    shutil.copy(workdir / "metrics.jsonl", out / "main_job_metrics.jsonl")
  result["main_job"]["config"] = "configs/addition_grpo.py, mesh.layout=colocated on 1 device, model.dtype=bfloat16"

  report = out / "scale.json"
  scale_cmd = [py, "benchmarks/scale.py", "--size", "0.5b", "--layout", "colocated", "--hf-generate",
               "--batches", "64,256", "--prompt-len", "64", "--new-tokens", "128", "--train-batch", "32",
               "--train-seq", "512", f"--out={report}"]
  if a.small:
    scale_cmd = [py, "benchmarks/scale.py", "--quick", "--layout", "colocated", "--hf-generate", f"--out={report}"]
  if left() > 30:
    scale = Part("scale", scale_cmd, out, left(), env_for(a.small))
    result["scale_0.5b"] = scale_result(scale, scale.wait(), report)
  else:
    result["scale_0.5b"] = {"error": f"not started: {left():.0f} s left of the check's budget"}
  result["wall_s"] = round(time.perf_counter() - start, 1)
  text = json.dumps(result, indent=1, default=str)
  (out / "device_check.json").write_text(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
