"""Shared test set-up: 8 virtual CPU devices (4 sampler + 4 learner) before JAX starts, one
persistent XLA compilation cache for the whole run, and each module's compiled programs released
when it ends."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compare float32 results with torch's at tight tolerances: on GPU a float32 matmul
# defaults to TF32 and on TPU to bf16 passes, so the suite asks for full precision (no-op on CPU).
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

# Most of the suite's time is XLA compiling the same tiny programs again: in every CLI run a test
# starts (each a new process) and in every test that builds its own learner or engine. JAX's
# persistent cache compiles each program once per test run; the first process to get here makes
# the directory and every later one (pytest-xdist workers, the tests' subprocesses) inherits it
# through the environment. A fresh directory per run: timings do not depend on earlier runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="tunixlike-test-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the default 1 s leaves half the time out
# The commands' own cache (tunixlike/compilation_cache.py) is off in tests: a run that drops the variable
# above compiles everything, as a first run does, and no test writes ~/.cache/tunixlike/jax.
os.environ.setdefault("TUNIXLIKE_COMPILATION_CACHE", "off")
# On CPU most of a test's time is LLVM optimising programs that then run a few times: without its
# optimisation passes (XLA's backend level 0, which changes no result the tests check) the suite
# takes about half the CPU time. An environment variable, not XLA_FLAGS, so the runs that tests and
# benchmarks start with their own device count inherit it too. Runs on an accelerator (the device
# check) keep the backend's defaults.
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402  (after XLA_FLAGS: the device count is read when JAX starts)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
  """Each test module's compiled programs are dropped when it ends. Every XLA CPU executable keeps
  its machine code in its own memory mappings, and JAX's caches keep every executable a process
  ever compiled: a pytest-xdist worker passed 44,000 mappings in 10 minutes of the suite, and at the
  kernel's limit (vm.max_map_count, 65,530 by default) the next compile or cache load segfaults."""
  yield
  jax.clear_caches()
  gc.collect()
