"""Run checkpoints over orbax: the learner state (sharded arrays) plus a JSON `meta` dict.

A step directory holds three orbax items:
  state   the train-state pytree (orbax StandardSave: every device writes its own shards)
  meta    what the caller needs to resume besides arrays (policy version, RNG key, data position,
          runtime counters, in-flight prompt ids, the config), as JSON
  layout  how the state was saved ({"format": 1, "frozen_saved": bool})
plus `digest.json` (below) and, with a `best_metric`, orbax's `metrics` item (the `save(metrics=)`).

Saves are asynchronous: `save` returns once the arrays are copied off the devices (so the caller
may donate or overwrite them) and orbax writes them in a background thread. Orbax writes into a
temporary directory and renames it when complete, so an interrupted save is never listed; a step
directory that is listed but lacks an item's metadata (a foreign or damaged directory) is skipped
as well. Restores go straight into the target shardings (each device reads its own slice), after
checking every array's shape against the checkpoint's metadata, so a checkpoint of another model
fails with the parameter path and both shapes rather than an opaque tensorstore error.

Content check: orbax (0.12) keeps no checksum of the array data and offers no option for one
(flipped bytes load as garbage values), so each step directory gets a `digest.json`, the SHA-256
of every file in it. It can only be computed once the background save has finished, so process 0
writes it when the next save starts (on a thread of its own, off the learner's path), and at
`wait()` and `close()`. `restore` hashes the files again first; a file that
changed or went missing makes the checkpoint unreadable, and restore(step=None) falls back to the
next older one, as it does when orbax cannot read a file. A checkpoint without a digest (the
process was killed between the save and the next save/wait/close, or it was written by an older
version of this module) is restored with a warning after one plain read of every key of its array
store: rejecting it would throw away the newest state of every run stopped by SIGKILL, and a file
that is missing or cut short then fails that read, before orbax reads it (orbax closes its event
loop on the first failed read while tensorstore still finishes the others' callbacks into it). The check costs one extra read of each checkpoint in
the background (process 0) and one at each restore (every process). Any changed byte fails it, also
in bytes orbax would not read.

Rotation is orbax's preservation policy: the latest `keep` checkpoints, plus (with `best_metric`)
the one whose `metrics[best_metric]` is best, so a run that collapses and keeps saving does not
rotate away its best state (of equally good ones, orbax keeps the newest). Orbax stores each step's
metrics in the step directory, so the best step is remembered by a resumed run. Checkpoints saved
without metrics only rotate as latest-K.

`save_frozen=False` leaves out the state's `frozen` subtree: under LoRA with base weights loaded
from a Hugging Face directory, those weights are already on disk and never change; the restore
then takes them from the live state passed as `abstract_state`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import numbers
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from tunixlike import settings

log = logging.getLogger("tunixlike")


class _SavesWithoutMetrics(logging.Filter):
  """Orbax warns at every save without metrics when it tracks a best metric; here those are the
  periodic checkpoints between evals, by design (they rotate as latest-K only)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "did not provide metrics" not in record.getMessage()


class _BackgroundFailures(logging.Filter):
  """Orbax logs a failed background write from each of its threads, with a traceback (a full disk:
  about 25 of them). `Checkpointer` raises that failure as one CheckpointWriteError naming its cause
  at the next save, wait or close, so orbax's own error records are left out."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


logging.getLogger("absl").addFilter(_SavesWithoutMetrics())
logging.getLogger("absl").addFilter(_BackgroundFailures())

FORMAT = 1
CHECKPOINT_SUBDIR = "checkpoints"  # <workdir>/checkpoints: where the trainer writes and export reads
WARM_START_SUBDIR = "warm_start"  # <workdir>/warm_start: an interrupted warm start, until step 0 is saved
_ITEM_FILES = {"state": "_METADATA", "meta": "metadata", "layout": "metadata"}
RUN_BEST_METRIC = "eval/accuracy"  # what a training run ranks its checkpoints by: held-out accuracy
DIGEST_FILE = "digest.json"  # in each step directory: {"algorithm": "sha256", "files": {relpath: hex}}
_HASH_CHUNK = 8 << 20


EXTRA_ITEMS = ("rollouts",)  # JSON items a checkpoint may hold beside its state (a deterministic run's groups)


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or restored as asked; the message names the directory."""


