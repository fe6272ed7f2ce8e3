"""Small messages between hosts through the `jax.distributed` coordination service's key-value store.

The coordination service (process 0's coordinator, started by `jax.distributed.initialize`) already
connects every process; its store carries acknowledgements and small control messages, so the
several-hosts layout needs no socket protocol of its own. Every wait has a timeout and its error
names the host waited for.
"""

from __future__ import annotations

from orbax.checkpoint import multihost


class HostTimeout(TimeoutError):
  """A host did not answer in time (it died, hangs, or is far behind); `host`: which, when known."""

  def __init__(self, message: str, host: int | None = None):
    super().__init__(message)
    self.host = host


def client():
  """The coordination service client of this process (`jax.distributed.initialize` must have run)."""
  if not multihost.is_jax_distributed_client_initialized():
    raise RuntimeError("the key-value store needs jax.distributed.initialize first (several processes)")
  return multihost.get_jax_distributed_client()


def put(key: str, value: bytes) -> None:
  client().key_value_set_bytes(key, value)


def get(key: str, *, timeout_s: float, host: int, what: str) -> bytes:
  """The value at `key`, waiting up to `timeout_s` for host `host` to write it."""
  try:
    return client().blocking_key_value_get_bytes(key, int(timeout_s * 1000))
  except Exception as e:  # the client raises XlaRuntimeError DEADLINE_EXCEEDED
    if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
      raise HostTimeout(f"{what}: host {host} did not answer within {timeout_s:g} s", host) from None
    raise


def delete(key: str) -> None:
  client().key_value_delete(key)
