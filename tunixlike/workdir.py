"""One run per workdir: a lock held for the whole run, and a workdir checked before anything is written.

The lock is an `fcntl.flock` on WORKDIR/.lock, so the kernel releases it when the holder dies,
even by SIGKILL or a machine restart: a lock nobody holds is stale by definition, whatever the file
says. The file records the holder (process id, host, start time) so a refused second run can say
who holds it; a clean exit empties it, so a file that still names a holder nobody holds is the
trace of a crashed run, taken over with a warning. flock works on local disks and on NFS (Linux
maps it to NFS byte-range locks), where runs on different hosts share a workdir.

A remote WORKDIR (gs://...) holds the checkpoints; each process's logs go to a local directory
(`local_dir`) that `upload_logs` copies there at the end.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import re
import socket
import tempfile

log = logging.getLogger("tunixlike")

LOCK_FILE = ".lock"


class WorkdirError(RuntimeError):
  """A workdir that cannot be used: not a directory, not writable, or in use by another run."""


def prepare(workdir: str) -> None:
  """Creates `workdir` (a local directory) or says in one line why it cannot be used."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir {workdir} is a file, not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"--workdir {workdir} cannot be created ({e.strerror or e})") from e
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise WorkdirError(f"--workdir {workdir} is not writable by this user")


class WorkdirLock:
  """`with WorkdirLock(dir): ...` holds dir/.lock; a second holder gets WorkdirError at once."""

  def __init__(self, directory: str):
    self.path = os.path.join(directory, LOCK_FILE)
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise WorkdirError(f"{self.path}: cannot create the workdir lock ({e.strerror or e})") from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe(_read(fd))
      os.close(fd)
      raise WorkdirError(f"--workdir {os.path.dirname(self.path)} is in use by {holder}; stop that run or choose "
                         "another --workdir") from None
    previous = _read(fd)
    if previous:
      log.warning(f"workdir: taking over the lock left by {_describe(previous)}, which is no longer running")
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(me).encode(), 0)
      os.fsync(fd)
    except OSError as e:
      os.close(fd)
      raise WorkdirError(f"{self.path}: cannot write the workdir lock ({e.strerror or e})") from e
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)  # a clean exit leaves no holder to report as stale
    except OSError:
      pass  # a full disk must not hide the run's own error; the lock itself is released below
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()


def _read(fd: int) -> dict:
  raw = os.pread(fd, 4096, 0)
  try:
    return json.loads(raw) if raw.strip() else {}
  except ValueError:
    return {"unreadable": raw[:80].decode(errors="replace")}


def _describe(holder: dict) -> str:
  if "pid" not in holder:
    return "another process (its lock file names no holder)"
  return f"process {holder['pid']} on host {holder.get('host', '?')} (started {holder.get('started', '?')})"


def is_remote(workdir: str) -> bool:
  return "://" in workdir


def local_dir(workdir: str, process_index: int = 0) -> str:
  """Where a process writes its own logs: WORKDIR for process 0, WORKDIR/process_i otherwise.

  A remote WORKDIR (gs://...) holds the checkpoints (orbax writes there directly); logs, which are
  appended to line by line, go to a local mirror that `upload_logs` copies to WORKDIR/logs.
  """
  root = workdir
  if is_remote(workdir):
    root = os.path.join(tempfile.gettempdir(), "tunixlike_logs", re.sub(r"[^\w.-]+", "_", workdir))
  return root if process_index == 0 else os.path.join(root, f"process_{process_index}")


def upload_logs(workdir: str, process_index: int = 0, say=print):
  """Copies a process's local log mirror to WORKDIR/logs (remote workdirs only)."""
  if not is_remote(workdir):
    return
  from etils import epath
  local = local_dir(workdir, process_index)
  for root, _, files in os.walk(local):
    for name in files:
      path = os.path.join(root, name)
      target = epath.Path(workdir) / "logs" / os.path.relpath(path, local)
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(open(path, "rb").read())
  say(f"logs copied from {local} to {workdir}/logs")
