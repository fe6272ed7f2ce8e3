"""Start-up of whole hosts per side: every process checked before JAX's coordination service starts.

JAX's coordination service turns every start-up mistake into a fatal C++ trace (a process that never
comes: `DEADLINE_EXCEEDED ... RegisterTask` and an abort on every host; a busy port: `Failed to start
RPC server`), and accepts any process that reaches its port. So before `jax.distributed.initialize`
process 0 listens on the coordinator's own address and port and each other process says hello there:

    process 0: listen on the coordinator's bind address; for each connection send a challenge
    process i: its transfer port free? -> connect (retrying until mesh.host_timeout_s) -> hello:
               its id, its config's fingerprint, what it found wrong, sealed with the run's secret
               over the challenge (`seal.mac`)
    process 0: once every id has said hello (or mesh.host_timeout_s has passed): the verdict, one
               line naming what is wrong (missing process ids, a busy port and its host, the config
               keys that differ and on which host) or the run's id, sealed over the host's own nonce

A connection whose hello does not verify (no secret, another run's) is refused and counted, and the
wait goes on. Every process raises `RendezvousError` with the verdict's line (the CLI exits 2), so
every host of a mismatched or incomplete job stops saying what is wrong. Then process 0 closes the
socket and JAX's service takes the same port.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Any

from tunixlike import distributed
from tunixlike.distributed import check_port_free, split_address
from tunixlike.hosts import kv, seal, transfer_server

log = logging.getLogger("tunixlike")

# Sections that may differ between hosts: where logs go and which process this is. Every other key
# (model, seed, data, algorithm, mesh, sampler, optimizer, ...) must be the same on every host.
LOCAL_SECTIONS = ("log", "distributed")
_MAX_MESSAGE = 2**20
_ANSWER_S = 10.0  # a connected peer's time to answer one message


class RendezvousError(ValueError):
  """A start-up mistake of the job (one line naming the host, the address or port, or the keys)."""


@dataclasses.dataclass(frozen=True)
class Hello:
  """What a host brings to the rendezvous: its config's fingerprint (a hash per key) and how long it waits."""
  fingerprint: dict
  timeout_s: float


def fingerprint(cfg) -> dict[str, str]:
  """A short hash of every config key that must agree between hosts (values never leave the host)."""
  out = {}

  def walk(prefix: str, value: Any):
    if isinstance(value, dict):
      for k, v in value.items():
        walk(f"{prefix}.{k}" if prefix else k, v)
    else:
      out[prefix] = hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]

  for name, value in dataclasses.asdict(cfg).items():
    if name not in LOCAL_SECTIONS:
      walk(name, value)
  return out


def hello(cfg) -> Hello:
  """What this host brings to the rendezvous of a run's processes."""
  return Hello(fingerprint(cfg), cfg.mesh.host_timeout_s)


def differing(mine: dict, theirs: dict) -> list[str]:
  return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))


def _send(sock: socket.socket, obj: dict) -> None:
  data = json.dumps(obj).encode()
  sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  data = b""
  while len(data) < n:
    chunk = sock.recv(n - len(data))
    if not chunk:
      raise ConnectionError("closed")
    data += chunk
  return data


def _recv(sock: socket.socket) -> dict:
  (n,) = struct.unpack(">I", _recv_exact(sock, 4))
  if n > _MAX_MESSAGE:
    raise ValueError(f"a message of {n} bytes")
  obj = json.loads(_recv_exact(sock, n))
  if not isinstance(obj, dict):
    raise ValueError("not a message of this protocol")
  return obj


def _canonical(obj: dict) -> bytes:
  return json.dumps(obj, sort_keys=True).encode()


def _family(host: str) -> int:
  return socket.AF_INET6 if ":" in host else socket.AF_INET


