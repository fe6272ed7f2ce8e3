"""JAX's persistent compilation cache for the commands: a second start of the same run loads its
compiled programs from disk instead of compiling them again.

    TUNIXLIKE_COMPILATION_CACHE=DIR   the cache directory (default ~/.cache/tunixlike/jax); 'off': none

JAX's own JAX_COMPILATION_CACHE_DIR, when set, wins (the test suite sets one per run). On CPU
most programs compile in well under JAX's default 1 s threshold, so every program is cached
(`jax_persistent_cache_min_compile_time_secs=0`, no entry size limit) unless
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS / JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES say
otherwise. Call `enable()` before the first compilation (JAX decides at its first compile whether it
uses a cache). The cache is trusted code: keep it in a directory only you can write
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html).
"""

from __future__ import annotations

import os

ENV = "TUNIXLIKE_COMPILATION_CACHE"
OFF = "off"
DEFAULT_DIR = os.path.join("~", ".cache", "tunixlike", "jax")


def directory(environ=os.environ) -> str | None:
  """The cache directory the commands use, or None when none (off, or JAX's own variable is set)."""
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None  # JAX reads it itself
  value = environ.get(ENV, DEFAULT_DIR)
  return None if value.strip().lower() in ("", OFF) else os.path.expanduser(value)


def enable(environ=os.environ) -> str | None:
  """Points JAX at `directory()` and caches every program; returns the directory (None: left as is)."""
  import jax
  path = directory(environ)
  if path is not None:
    jax.config.update("jax_compilation_cache_dir", path)
  if environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS") is None:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if environ.get("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES") is None:
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path