class CheckpointWriteError(CheckpointError):
  """A save that failed while writing (a full disk, a lost bucket), not a checkpoint that does not fit the run."""


def workdir_checkpoints(workdir) -> str:
  """The checkpoint directory of a run's workdir."""
  return os.path.join(os.fspath(workdir), CHECKPOINT_SUBDIR)


def last_saved_step(directory) -> int | None:
  """The newest complete checkpoint's step in `directory`, from a listing alone (no orbax manager: safe
  in a signal handler), or None."""
  root = epath.Path(directory)
  try:
    steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
    return next((s for s in steps if all((root / str(s) / item / name).exists()
                                         for item, name in _ITEM_FILES.items())), None)
  except OSError:
    return None


def abstract_like(tree: Any) -> Any:
  """jax.ShapeDtypeStruct (shape, dtype, sharding) of every array leaf: a restore target that
  allocates nothing."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


# ---- pytree helpers --------------------------------------------------------------------------------
def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _flat_by_path(tree) -> dict[tuple[str, ...], Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
  return {tuple(_key_str(k) for k in path): leaf for path, leaf in leaves if leaf is not None}


def _show(path: tuple[str, ...]) -> str:
  # nnx Variables flatten to a `value` child; leave it out of the name a user reads.
  return "/".join(path[:-1] if len(path) > 1 and path[-1] == "value" else path)


def _get_frozen(tree):
  return tree["frozen"] if isinstance(tree, dict) else tree.frozen


def _set_frozen(tree, value):
  if isinstance(tree, dict):
    return {**tree, "frozen": value}
  if not hasattr(tree, "frozen") or not hasattr(tree, "replace"):
    raise TypeError(f"save_frozen=False needs a state with a `frozen` field (a TrainState or a dict), "
                    f"got {type(tree).__name__}")
  return tree.replace(frozen=value)


def _check_json(value, where: str):
  """Raises naming the first key whose value JSON cannot store exactly."""
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, str):
        raise TypeError(f"{where}: key {k!r} is not a string (JSON object keys must be strings)")
      _check_json(v, f"{where}[{k!r}]")
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      _check_json(v, f"{where}[{i}]")
  elif isinstance(value, float):
    if not math.isfinite(value):
      raise ValueError(f"{where}={value!r} is not finite; JSON cannot store it")
  elif not (value is None or isinstance(value, (str, int, bool))):
    raise TypeError(f"{where} is a {type(value).__name__}; checkpoint meta holds only JSON values "
                    "(dict, list, str, int, float, bool, None): convert it first (e.g. int(x), x.tolist())")


# ---- content digests --------------------------------------------------------------------------------
def _sha256(path: epath.Path) -> str | None:
  """Hex SHA-256 of a file's bytes, or None when it does not exist."""
  h = hashlib.sha256()
  try:
    with path.open("rb") as f:
      while chunk := f.read(_HASH_CHUNK):
        h.update(chunk)
  except FileNotFoundError:
    return None
  return h.hexdigest()


def _hash_files(root: epath.Path, rels) -> dict[str, str | None]:
  # hashlib releases the GIL on large buffers, so threads hash several files at once.
  rels = sorted(rels)
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, len(rels)))) as pool:
    return dict(zip(rels, pool.map(lambda rel: _sha256(root / rel), rels)))


def _step_files(root: epath.Path) -> list[str]:
  """Every file under a step directory (relative, '/'-separated), the digest's own files excepted."""
  out = []
  for folder, _, names in root.walk():  # epath's walk, as it works on gs:// too (rglob does not)
    for name in names:
      rel = (folder / name).relative_to(root).as_posix()
      if not rel.startswith(DIGEST_FILE):
        out.append(rel)
  return out


