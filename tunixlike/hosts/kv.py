"""Small messages between hosts through the `jax.distributed` coordination service's key-value store.

The coordination service (process 0's coordinator, started by `jax.distributed.initialize`) already
connects every process; its store carries acknowledgements and small control messages, so the
several-hosts layout needs no socket protocol of its own after start-up. Every wait has a timeout
and its error names the host waited for. Every entry is sealed under the run's secret
(`hosts.seal`: `use` installs the run's sealer at start-up); a forged or replayed one reads as
absent and is counted (`refused()`).
"""

from __future__ import annotations

import time

from orbax.checkpoint import multihost

from tunixlike.hosts import seal as seal_lib
from tunixlike.rl.transport import PeerFault

_sealer: seal_lib.Sealer | None = None


class HostTimeout(PeerFault):
  """A host did not answer in time (it died, hangs, or is far behind); `host`: which, when known."""


def client():
  """The coordination service client of this process (`jax.distributed.initialize` must have run)."""
  if not multihost.is_jax_distributed_client_initialized():
    raise RuntimeError("the key-value store needs jax.distributed.initialize first (several processes)")
  return multihost.get_jax_distributed_client()


def use(sealer: seal_lib.Sealer | None) -> None:
  """Seals this process's messages with `sealer` from now on (`distributed.initialize` with whole hosts)."""
  global _sealer
  _sealer = sealer


def sealer() -> seal_lib.Sealer:
  if _sealer is None:
    raise RuntimeError("messages between hosts need the run's secret: start the processes with "
                       "hosts.rendezvous.initialize")
  return _sealer


def refused() -> int:
  """Entries this process refused so far (forged or replayed)."""
  return 0 if _sealer is None else _sealer.refused


def _missing(e: Exception) -> bool:
  text = str(e)
  return "DEADLINE_EXCEEDED" in text or "timed out" in text.lower() or "NOT_FOUND" in text


def put(key: str, value: bytes, *, overwrite: bool = True) -> None:
  """`overwrite=False`: the first word stays (ALREADY_EXISTS is raised to the second writer)."""
  client().key_value_set_bytes(key, sealer().seal(key, value), allow_overwrite=overwrite)


def try_get(key: str, *, once: bool = False) -> bytes | None:
  """The value at `key` now, or None (none yet, or refused)."""
  try:
    data = client().key_value_try_get_bytes(key)
  except Exception as e:  # noqa: BLE001 - NOT_FOUND
    if _missing(e):
      return None
    raise
  return sealer().open(key, data, once=once)


def wait(key: str, timeout_s: float, *, once: bool = True) -> bytes | None:
  """The value at `key` once written, waiting up to `timeout_s`; None if none came (a refused entry
  is deleted and waited past)."""
  deadline = time.monotonic() + timeout_s
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return None
    try:
      data = client().blocking_key_value_get_bytes(key, max(1, int(left * 1000)))
    except Exception as e:  # noqa: BLE001 - the client raises DEADLINE_EXCEEDED
      if _missing(e):
        return None
      raise
    value = sealer().open(key, data, once=once)
    if value is not None:
      return value
    delete(key)


def get(key: str, *, timeout_s: float, host: int, what: str, once: bool = True) -> bytes:
  """The value at `key`, waiting up to `timeout_s` for host `host` to write it."""
  value = wait(key, timeout_s, once=once)
  if value is None:
    raise HostTimeout(f"{what}: host {host} did not answer within {timeout_s:g} s", host)
  return value


def take_all(prefix: str) -> list[tuple[str, bytes]]:
  """Every entry under `prefix`, deleted as read: (key, value) of those that verify."""
  c, out = client(), []
  for key, data in c.key_value_dir_get_bytes(prefix):
    c.key_value_delete(key)
    value = sealer().open(key, data, once=True)
    if value is not None:
      out.append((key, value))
  return out


def delete(key: str) -> None:
  client().key_value_delete(key)
