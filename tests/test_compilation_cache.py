"""The commands' persistent compilation cache (tunixlike/compilation_cache.py): where it is, and a second
process start loads what the first compiled."""

import json
import os
import subprocess
import sys

from tunixlike import compilation_cache

# One jitted program, then the persistent cache's hits and misses this process saw (jax.monitoring events).
PROGRAM = """
import json
from tunixlike import compilation_cache
compilation_cache.enable()
import jax
seen = []
jax.monitoring.register_event_listener(lambda event, **kw: seen.append(event))
jax.jit(lambda x: x * 2 + 1)(jax.numpy.arange(3.0)).block_until_ready()
print(json.dumps({k: seen.count(f"/jax/compilation_cache/cache_{k}") for k in ("hits", "misses")}))
"""


def test_directory_resolution(tmp_path):
  home = os.path.expanduser(compilation_cache.DEFAULT_DIR)
  assert compilation_cache.directory({}) == home
  assert compilation_cache.directory({"TUNIXLIKE_COMPILATION_CACHE": str(tmp_path)}) == str(tmp_path)
  assert compilation_cache.directory({"TUNIXLIKE_COMPILATION_CACHE": "off"}) is None
  assert compilation_cache.directory({"TUNIXLIKE_COMPILATION_CACHE": ""}) is None
  # JAX's own variable wins: JAX reads it itself.
  assert compilation_cache.directory({"JAX_COMPILATION_CACHE_DIR": "/x", "TUNIXLIKE_COMPILATION_CACHE": "/y"}) is None


def test_second_start_hits_the_cache(tmp_path):
  cache = tmp_path / "jax"
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's own cache (tests/conftest.py) would win
  env["TUNIXLIKE_COMPILATION_CACHE"] = str(cache)

  def start() -> dict:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

  first = start()
  assert first["misses"] >= 1 and first["hits"] == 0
  assert any(cache.iterdir())  # a sub-second CPU compile is written too (min compile time 0)
  second = start()
  assert second["hits"] >= 1 and second["misses"] == 0