def initialize(cfg: distributed.DistributedConfig, hello_: Hello) -> bool:
  """`distributed.initialize` for whole hosts: first the rendezvous (`meet`: every process there, same
  config, free ports, the run's secret, or one line saying what is wrong), then the store sealed under
  the run's secret, JAX's transfer server for `jax.device_put` between the device sets of different
  processes, and JAX's heartbeat timeout beyond the hosts' own (so that a host's fault is named by
  tunixlike before JAX aborts). Returns True if this is a multi-process run."""
  def meet_first(resolved: distributed.DistributedConfig, bind: str | None) -> int:
    secret, run_id = meet(resolved.coordinator_address, bind, resolved.process_id, resolved.num_processes, hello_)
    kv.use(seal.Sealer(secret, run_id, resolved.process_id))
    if not transfer_server.enabled():
      transfer_server.enable(resolved.coordinator_address, resolved.process_id, timeout_s=resolved.timeout_s)
    return int(2 * hello_.timeout_s) + 60  # after the hosts' own faults have been named

  return distributed.initialize(cfg, meet=meet_first)


def meet(coordinator_address: str, bind_address: str | None, process_id: int, num_processes: int,
         hello_: Hello) -> tuple[bytes, bytes]:
  """The rendezvous (see the module docstring); returns (the run's secret, the run's id). `bind_address`:
  where process 0 listens (`distributed.bind_address`; the others ignore it)."""
  host, port = split_address(coordinator_address)
  transfer = transfer_server.address(coordinator_address, process_id)
  problem = check_port_free(*split_address(transfer), f"host {process_id}: the transfer port (coordinator port + 1 + "
                            "process id) at")
  if process_id == 0:
    return _serve(coordinator_address, split_address(bind_address), num_processes, hello_, problem)
  return _join(host, port, process_id, hello_, problem)


def _serve(address: str, bind: tuple[str, int], n: int, hello_: Hello, problem: str | None) -> tuple[bytes, bytes]:
  secret = seal.load(*split_address(address), 0)
  listener = socket.socket(_family(bind[0]), socket.SOCK_STREAM)
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    listener.bind(bind)
  except OSError as e:
    listener.close()
    why = (f"another process listens there (`ss -ltnp 'sport = :{bind[1]}'`): stop it or pick another port in "
           "distributed.coordinator_address / JAX_COORDINATOR_ADDRESS" if e.errno in (98, 48) else
           "not an address of this machine: set distributed.coordinator_bind_address to this host's interface")
    raise RendezvousError(f"host 0: cannot listen on the coordinator address {bind[0]}:{bind[1]} "
                          f"({e.strerror}): {why}") from None
  listener.listen(64)
  listener.settimeout(0.2)
  peers: dict[int, tuple[socket.socket, str, dict]] = {}
  others: list[tuple[socket.socket, str, dict]] = []  # verified hellos with a bad or repeated id: told the verdict too
  problems = [problem] if problem else []
  refused, lock = [0], threading.Lock()

  def greet(conn: socket.socket, addr: str):
    try:
      conn.settimeout(_ANSWER_S)
      challenge = secrets.token_bytes(16)
      _send(conn, {"challenge": challenge.hex()})
      msg = _recv(conn)
      body = msg.get("hello")
      sealed = bytes.fromhex(str(msg.get("mac", "")))
      ok = isinstance(body, dict) and hmac.compare_digest(sealed, seal.mac(secret, b"hello", challenge,
                                                                                  _canonical(body)))
    except Exception:  # noqa: BLE001 - not this protocol, or silent: refused
      ok = False
    if not ok:
      with lock:
        refused[0] += 1
      log.warning(f"host 0: refused a connection from {addr} to the coordinator port: it does not hold the run's "
                  "secret")
      try:
        _send(conn, {"refused": "the run's secret differs"})
      except OSError:
        pass
      conn.close()
      return
    pid = body.get("id")
    with lock:
      if not isinstance(pid, int) or not 0 < pid < n:
        problems.append(f"a process at {addr} says it is process {pid!r}, not in 1 .. {n - 1} (JAX_PROCESS_ID / "
                        f"distributed.process_id; JAX_NUM_PROCESSES={n})")
      elif pid in peers:
        problems.append(f"two processes say they are process {pid}, at {peers[pid][1]} and {addr}: give each its "
                        "own JAX_PROCESS_ID / distributed.process_id")
      if isinstance(pid, int) and 0 < pid < n and pid not in peers:
        peers[pid] = (conn, addr, body)
      else:
        others.append((conn, addr, body))
      if body.get("problem"):
        problems.append(str(body["problem"]))

  deadline = time.monotonic() + hello_.timeout_s
  try:
    while time.monotonic() < deadline:
      with lock:
        if len(peers) >= n - 1:
          break
      try:
        conn, addr = listener.accept()
      except socket.timeout:
        continue
      threading.Thread(target=greet, args=(conn, addr[0]), daemon=True, name="rendezvous").start()
    with lock:
      lines = list(problems)
      missing = [p for p in range(1, n) if p not in peers]
      if missing:
        lines.append(f"process ids {missing} did not reach the coordinator {address} within {hello_.timeout_s:g} s "
                     f"(mesh.host_timeout_s): start them with the same JAX_COORDINATOR_ADDRESS and "
                     f"JAX_NUM_PROCESSES={n}, and check that they reach it (address, port, firewall)")
      for pid in sorted(peers):
        keys = differing(hello_.fingerprint, peers[pid][2].get("fingerprint") or {})
        if keys:
          shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
          lines.append(f"host {pid} runs another config than host 0: {shown} differ (every host must run the same "
                       "command)")
      run_id = secrets.token_bytes(16)
      verdict = {"ok": not lines, "line": "; ".join(lines), "run": run_id.hex()}
      for conn, _, body in [*peers.values(), *others]:
        try:
          nonce = bytes.fromhex(str(body.get("nonce", "")))
          _send(conn, {"verdict": verdict, "mac": seal.mac(secret, b"verdict", nonce, _canonical(verdict)).hex()})
          conn.settimeout(_ANSWER_S)
          conn.recv(1)  # the peer closes first: the port is free for JAX's service at once
        except (OSError, ValueError):
          pass
        conn.close()
  finally:
    listener.close()
  if refused[0]:
    log.warning(f"host 0: refused {refused[0]} connections to the coordinator port at start-up")
  if lines:
    raise RendezvousError(verdict["line"])
  return secret, run_id


