"""Multi-controller JAX: start `jax.distributed` and the few cross-process agreements a run needs.

With several processes (hosts) every process runs the same program and must issue the same global
computations (those over the learner mesh, which spans every host) in the same order, while threads
and timing differ between processes. So any decision that leads to a global computation and depends
on local state (a timer, a signal, a local batch's length) is first agreed on with the small host
collectives below. The sampler only ever computes on its own host's devices, so it needs none.

    python -m tunixlike.train ... --config.distributed.coordinator_address=10.0.0.1:1234 \
        --config.distributed.num_processes=2 --config.distributed.process_id=0
    # or the same through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
    # on Cloud TPU pod slices (and SLURM, ...) `distributed.auto_detect=True` finds everything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
from typing import Any, ClassVar, Sequence

import jax
import numpy as np

from tunixlike.settings import check_fields, ints_at_least, non_negative, optional, require, setting

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_BIND = "JAX_COORDINATOR_BIND_ADDRESS"
_JAX_HEARTBEAT_S = 100  # jax.distributed.initialize's default: a process silent this long aborts every other


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """The `distributed` section. Unset keys fall back to JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
  JAX_PROCESS_ID; with none of them set the run is single-process."""

  SECTION: ClassVar[str] = "distributed"
  RESUMABLE: ClassVar[bool] = True  # a checkpoint restores onto any number of hosts' devices

  coordinator_address: str | None = setting(None, "host:port of process 0, reachable from every host")
  coordinator_bind_address: str | None = setting(
      None, "host:port process 0's coordinator listens on; None: JAX_COORDINATOR_BIND_ADDRESS, else the "
      "coordinator_address's own host (loopback on one machine, the cluster's interface on several), never every "
      "interface unless given ('0.0.0.0:PORT', '[::]:PORT': fence the port then)")
  num_processes: int | None = setting(None, "hosts taking part", check=optional(ints_at_least(1)))
  process_id: int | None = setting(None, "this host's index, 0 .. num_processes - 1", check=optional(non_negative))
  auto_detect: bool = setting(False, "Cloud TPU pod slices, SLURM, Open MPI: let JAX find the cluster itself")
  timeout_s: int = setting(300, "wait this long for every process to connect", check=ints_at_least(1))

  def __post_init__(self):
    check_fields(self)
    require(self.process_id is None or self.num_processes is None or self.process_id < self.num_processes,
            "distributed.process_id", self.process_id, f"must be < distributed.num_processes={self.num_processes}")


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve(cfg: DistributedConfig) -> DistributedConfig:
  """`cfg` with unset fields taken from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID."""
  return dataclasses.replace(
      cfg, coordinator_address=cfg.coordinator_address or os.environ.get(ENV_COORDINATOR) or None,
      num_processes=cfg.num_processes if cfg.num_processes is not None else _env_int(ENV_NUM_PROCESSES),
      process_id=cfg.process_id if cfg.process_id is not None else _env_int(ENV_PROCESS_ID))


def bind_address(cfg: DistributedConfig) -> str:
  """Where process 0's coordinator listens (`coordinator_bind_address`): the address given, not JAX's
  default of every interface ('[::]:PORT')."""
  if cfg.coordinator_bind_address or os.environ.get(ENV_BIND):
    return cfg.coordinator_bind_address or os.environ[ENV_BIND]
  host, _, port = cfg.coordinator_address.rpartition(":")
  host = host.strip("[]")
  try:
    host = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
  except OSError:
    raise ValueError(f"distributed.coordinator_address={cfg.coordinator_address}: {host!r} does not resolve on "
                     "this host") from None
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(address: str) -> tuple[str, int]:
  """(host, port) of 'HOST:PORT' ('[::1]:PORT' too)."""
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"{address!r} is not HOST:PORT")
  return host.strip("[]"), int(port)


def check_port_free(host: str, port: int, what: str) -> str | None:
  """None if this machine can listen on host:port, else the line that says why not."""
  try:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind((host, port))
  except OSError as e:
    return f"{what} {host}:{port} cannot be used ({e.strerror}): " + (
        f"another process listens there (`ss -ltnp 'sport = :{port}'`): stop it or pick another coordinator port"
        if e.errno in (98, 48) else "it is not an address of this machine")
  return None


def initialize(cfg: DistributedConfig = DistributedConfig(), *, meet=None) -> bool:
  """Starts multi-controller JAX when configured; returns True if this is a multi-process run.

  Must run before anything touches a JAX backend (`jax.devices()`, any array). A no-op for a
  single process and when already initialized (tests, notebooks, a second `run`). Process 0's
  coordinator listens on `bind_address(cfg)`.
  `meet(cfg, bind)`: a start-up step of every process before JAX's coordination service, given the
  resolved config and process 0's bind address (whole hosts: `hosts.rendezvous.initialize`, which
  checks the coordinator's port itself); returns the heartbeat timeout JAX is to use.
  """
  if jax.distributed.is_initialized():
    return jax.process_count() > 1
  cfg = resolve(cfg)
  if cfg.num_processes is not None and cfg.num_processes > 1:
    missing = [n for n, v in (("distributed.coordinator_address / " + ENV_COORDINATOR, cfg.coordinator_address),
                              ("distributed.process_id / " + ENV_PROCESS_ID, cfg.process_id)) if v is None]
    if missing:
      raise ValueError(f"distributed.num_processes={cfg.num_processes} also needs {' and '.join(missing)}")
    if not 0 <= cfg.process_id < cfg.num_processes:
      raise ValueError(f"distributed.process_id={cfg.process_id}: must be in [0, {cfg.num_processes})")
    bind = bind_address(cfg) if cfg.process_id == 0 else None  # only process 0 listens
    heartbeat_s = _JAX_HEARTBEAT_S
    if meet is not None:
      heartbeat_s = meet(cfg, bind)
    elif cfg.process_id == 0:
      problem = check_port_free(*split_address(bind), "host 0: the coordinator address")
      if problem:
        raise ValueError(problem)
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, initialization_timeout=cfg.timeout_s,
                               coordinator_bind_address=bind, heartbeat_timeout_seconds=heartbeat_s)
  elif cfg.auto_detect:
    if meet is not None:
      raise ValueError("distributed.auto_detect with mesh.sampler_hosts: set distributed.coordinator_address, "
                       "num_processes and process_id (the transfer server's address derives from them)")
    jax.distributed.initialize(initialization_timeout=cfg.timeout_s, coordinator_bind_address=(
        cfg.coordinator_bind_address or os.environ.get(ENV_BIND)))
  else:
    return False
  return jax.process_count() > 1


# The processes that take part in the host collectives below: all of them, or with whole sampler
# hosts (mesh.sampler_hosts) the learner hosts only, which run the learner's program in lockstep
# while the sampler hosts never join a collective.
_group: tuple[int, ...] | None = None


def set_process_group(processes: Sequence[int] | None) -> None:
  """Restricts the host collectives to `processes` (None: every process)."""
  global _group
  _group = None if processes is None else tuple(sorted(processes))


def group() -> tuple[int, ...]:
  return tuple(range(jax.process_count())) if _group is None else _group


def group_size() -> int:
  return len(group())


def group_rank() -> int:
  """This process's place among `group()` (its data shard, its eval shard)."""
  return group().index(jax.process_index())


