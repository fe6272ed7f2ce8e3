"""Start N processes on 127.0.0.1 as one multi-controller JAX job (benchmarks/local_job.py),
with each process's output in the test's tmp_path: the launcher of every several-process test
(tests/test_multihost.py, tests/hosts/)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # the launcher the benchmarks share, beside them
import local_job  # noqa: E402


def lines(out: str, tag: str) -> list[str]:
  """The lines of `out` that start with `tag ` (without it)."""
  return [l[len(tag) + 1:] for l in out.splitlines() if l.startswith(tag + " ")]


def run_processes(argv: list[str], n: int, tmp_path, *, timeout_s: float = 180, devices: int = 4,
                  send: local_job.Signal | None = None, name: str = "process",
                  env: dict[str, str] | None = None, **kwargs) -> list[tuple[int, str]]:
  """(exit code, output) of each of `n` processes of `argv` (see `local_job.run`, which takes
  `kwargs` too), run from the repository's root; their logs stay in `tmp_path/{name}_{i}.log`."""
  return local_job.run(argv, n, devices=devices, timeout_s=timeout_s, log_dir=str(tmp_path), name=name, send=send,
                       env=env, cwd=ROOT, **kwargs)