def _join(host: str, port: int, me: int, hello_: Hello, problem: str | None) -> tuple[bytes, bytes]:
  address = f"{host}:{port}"
  deadline = time.monotonic() + hello_.timeout_s
  while True:
    try:
      sock = socket.create_connection((host, port), timeout=min(_ANSWER_S, hello_.timeout_s))
      break
    except OSError:
      if time.monotonic() > deadline:
        raise RendezvousError(f"host {me}: nothing answered at the coordinator {address} within {hello_.timeout_s:g} s "
                              "(mesh.host_timeout_s): start process 0 there, and check JAX_COORDINATOR_ADDRESS / "
                              "distributed.coordinator_address (host and port) and the firewall") from None
      time.sleep(0.25)
  not_ours = (f"host {me}: the process at the coordinator address {address} is not this run's process 0 "
              "(another program listens there?): check the port")
  with sock:
    try:
      sock.settimeout(_ANSWER_S)
      challenge = bytes.fromhex(str(_recv(sock)["challenge"]))
    except (OSError, ValueError, KeyError, ConnectionError):
      raise RendezvousError(not_ours) from None
    secret = seal.load(host, port, me)  # after the challenge: process 0 has drawn a one-machine run's secret
    nonce = secrets.token_bytes(16)
    body = {"id": me, "fingerprint": hello_.fingerprint, "problem": problem, "nonce": nonce.hex()}
    try:
      _send(sock, {"hello": body, "mac": seal.mac(secret, b"hello", challenge, _canonical(body)).hex()})
      sock.settimeout(hello_.timeout_s + 2 * _ANSWER_S)  # process 0 answers once all came, within its own wait
      answer = _recv(sock)
    except (OSError, ValueError, ConnectionError):
      raise RendezvousError(f"host {me}: process 0 at {address} stopped answering during start-up") from None
    if "refused" in answer:
      raise RendezvousError(f"host {me}: process 0 at {address} refused this host: its secret differs "
                            f"({seal.ENV_SECRET} / {seal.ENV_SECRET_FILE} must be the same on every host)")
    verdict = answer.get("verdict")
    try:
      proved = isinstance(verdict, dict) and hmac.compare_digest(
          bytes.fromhex(str(answer.get("mac", ""))), seal.mac(secret, b"verdict", nonce, _canonical(verdict)))
    except ValueError:
      proved = False
    if not proved:
      raise RendezvousError(f"host {me}: the process at {address} does not hold this run's secret: not this run's "
                            "process 0")
  if not verdict["ok"]:
    raise RendezvousError(verdict["line"])
  return secret, bytes.fromhex(verdict["run"])
