"""What every benchmark shares: its flags, its devices, the machine's environment and its JSON report.

    import harness  # the script's own directory (benchmarks/) is on sys.path

    ARGS = harness.parse(__doc__, lambda p: p.add_argument("--steps", type=int, default=40))
    harness.host_devices(8)  # before JAX starts
    import jax
    ...
    harness.report(result, ARGS)

Every benchmark takes `--out FILE` (also write the JSON object there), `--quick` (small sizes: a
smoke test, not the figures) and `--seed N` (its random data and weights; default 0). Its report is
one JSON object on stdout, with the same keys added here in every benchmark:
  environment   {jax, backend, devices, device_kind, xla_flags, python, cpus, host}
  load_average  {before: [1, 5, 15 min], after: [...]}: the machine may be shared
  date          the day it ran
This file lives outside the library (and is not a package: `benchmarks` would clash with
google-jetstream's package of that name).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Mapping, Sequence

# A child's virtual CPU devices (XLA_FLAGS, and NPROC for XLA:CPU's collectives): one definition, the
# library's, which its own several-process launcher uses.
from local_job import device_env, xla_flags  # noqa: F401  (re-exported to the benchmarks)

_LOAD_BEFORE: list[float] = []  # when the flags were parsed: before the benchmark's work


def parse(doc: str | None, add_flags: Callable[[argparse.ArgumentParser], Any] | None = None,
          argv: Sequence[str] | None = None, *, quick: str = "small sizes",
          seed: str = "seeds the benchmark's random data and weights") -> argparse.Namespace:
  """The shared flags, plus the benchmark's own (`add_flags(parser)`), parsed from `argv` (or sys.argv).
  `quick` and `seed` say what those flags do in this benchmark."""
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=None, help="also write the JSON object to this file")
  p.add_argument("--quick", action="store_true", help=f"{quick} (a smoke test, not the figures)")
  p.add_argument("--seed", type=int, default=0, help=seed)
  if add_flags is not None:
    add_flags(p)
  args = p.parse_args(argv)
  _LOAD_BEFORE[:] = _load()
  return args


def host_devices(devices: int) -> None:
  """This process's virtual CPU devices (set before JAX starts: it reads XLA_FLAGS once)."""
  if "jax" in sys.modules:
    raise RuntimeError("harness.host_devices: call it before importing jax (it reads XLA_FLAGS at start)")
  os.environ["XLA_FLAGS"] = xla_flags(devices)


def _load() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def load_average() -> dict[str, list[float]]:
  """The 1, 5 and 15 minute load averages when the flags were parsed and now."""
  return {"before": list(_LOAD_BEFORE), "after": _load()}


def environment() -> dict[str, Any]:
  """What the figures depend on besides the code. The devices are read only when this process has
  started JAX (a benchmark that runs its work in subprocesses must not take the accelerator)."""
  env = {"jax": importlib.metadata.version("jax"), "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "python": platform.python_version(), "cpus": os.cpu_count(), "host": platform.node()}
  jax = sys.modules.get("jax")
  if jax is not None:
    devices = jax.devices()
    env.update(backend=jax.default_backend(), devices=len(devices), device_kind=devices[0].device_kind)
  return env


def report(result: Mapping[str, Any], args: argparse.Namespace, **dumps) -> dict[str, Any]:
  """`result` with the shared keys, printed as one JSON object (`json.dumps(**dumps)`, indent 1 by
  default) and written to `--out` when given. Returns what it printed."""
  out = {**result, "seed": args.seed, "quick": args.quick, "environment": environment(),
         "load_average": load_average(), "date": time.strftime("%Y-%m-%d")}
  text = json.dumps(out, **{"indent": 1, **dumps})
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return out