# ---- the checkpointer -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CheckpointSchedule(settings.FromConfig):
  """When a writing `Checkpointer` saves on its own (`should_save`) and how many saves it keeps: the run's
  `checkpoint` keys (`CheckpointSchedule.from_config(cfg)`)."""

  keep: int = settings.tree_key("checkpoint.keep")
  every_steps: int = settings.tree_key("checkpoint.every_steps")  # 0: off
  every_seconds: float = settings.tree_key("checkpoint.every_seconds")  # 0: off

  def __post_init__(self):
    if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
      raise ValueError(f"CheckpointSchedule keep={self.keep!r} must be an int >= 1")
    if not isinstance(self.every_steps, int) or isinstance(self.every_steps, bool) or self.every_steps < 0:
      raise ValueError(f"CheckpointSchedule every_steps={self.every_steps!r} must be an int >= 0")
    if not (isinstance(self.every_seconds, (int, float)) and math.isfinite(self.every_seconds)
            and self.every_seconds >= 0):
      raise ValueError(f"CheckpointSchedule every_seconds={self.every_seconds!r} must be a finite number >= 0")


class Checkpointer:
  """Keeps the last `schedule.keep` checkpoints of one run in `directory` (local path or gs://...).

  schedule: when `should_save(step)` says yes and how many to keep (`CheckpointSchedule.from_config(cfg)`);
    a read-only Checkpointer needs none.
  best_metric / best_mode: also keep the checkpoint whose `save(..., metrics=)[best_metric]` is the
    highest ("max") or lowest ("min") so far; None keeps only the latest `keep`.
  keep_steps / keep_every_steps: also keep these steps / every step that is a multiple of it (0: none).
  read_only: never create or write anything (export); a missing directory then has no steps.
  processes: the processes that save and restore together (None: all; whole sampler hosts hold no
    learner state and take no part).
  """

  def __init__(self, directory, schedule: CheckpointSchedule | None = None, *, save_frozen: bool = True,
               read_only: bool = False, best_metric: str | None = None, best_mode: str = "max", clock=time.monotonic,
               processes=None, keep_steps: tuple[int, ...] = (), keep_every_steps: int = 0):
    if schedule is None and not read_only:
      raise ValueError(f"Checkpointer({os.fspath(directory)!r}): one that writes needs a schedule "
                       "(CheckpointSchedule.from_config(cfg))")
    if best_metric is not None and not (isinstance(best_metric, str) and best_metric):
      raise ValueError(f"Checkpointer best_metric={best_metric!r} must be a metric name or None")
    if best_mode not in ("max", "min"):
      raise ValueError(f"Checkpointer best_mode={best_mode!r} must be 'max' or 'min'")
    directory = os.fspath(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self.schedule, self.save_frozen, self.read_only = schedule, save_frozen, read_only
    self.best_metric, self.best_mode = best_metric, best_mode
    self._clock = clock  # seconds; tests pass a controlled one
    self._last_save_time = clock()
    self._last_saved_step: int | None = None
    self._undigested: int | None = None  # the step whose save is in flight: its digest comes after
    # Digests are written on their own thread: hashing a large checkpoint must not stall the next save.
    self._digester = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint_digest")
    self._digesting: concurrent.futures.Future | None = None
    self._manager: ocp.CheckpointManager | None = None
    self._one_of_many = processes is not None and len(set(processes)) == 1 and jax.process_count() > 1
    if read_only and not epath.Path(self.directory).is_dir():
      return  # nothing to read; latest_step() is None
    policy = ocp.checkpoint_managers
    preserve = policy.LatestN(n=schedule.keep if schedule else None)  # read-only: removes nothing
    if keep_steps:  # e.g. step 0, where a replay of the run starts
      preserve = policy.AnyPreservationPolicy([preserve, policy.CustomSteps(steps=list(keep_steps))])
    if keep_every_steps:  # e.g. a run's replay points
      preserve = policy.AnyPreservationPolicy([preserve, policy.EveryNSteps(interval_steps=keep_every_steps)])
    best_fn = None
    if best_metric is not None:
      best_fn = self._metric_value
      # keep_checkpoints_without_metrics=False: those rotate as latest-K only. BestN sorts
      # ascending and keeps the last n, so "min" sorts in reverse.
      preserve = policy.AnyPreservationPolicy([preserve, policy.BestN(
          get_metric_fn=best_fn, reverse=best_mode == "min", n=1, keep_checkpoints_without_metrics=False)])
    # best_fn (besides the policy) makes orbax write each step's metrics and rank them in best_step().
    options = ocp.CheckpointManagerOptions(preservation_policy=preserve, best_fn=best_fn, best_mode=best_mode,
                                           enable_async_checkpointing=True, read_only=read_only,
                                           create=not read_only and processes is None,
                                           cleanup_tmp_directories=not read_only,
                                           multiprocessing_options=ocp.options.MultiprocessingOptions(
                                               active_processes=None if processes is None else set(processes)))
    if processes is not None and not read_only:  # orbax creates it only when every process takes part
      epath.Path(self.directory).mkdir(parents=True, exist_ok=True)
    # Handlers named up front: a fresh manager can then read any item's metadata before restoring it.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "layout": ocp.JsonCheckpointHandler(), **{name: ocp.JsonCheckpointHandler() for name in EXTRA_ITEMS}}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ---- which steps exist
  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _is_complete(self, step: int) -> bool:
    root = epath.Path(self.step_dir(step))
    return all((root / item / name).exists() for item, name in _ITEM_FILES.items())

  def all_steps(self) -> list[int]:
    """Complete checkpoints, oldest first (orbax lists only finalized ones; we also skip any that
    lack an item's metadata)."""
    if self._manager is None:
      return []
    steps = []
    for step in sorted(self._manager.all_steps()):
      if self._is_complete(step):
        steps.append(step)
      else:
        log.warning(f"checkpoint: ignoring incomplete checkpoint directory {self.step_dir(step)}")
    return steps

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None (fresh start)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The step of the preserved checkpoint with the best `best_metric`, or None (no best_metric,
    or no checkpoint saved with it). The one whose save is still in flight counts too."""
    if self._manager is None or self.best_metric is None:
      return None
    step = self._manager.best_step()
    if step is None or not math.isfinite(self._metric_value(self._manager.metrics(step))):
      return None
    return step

  def pick_step(self, step: int | None = None, *, best: bool = False) -> int:
    """`step` if it is complete; with `best`, the best checkpoint's (see `best_step`); else the newest.
    Raises CheckpointError naming the directory and the steps there."""
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"{self.directory}: no complete checkpoint found")
    if best:
      found = self.best_step()
      if found is None:
        raise CheckpointError(f"{self.directory}: no checkpoint saved with a {self.best_metric!r} metric to pick the "
                              f"best by (steps: {steps})")
      return found
    if step is not None and step not in steps:
      raise CheckpointError(f"{self.step_dir(step)}: no complete checkpoint at step {step} (steps: {steps})")
    return steps[-1] if step is None else step

  def _metric_value(self, metrics) -> float:
    """The ranking key orbax sorts by; a checkpoint lacking the metric (saved under another
    best_metric) ranks worst."""
    worst = -math.inf if self.best_mode == "max" else math.inf
    value = (metrics or {}).get(self.best_metric)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else worst

  # ---- saving
  def should_save(self, step: int) -> bool:
    """True when `step` is due by the step or the time interval (and not saved already)."""
    if self.schedule is None or step <= 0 or (self._last_saved_step is not None and step <= self._last_saved_step):
      return False
    every_steps, every_seconds = self.schedule.every_steps, self.schedule.every_seconds
    if every_steps and step % every_steps == 0:
      return True
    return bool(every_seconds) and self._clock() - self._last_save_time >= every_seconds

  def save(self, step: int, state: Any, meta: dict, *, metrics: dict | None = None, force: bool = False,
           extra: dict[str, dict] | None = None) -> bool:
    """Starts an asynchronous save of `state` (a pytree of jax.Arrays) and `meta` (JSON) at `step`.

    metrics: {name: number} ranking this checkpoint for `best_metric` (which it must then hold);
      recorded only when the Checkpointer has a best_metric. A non-finite value is left out with a
      warning; without a finite best_metric the checkpoint is never kept as the best.
    extra: more JSON items by name (of `EXTRA_ITEMS`), read back with `read_item`.
    Returns False without saving when the step is not due (`should_save`, unless force=True) or
    already saved. Returns once the arrays are copied off the devices: the caller may donate them.
    Waits for the previous save first and hands its digest to a background thread. A background
    write error surfaces at the next `save`, `wait` or `close`.
    """
    if self._manager is None or self.read_only:
      raise CheckpointError(f"{self.directory}: checkpointer is read-only")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise ValueError(f"checkpoint step={step!r} must be an int >= 0")
    if not isinstance(meta, dict):
      raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
    _check_json(meta, "meta")
    metrics = self._clean_metrics(step, metrics)
    if not force and not self.should_save(step):
      return False
    if step in self._manager.all_steps():
      log.info(f"checkpoint: step {step} is already saved in {self.directory}")
      return False
    self._finish_pending(digest_now=False)
    if not self.save_frozen:
      state = _set_frozen(state, None)
    if self._one_of_many:
      # One learner host in a job of several processes (whole sampler hosts): orbax refuses to save
      # arrays held by one process when there are several ("host local"), so they go as host
      # copies, the same bytes; a restore puts them back on the learner's shardings.
      state = jax.device_get(state)
    layout = {"format": FORMAT, "frozen_saved": self.save_frozen}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                              layout=ocp.args.JsonSave(layout),
                              **{name: ocp.args.JsonSave(item) for name, item in (extra or {}).items()})
    try:
      saved = self._manager.save(step, args=args, metrics=metrics, force=True)
    except Exception as e:
      raise CheckpointWriteError(f"{self.step_dir(step)}: saving failed ({type(e).__name__}: {e})") from e
    self._undigested = step if saved else None
    self._last_saved_step = step
    self._last_save_time = self._clock()
    return bool(saved)

  def _clean_metrics(self, step: int, metrics: dict | None) -> dict | None:
    """What orbax records for `step`: finite numbers only, None without a usable best_metric."""
    if metrics is None:
      return None
    if not isinstance(metrics, dict):
      raise TypeError(f"checkpoint metrics must be a dict of numbers, got {type(metrics).__name__}")
    clean = {}
    for name, value in metrics.items():
      if not isinstance(name, str):
        raise TypeError(f"checkpoint metrics: key {name!r} is not a string")
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"checkpoint metrics[{name!r}] is a {type(value).__name__}, not a number")
      if math.isfinite(value):
        clean[name] = float(value)
      else:  # a collapsing run's NaN must neither stop the save nor rank as best
        log.warning(f"checkpoint: step {step} metric {name}={value} is not finite; not recorded")
    if self.best_metric is None:
      return None
    if self.best_metric not in metrics:
      raise ValueError(f"checkpoint metrics hold no {self.best_metric!r} (the best_metric), only "
                       f"{sorted(metrics)}: pass it, or metrics=None for a checkpoint never kept as the best")
    return clean if self.best_metric in clean else None

  def _finish_pending(self, digest_now: bool = True) -> None:
    """Waits for the save in flight, then has its digest written (process 0), in the background
    unless `digest_now`."""
    step, self._undigested = self._undigested, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      raise CheckpointWriteError(f"{self.directory}: background checkpoint save failed "
                            f"({type(e).__name__}: {e})") from e
    if step is not None and jax.process_index() == 0:
      if self._digesting is not None:
        self._digesting.result()  # one at a time, in step order
      self._digesting = self._digester.submit(self._write_digest, step)
    if digest_now and self._digesting is not None:
      self._digesting.result()  # _write_digest never raises: a failure leaves the step unverified
      self._digesting = None

  def _write_digest(self, step: int) -> None:
    root = epath.Path(self.step_dir(step))
    try:
      files = _hash_files(root, _step_files(root))
      missing = sorted(rel for rel, h in files.items() if h is None)
      if missing:  # deleted under us: nothing trustworthy to record
        raise FileNotFoundError(f"{root / missing[0]} vanished while hashing")
      tmp = root / (DIGEST_FILE + ".tmp")
      tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1, sort_keys=True))
      tmp.replace(root / DIGEST_FILE)  # a reader never sees half a digest
    except Exception as e:  # the checkpoint itself is fine; it will be restored unverified
      log.warning(f"checkpoint: could not write {root / DIGEST_FILE} ({type(e).__name__}: {e}); "
                  "that checkpoint will be restored without a content check")

  def wait(self) -> None:
    """Blocks until the pending save (if any) is on disk, and writes its digest."""
    if self._manager is not None:
      self._finish_pending()

  def close(self) -> None:
    """Waits for the pending save, writes its digest and releases orbax's threads."""
    if self._manager is not None:
      try:
        self.wait()
      finally:
        self._manager.close()
        self._manager = None
        self._digester.shutdown(wait=True)

  # ---- restoring
  def read_meta(self, step: int | None = None) -> dict:
    """The meta dict saved at `step` (default: the newest complete checkpoint)."""
    step = self._resolve(step)
    return self._read_json(step, "meta")

  def read_item(self, step: int, name: str) -> dict:
    """A JSON item saved with `save(extra={name: ...})` at `step`."""
    return self._read_json(self._resolve(step), name)

  def layout(self, step: int | None = None) -> dict:
    """How `step` was saved: {"format": int, "frozen_saved": bool}."""
    return self._read_json(self._resolve(step), "layout")

  def _read_json(self, step: int, item: str) -> dict:
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
      return dict(out[item])
    except Exception as e:
      raise CheckpointError(f"{self.step_dir(step)}: cannot read {item!r} ({type(e).__name__}: {e})") from e

  def _resolve(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise CheckpointError(f"{self.directory}: no complete checkpoint found")
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"{self.step_dir(step)}: no complete checkpoint at step {step} "
                            f"(complete steps in {self.directory}: {steps})")
    return step

  def restore(self, step: int | None = None, *, abstract_state: Any, partial: bool = False,
              fallback: bool = True) -> tuple[Any, dict]:
    """(state, meta) of checkpoint `step` (default: the newest complete one).

    abstract_state: the target: the live state or `abstract_like(live_state)`. Arrays come back with
      its leaves' shardings, never gathered on one device. If the checkpoint was saved without
      `frozen`, those leaves must be live arrays and are returned as they are.
    partial: `abstract_state` is a dict holding a subset of the saved top-level fields (e.g. only
      {"params", "frozen"} for export); the rest of the checkpoint is not read.
    fallback: with step=None, a checkpoint whose files are unreadable or differ from its digest
      (damaged after it was finalized) is skipped, with a warning, for the next older one.
    Raises CheckpointError naming the directory when nothing can be restored, and naming the first
    parameter path with both shapes when the checkpoint holds a model of another shape.
    """
    if step is not None or not fallback:
      return self._restore_step(self._resolve(step), abstract_state, partial)
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"{self.directory}: no complete checkpoint found")
    errors = []
    for s in reversed(steps):
      try:
        return self._restore_step(s, abstract_state, partial)
      except _Unreadable as e:
        log.warning(f"checkpoint: {e}; trying an older checkpoint")
        errors.append(str(e))
    raise CheckpointError("no readable checkpoint: " + "; ".join(errors))

  def _restore_step(self, step: int, abstract_state: Any, partial: bool) -> tuple[Any, dict]:
    where = self.step_dir(step)
    self._verify(step)
    layout = self._read_json_unreadable(step, "layout")
    if layout.get("format") != FORMAT:
      raise CheckpointError(f"{where}: checkpoint format {layout.get('format')!r}, this code reads {FORMAT}")
    frozen_saved = bool(layout.get("frozen_saved", True))
    live_frozen = None
    target = abstract_state
    if not frozen_saved and (not partial or "frozen" in target):
      live_frozen = _get_frozen(abstract_state)
      for path, leaf in _flat_by_path(live_frozen).items():
        if not isinstance(leaf, jax.Array):
          raise CheckpointError(f"{where}: the checkpoint was saved without the frozen base weights "
                                f"(save_frozen=False) and abstract_state.frozen/{_show(path)} is not a live "
                                "array: load the base weights first and pass the live state")
      target = {k: v for k, v in target.items() if k != "frozen"} if partial else _set_frozen(target, None)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    self._check_shapes(step, target, partial)
    try:
      if partial:  # the state item read by a plain PyTree handler, which can skip what is not asked for
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        with ocp.PyTreeCheckpointer() as reader:
          state = reader.restore(epath.Path(where) / "state", args=ocp.args.PyTreeRestore(
              target, restore_args=restore_args, partial_restore=True))
        meta = self._read_json(step, "meta")
      else:
        out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                  meta=ocp.args.JsonRestore()))
        state, meta = out["state"], dict(out["meta"])
    except Exception as e:
      raise _Unreadable(f"{where}: checkpoint unreadable ({type(e).__name__}: {_first_line(e)})") from e
    if live_frozen is not None:
      state = {**state, "frozen": live_frozen} if partial else _set_frozen(state, live_frozen)
    return state, meta

  def _verify(self, step: int) -> None:
    """Raises _Unreadable naming the files that differ from the step's digest.json."""
    root = epath.Path(self.step_dir(step))
    path = root / DIGEST_FILE
    if not path.exists():
      log.warning(f"checkpoint: {root} has no {DIGEST_FILE} (its process stopped before the next save, wait or "
                  "close wrote it): restoring it without a content check")
      _read_every_key(root / "state")
      return
    try:
      digest = json.loads(path.read_text())
      want = digest["files"]
      if digest.get("algorithm") != "sha256" or not isinstance(want, dict) or not want:
        raise ValueError(f"unexpected content {str(digest)[:100]}")
    except Exception as e:
      raise _Unreadable(f"{root}: checkpoint unreadable ({path} is damaged: {type(e).__name__}: "
                        f"{_first_line(e)})") from e
    got = _hash_files(root, want)
    bad = [rel for rel in sorted(want) if got[rel] != want[rel]]
    if bad:
      what = ", ".join(f"{root / rel} {'is missing' if got[rel] is None else 'changed'}" for rel in bad[:3])
      more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
      raise _Unreadable(f"{root}: checkpoint unreadable (content check against {DIGEST_FILE}: {what}{more})")

  def _read_json_unreadable(self, step: int, item: str) -> dict:
    try:
      return self._read_json(step, item)
    except CheckpointError as e:
      raise _Unreadable(str(e)) from e.__cause__

  def _check_shapes(self, step: int, target: Any, partial: bool) -> None:
    where = self.step_dir(step)
    try:
      saved_tree = self._manager.item_metadata(step)["state"]
      saved = _flat_by_path(saved_tree)
    except Exception as e:
      raise _Unreadable(f"{where}: checkpoint unreadable (state metadata: {type(e).__name__}: "
                        f"{_first_line(e)})") from e
    want = _flat_by_path(target)
    for path, leaf in want.items():
      if path not in saved:
        extra = sorted(_show(p) for p in set(saved) - set(want))
        raise CheckpointError(
            f"{where}: checkpoint has no {_show(path)!r} (this model expects {len(want)} arrays, the checkpoint "
            f"holds {len(saved)}{'; e.g. ' + repr(extra[:3]) if extra else ''}): it was written by a different "
            "model, LoRA or optimizer setup")
      shape = tuple(getattr(saved[path], "shape", ()) or ())
      if shape != tuple(leaf.shape):
        raise CheckpointError(f"{where}: {_show(path)} has shape {list(shape)} in the checkpoint but "
                              f"{list(leaf.shape)} in this model: the checkpoint is from a model of another shape")
    if not partial:
      extra = sorted(_show(p) for p in set(saved) - set(want))
      if extra:
        raise CheckpointError(f"{where}: checkpoint holds {len(extra)} array(s) this state does not have, "
                              f"e.g. {extra[:3]}: it was written by a different model, LoRA or optimizer setup")


class _Unreadable(CheckpointError):
  """A finalized checkpoint whose files cannot be read (the only case `restore` falls back on)."""


def _read_every_key(state_dir: epath.Path) -> None:
  """Reads each key of an OCDBT array store once (synchronously, tensorstore only); raises _Unreadable
  naming the key or the store when a file is missing or cut short."""
  if not (state_dir / "manifest.ocdbt").exists():
    return  # not an OCDBT store (or its manifest is gone): orbax's own read reports it
  base = os.fspath(state_dir)
  key = None
  try:
    store = ts.KvStore.open({"driver": "ocdbt", "base": (base if "://" in base else f"file://{base}") + "/"}).result()
    for key in store.list().result():
      store.read(key).result()
  except Exception as e:
    what = f"key {key.decode()!r} of {state_dir}" if key is not None else f"the array store {state_dir}"
    raise _Unreadable(f"{state_dir.parent}: checkpoint unreadable (reading {what}: {type(e).__name__}: "
                      f"{_first_line(e)})") from e


def _first_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return (text[0] if text else "")[:300]
