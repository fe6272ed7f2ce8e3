"""The run's secret and the seal on every message between hosts (mesh.sampler_hosts > 0).

JAX's coordination service checks nothing: any process that reaches its port can read, write and
delete keys. So every entry tunixlike writes there (rollout groups and their rewards, admissions,
weight announcements with their checksums, stops) is sealed: an HMAC-SHA256, under the run's
secret, of the run's id (drawn by process 0 at start-up), the key, the writer's process id, the
writer's sequence number and the value. A reader refuses an entry whose seal does not verify
(forged, or sealed for another key or run) and one whose sequence number it has seen before for
that key and writer (replayed), and counts it (`Sealer.refused`); nothing refused reaches training.

The secret comes from the launcher, never from the command line: `TUNIXLIKE_HOSTS_SECRET` (the
value) or `TUNIXLIKE_HOSTS_SECRET_FILE` (a file only its owner can read). A run whose processes are
all on this machine (a loopback coordinator) may have neither: process 0 then draws one for the run
into a file only the user can read (`~/.cache/tunixlike/hosts/secret-PORT`), which the others read
once process 0 answers them. Several machines must be given one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import threading

log = logging.getLogger("tunixlike")

ENV_SECRET = "TUNIXLIKE_HOSTS_SECRET"
ENV_SECRET_FILE = "TUNIXLIKE_HOSTS_SECRET_FILE"
_TAG = 32  # bytes of an HMAC-SHA256
_HEAD = struct.Struct(">IQ")  # writer process id, its sequence number


class SecretError(ValueError):
  """No usable secret: one line naming the variable or the file."""


def is_loopback(host: str) -> bool:
  """Whether `host` (a name or an address) is this machine's loopback: the run's processes share one machine."""
  try:
    infos = socket.getaddrinfo(host.strip("[]"), None)
  except OSError:
    return False
  return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def own_secret_path(port: int) -> str:
  """Where process 0 of a one-machine run keeps the secret it drew (per coordinator port: one run at a time)."""
  return os.path.join(os.path.expanduser("~"), ".cache", "tunixlike", "hosts", f"secret-{port}")


def _read_private(path: str, what: str) -> bytes:
  try:
    st = os.stat(path)
  except OSError as e:
    raise SecretError(f"{what}: cannot read {path}: {e.strerror}") from None
  if st.st_mode & 0o077 or st.st_uid != os.getuid():
    raise SecretError(f"{what}: {path} must be yours and readable by you only (chmod 600 {path})")
  with open(path, "rb") as f:
    value = f.read().strip()
  if not value:
    raise SecretError(f"{what}: {path} is empty")
  return value


def load(coordinator_host: str, port: int, process_id: int) -> bytes:
  """The run's secret (see the module docstring). Process 0 of a one-machine run with none given
  draws a new one, so call it there before answering the other processes, and on them after."""
  value = os.environ.get(ENV_SECRET)
  if value:
    return value.encode()
  path = os.environ.get(ENV_SECRET_FILE)
  if path:
    return _read_private(path, ENV_SECRET_FILE)
  if not is_loopback(coordinator_host):
    raise SecretError(f"whole hosts on several machines need the run's secret: give every host the same "
                      f"{ENV_SECRET_FILE}=PATH, a file only you can read (umask 077; head -c 32 /dev/urandom | "
                      f"base64 > PATH), or {ENV_SECRET}")
  path = own_secret_path(port)
  if process_id == 0:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
      f.write(secrets.token_hex(32))
    os.replace(tmp, path)
  return _read_private(path, f"the secret process 0 drew for this run ({ENV_SECRET_FILE} not set)")


def mac(secret: bytes, *parts: bytes) -> bytes:
  """HMAC-SHA256 of `parts`, each length-prefixed (no two part lists give the same input)."""
  h = hmac.new(secret, digestmod=hashlib.sha256)
  for p in parts:
    h.update(struct.pack(">Q", len(p)) + p)
  return h.digest()


class Sealer:
  """Seals this process's entries and opens the others' (see the module docstring). `run_id`: the
  id process 0 drew for this run; `me`: this process's id."""

  def __init__(self, secret: bytes, run_id: bytes, me: int):
    self._secret, self._run, self.me = secret, run_id, me
    self._seq = 0
    self._seen: dict[tuple[str, int], int] = {}  # (key, writer) -> the last sequence number accepted
    self._lock = threading.Lock()
    self.refused = 0

  def seal(self, key: str, value: bytes) -> bytes:
    with self._lock:
      self._seq += 1
      head = _HEAD.pack(self.me, self._seq)
    return mac(self._secret, self._run, key.encode(), head, value) + head + value

  def open(self, key: str, data: bytes, *, once: bool) -> bytes | None:
    """The value of `data` read at `key`, or None (counted) if it is forged or replayed. `once`: an
    entry read once and deleted (a group, an acknowledgement), whose sequence number must be new;
    else one overwritten in place (a heartbeat, a state), which must not go back."""
    if len(data) < _TAG + _HEAD.size:
      return self._refuse(key, "too short to carry a seal")
    tag, head, value = data[:_TAG], data[_TAG:_TAG + _HEAD.size], data[_TAG + _HEAD.size:]
    if not hmac.compare_digest(tag, mac(self._secret, self._run, key.encode(), head, value)):
      return self._refuse(key, "its seal does not verify (not written by this run's hosts)")
    writer, seq = _HEAD.unpack(head)
    with self._lock:
      last = self._seen.get((key, writer), 0)
      fresh = seq > last or (seq == last and not once)  # an overwritten entry may be read again
      if fresh:
        self._seen[key, writer] = seq
    return value if fresh else self._refuse(key, f"replayed (sequence {seq} of host {writer})")

  def _refuse(self, key: str, why: str) -> None:
    with self._lock:
      self.refused += 1
      n = self.refused
    if n == 1 or n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th ...: a flood is counted, not logged line by line
      log.warning(f"host {self.me}: refused a key-value entry at {key!r}: {why} ({n} refused so far; "
                  "another process reaches the coordinator's port: fence it, docs/hosts_and_accelerators.md)")
    return None
