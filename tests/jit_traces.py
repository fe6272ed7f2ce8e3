"""Counts JAX traces per function name while a block runs, from JAX's own monitoring events.

A jitted function is traced (then lowered and compiled) on each cache miss, so a count that does
not move across a call means the call compiled nothing. The library keeps no counters of its own.
"""

import collections
import contextlib
import threading

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
# The Engine's jitted bodies (JAX names a trace after the function it traces).
ENGINE_PROGRAMS = ("_prefill_impl", "_insert_impl", "_release_impl", "_generate_impl", "_resize_impl",
                   "_move_impl", "_extend_impl", "_paged_insert_impl", "_narrow_generate_impl", "_verify_impl")


@contextlib.contextmanager
def count_traces():
  """Yields a Counter, function name -> traces while the block ran (in any thread)."""
  counts, lock = collections.Counter(), threading.Lock()

  def listener(event, duration_secs, *, fun_name="", **kwargs):
    del duration_secs, kwargs
    if event == TRACE_EVENT:
      with lock:  # the runtime traces on its sampler and learner threads
        counts[fun_name] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def engine_counts(counts) -> dict[str, int]:
  """The Engine's programs in `counts`, e.g. {"generate": 3, ...} (zeros included)."""
  return {name.removeprefix("_").removesuffix("_impl"): counts[name] for name in ENGINE_PROGRAMS}
