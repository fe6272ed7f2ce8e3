"""Run checkpoints over orbax: the learner state (sharded arrays) plus a JSON `meta` dict.

A step directory holds three orbax items:
  state   the train-state pytree (orbax StandardSave: every device writes its own shards)
  meta    what the caller needs to resume besides arrays (policy version, RNG key, data position,
          runtime counters, in-flight prompt ids, the config), as JSON
  layout  how the state was saved ({"format": 1, "frozen_saved": bool})

Saves are asynchronous: `save` returns once the arrays are copied off the devices (so the caller
may donate or overwrite them) and orbax writes them in a background thread. Orbax writes into a
temporary directory and renames it when complete, so an interrupted save is never listed; a step
directory that is listed but lacks an item's metadata (a foreign or damaged directory) is skipped
as well. Restores go straight into the target shardings (each device reads its own slice), after
checking every array's shape against the checkpoint's metadata, so a checkpoint of another model
fails with the parameter path and both shapes rather than an opaque tensorstore error.

`save_frozen=False` leaves out the state's `frozen` subtree: under LoRA with base weights loaded
from a Hugging Face directory, those weights are already on disk and never change; the restore
then takes them from the live state passed as `abstract_state`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger("tunixlike")

FORMAT = 1
CHECKPOINT_SUBDIR = "checkpoints"  # <workdir>/checkpoints: where the trainer writes and export reads
_ITEM_FILES = {"state": "_METADATA", "meta": "metadata", "layout": "metadata"}


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or restored as asked; the message names the directory."""


def workdir_checkpoints(workdir) -> str:
  """The checkpoint directory of a run's workdir."""
  return os.path.join(os.fspath(workdir), CHECKPOINT_SUBDIR)


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


# ---- the checkpointer -------------------------------------------------------------------------------
class Checkpointer:
  """Keeps the last `keep` checkpoints of one run in `directory` (local path or gs://...).

  save_every_steps / save_every_seconds: when `should_save(step)` says yes (0 turns either off).
  read_only: never create or write anything (export); a missing directory then has no steps.
  """

  def __init__(self, directory, *, keep: int = 2, save_every_steps: int = 0, save_every_seconds: float = 0,
               save_frozen: bool = True, read_only: bool = False, clock=time.monotonic):
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
      raise ValueError(f"Checkpointer keep={keep!r} must be an int >= 1")
    if not isinstance(save_every_steps, int) or isinstance(save_every_steps, bool) or save_every_steps < 0:
      raise ValueError(f"Checkpointer save_every_steps={save_every_steps!r} must be an int >= 0")
    if not (isinstance(save_every_seconds, (int, float)) and math.isfinite(save_every_seconds)
            and save_every_seconds >= 0):
      raise ValueError(f"Checkpointer save_every_seconds={save_every_seconds!r} must be a finite number >= 0")
    directory = os.fspath(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self.keep, self.save_frozen, self.read_only = keep, save_frozen, read_only
    self.save_every_steps, self.save_every_seconds = save_every_steps, float(save_every_seconds)
    self._clock = clock  # seconds; tests pass a controlled one
    self._last_save_time = clock()
    self._last_saved_step: int | None = None
    self._manager: ocp.CheckpointManager | None = None
    if read_only and not epath.Path(self.directory).is_dir():
      return  # nothing to read; latest_step() is None
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                           read_only=read_only, create=not read_only,
                                           cleanup_tmp_directories=not read_only)
    # Handlers named up front: a fresh manager can then read any item's metadata before restoring it.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "layout": ocp.JsonCheckpointHandler()}
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

  # ---- saving
  def should_save(self, step: int) -> bool:
    """True when `step` is due by the step or the time interval (and not saved already)."""
    if step <= 0 or (self._last_saved_step is not None and step <= self._last_saved_step):
      return False
    if self.save_every_steps and step % self.save_every_steps == 0:
      return True
    return bool(self.save_every_seconds) and self._clock() - self._last_save_time >= self.save_every_seconds

  def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
    """Starts an asynchronous save of `state` (a pytree of jax.Arrays) and `meta` (JSON) at `step`.

    Returns False without saving when the step is not due (`should_save`, unless force=True) or
    already saved. Returns once the arrays are copied off the devices: the caller may donate them.
    A background write error surfaces at the next `save`, `wait` or `close`.
    """
    if self._manager is None or self.read_only:
      raise CheckpointError(f"{self.directory}: checkpointer is read-only")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise ValueError(f"checkpoint step={step!r} must be an int >= 0")
    if not isinstance(meta, dict):
      raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
    _check_json(meta, "meta")
    if not force and not self.should_save(step):
      return False
    if step in self._manager.all_steps():
      log.info(f"checkpoint: step {step} is already saved in {self.directory}")
      return False
    if not self.save_frozen:
      state = _set_frozen(state, None)
    layout = {"format": FORMAT, "frozen_saved": self.save_frozen}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                              layout=ocp.args.JsonSave(layout))
    try:
      saved = self._manager.save(step, args=args, force=True)
    except Exception as e:
      raise CheckpointError(f"{self.step_dir(step)}: saving failed ({type(e).__name__}: {e})") from e
    self._last_saved_step = step
    self._last_save_time = self._clock()
    return bool(saved)

  def wait(self) -> None:
    """Blocks until the pending save (if any) is on disk."""
    if self._manager is not None:
      try:
        self._manager.wait_until_finished()
      except Exception as e:
        raise CheckpointError(f"{self.directory}: background checkpoint save failed "
                              f"({type(e).__name__}: {e})") from e

  def close(self) -> None:
    """Waits for the pending save and releases orbax's threads."""
    if self._manager is not None:
      try:
        self.wait()
      finally:
        self._manager.close()
        self._manager = None

  # ---- restoring
  def read_meta(self, step: int | None = None) -> dict:
    """The meta dict saved at `step` (default: the newest complete checkpoint)."""
    step = self._resolve(step)
    return self._read_json(step, "meta")

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
    fallback: with step=None, a checkpoint whose files are unreadable (damaged after it was
      finalized) is skipped, with a warning, for the next older one.
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


def _first_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return (text[0] if text else "")[:300]
