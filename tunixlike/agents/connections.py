"""The agent server's connections, bounded, so that idle sockets cannot use up the trainer's files.

uvicorn accepts every connection and keeps it until the client sends something (`limit_concurrency`
only answers 503 to requests, once they come), so 20,000 idle sockets took every file descriptor of
the training process. `ConnectionLimit` sits between uvicorn's accept and its HTTP protocol:

  - at most `max_connections` are open: a new one over it closes the oldest connection that never
    sent an authenticated request, else the oldest idle one (a keep-alive between requests: its client
    reconnects), else it is itself closed at once; a request in flight is never cut;
  - a connection that has not sent a request with the key `header_timeout_s` after it opened is
    closed (slow or absent headers), and so is one that sends more than `MAX_UNAUTHENTICATED_BYTES`
    before its key is checked;
  - `fd_budget_error` refuses a limit that, with the listen backlog, does not fit in half the
    process's file descriptors: the other half is the trainer's.

The server's key check (`server._Guard`) tells the limit which connection a request came on
(`request_started` / `request_ended`, by the client's address). Everything runs on the server's event
loop thread; the counts are read from elsewhere only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
from typing import Callable

_log = logging.getLogger(__name__)

# A request head and the start of its body, read before the key is checked (uvicorn pauses reading past
# 64 KiB of unread body): a client that sends more without the key is not an agent.
MAX_UNAUTHENTICATED_BYTES = 1 << 20
BACKLOG = 128  # connections the kernel queues (and an accept burst opens) before the limit sees them


def _peer(address) -> tuple[str, int] | None:
  """The client as ASGI's scope['client'] names it (uvicorn: host and port of the peer address)."""
  return (str(address[0]), int(address[1])) if address else None


def backlog(max_connections: int) -> int:
  return min(BACKLOG, max_connections)


def fd_budget_error(max_connections: int, key: str = "rl.agent_max_connections") -> str | None:
  """Why `max_connections` (plus the backlog of connections accepted before the limit closes them)
  does not fit in half of RLIMIT_NOFILE, or None."""
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  need = max_connections + backlog(max_connections)
  if soft == resource.RLIM_INFINITY or need <= soft // 2:
    return None
  return (f"{key}={max_connections}: the agent server's connections and listen backlog ({need} file descriptors) "
          f"must fit in half of this process's file descriptor limit (ulimit -n = {soft}), the other half is kept "
          f"for training: lower {key} or raise ulimit -n")


class _Connection(asyncio.Protocol):
  """One TCP connection: admitted by the limit, then handed to uvicorn's HTTP protocol (`inner`)."""

  def __init__(self, limit: "ConnectionLimit", inner: asyncio.Protocol):
    self.limit, self.inner = limit, inner
    self.transport: asyncio.Transport | None = None
    self.peer: tuple[str, int] | None = None
    self.admitted = False
    self.authenticated = False  # has sent a request with the key
    self.busy = 0  # requests in flight
    self.unauthenticated_bytes = 0
    self.timer: asyncio.TimerHandle | None = None

  def connection_made(self, transport):
    self.transport, self.peer = transport, _peer(transport.get_extra_info("peername"))
    if not self.limit._admit(self):
      transport.abort()
      return
    self.admitted = True
    self.inner.connection_made(transport)

  def data_received(self, data: bytes):
    if not self.admitted or self.transport.is_closing():
      return
    if not self.authenticated:
      self.unauthenticated_bytes += len(data)
      if self.unauthenticated_bytes > MAX_UNAUTHENTICATED_BYTES:
        self.limit._close(self, "oversized")
        return
    self.inner.data_received(data)

  def eof_received(self):
    return self.inner.eof_received() if self.admitted else None

  def pause_writing(self):
    if self.admitted:
      self.inner.pause_writing()

  def resume_writing(self):
    if self.admitted:
      self.inner.resume_writing()

  def connection_lost(self, exc):
    self.limit._forget(self)
    if self.admitted:
      self.inner.connection_lost(exc)


class ConnectionLimit:
  """`protocol(inner_factory)` is the protocol factory uvicorn's `Config(http=...)` takes. `counts`
  holds the connections closed by reason: `over_limit` (evicted or refused), `header_timeout`,
  `oversized`. `on_close(reason)` is told of each."""

  def __init__(self, *, max_connections: int, header_timeout_s: float,
               on_close: Callable[[str], None] = lambda reason: None):
    self.max_connections, self.header_timeout_s, self.on_close = max_connections, header_timeout_s, on_close
    self._fresh: dict[int, _Connection] = {}  # never authenticated, oldest first
    self._known: dict[int, _Connection] = {}  # authenticated at least once, oldest first
    self._by_peer: dict[tuple[str, int], _Connection] = {}
    self.counts: collections.Counter = collections.Counter()

  @property
  def open(self) -> int:
    return len(self._fresh) + len(self._known)

  def protocol(self, inner_factory: Callable[..., asyncio.Protocol]) -> Callable[..., asyncio.Protocol]:
    return lambda **kw: _Connection(self, inner_factory(**kw))

  # ------------------------------------------------------------------ the key check's side

  def request_started(self, client) -> None:
    """A request with the key arrived from `client` (scope['client'])."""
    conn = self._by_peer.get(_peer(client))
    if conn is None:
      return
    if not conn.authenticated:
      conn.authenticated = True
      if conn.timer is not None:
        conn.timer.cancel()
      self._fresh.pop(id(conn), None)
      self._known[id(conn)] = conn
    conn.busy += 1

  def request_ended(self, client) -> None:
    conn = self._by_peer.get(_peer(client))
    if conn is not None and conn.busy:
      conn.busy -= 1

  # ------------------------------------------------------------------ uvicorn's side

  def _admit(self, conn: _Connection) -> bool:
    if self.open >= self.max_connections:
      victim = next(iter(self._fresh.values()), None) or next((c for c in self._known.values() if not c.busy), None)
      if victim is None:
        self._count("over_limit")
        return False
      self._close(victim, "over_limit")
    self._fresh[id(conn)] = conn
    if conn.peer is not None:
      self._by_peer[conn.peer] = conn
    conn.timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._header_timeout, conn)
    return True

  def _header_timeout(self, conn: _Connection) -> None:
    if not conn.authenticated and id(conn) in self._fresh:
      self._close(conn, "header_timeout")

  def _close(self, conn: _Connection, reason: str) -> None:
    self._forget(conn)
    conn.transport.abort()
    self._count(reason)

  def _forget(self, conn: _Connection) -> None:
    if conn.timer is not None:
      conn.timer.cancel()
    self._fresh.pop(id(conn), None)
    self._known.pop(id(conn), None)
    if conn.peer is not None and self._by_peer.get(conn.peer) is conn:
      del self._by_peer[conn.peer]

  def _count(self, reason: str) -> None:
    self.counts[reason] += 1
    self.on_close(reason)
    total = sum(self.counts.values())
    if total & (total - 1) == 0:  # 1, 2, 4, 8, ...: a flood is a few lines, not one per socket
      _log.warning("agent server: closed %d connections so far (%s): over rl.agent_max_connections=%d, without the "
                   "key after rl.agent_header_timeout_s=%g, or too large without it", total,
                   ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())), self.max_connections,
                   self.header_timeout_s)