def is_multiprocess() -> bool:
  return group_size() > 1


# ---- host collectives (every process of the group must call them at the same point) --------------
def allgather(values: Sequence[float] | np.ndarray) -> np.ndarray:
  """[group_size, n]: every process's `values` (a small 1-D numeric vector)."""
  x = np.asarray(values)
  if not is_multiprocess():
    return x[None]
  if _group is None:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x))
  return _group_allgather(x)


def _group_allgather(x: np.ndarray) -> np.ndarray:
  """process_allgather over the group's processes only: one device of each, one all-gather."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  firsts = {}
  for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
    firsts.setdefault(d.process_index, d)
  mesh = Mesh(np.array([firsts[p] for p in _group]), ("p",))
  mine = jax.device_put(x[None], firsts[jax.process_index()])
  rows = jax.make_array_from_single_device_arrays((len(_group),) + x.shape, NamedSharding(mesh, PartitionSpec("p")),
                                                  [mine])
  return np.asarray(_replicate(NamedSharding(mesh, PartitionSpec()))(rows).addressable_data(0))


@functools.lru_cache(maxsize=8)
def _replicate(sharding):
  return jax.jit(lambda a: a, out_shardings=sharding)


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (a stop request, a time-based checkpoint)."""
  return bool(allgather(np.array([int(bool(flag))], np.int32)).max())


def max_over_processes(value: int) -> int:
  return int(allgather(np.array([int(value)], np.int32)).max())


def allgather_json(obj: Any) -> list[Any]:
  """Every process's JSON-able `obj`, in process order (e.g. each host's data-stream position)."""
  if not is_multiprocess():
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode("utf-8"), np.uint8)
  longest = max_over_processes(len(data))
  padded = np.zeros((longest + 1,), np.int32)  # int32: process_allgather keeps the dtype exactly
  padded[0], padded[1:1 + len(data)] = len(data), data
  rows = allgather(padded)
  return [json.loads(bytes(r[1:1 + r[0]].astype(np.uint8)).decode("utf-8")) for r in rows]
