"""Metrics to the console (a progress bar per stage and readable lines), WORKDIR/metrics.jsonl,
TensorBoard, optionally Weights & Biases, and a PNG plot of reward and eval accuracy against time
written at the end.

Every log file is written on the caller's thread, so a failed write (a full disk) raises
`LogWriteError` from `MetricsLogger.write` / `close` instead of dying unseen in a background thread.
JSONL logs survive a crash mid-write: `read_jsonl` drops a torn last line, `truncate_jsonl` cuts a log
back to a restored step, and `last_time_s` gives the wall clock to continue from.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
import uuid
from typing import Any, Callable, Mapping

import numpy as np

_log = logging.getLogger(__name__)

# Shown on the progress bar, in this order, as (metric, label): the last value of each seen in the
# stage, so held-out accuracy stays on the bar between evals.
CONSOLE_KEYS = (("reward/mean", "reward"), ("accuracy", "train_acc"), ("eval/accuracy", "held_out"),
                ("frac_reward_zero_std", "no_signal"), ("loss", "loss"), ("kl", "kl"),
                ("sampler/tokens_per_s", "tok/s"), ("sync/ms", "sync_ms"))


class LogWriteError(OSError):
  """A log file or directory could not be written; the message names it and the OS error."""

  def __init__(self, message: str, errno: int | None = None):
    super().__init__(message)
    self.errno = errno  # str() stays the message: strerror is unset


def _write_error(failures: list[tuple[str, str, OSError]]) -> LogWriteError:
  """One error for the (path, writer, OS error) failures, e.g. both logs of a full disk."""
  error = LogWriteError("; ".join(f"{path}: {what} failed: {e}" for path, what, e in failures),
                        failures[0][2].errno)
  error.__cause__ = failures[0][2]
  return error


def _plain(value: Any) -> Any:
  """`value` as JSON: numpy as Python numbers and lists, NaN / inf (no value, e.g. a loss before the
  first step) as None."""
  if isinstance(value, (np.generic, np.ndarray)):
    value = value.item() if np.ndim(value) == 0 else value.tolist()
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return None  # JSON has no NaN / inf; null is its missing number (pandas reads NaN), not a string
  return value


def _is_scalar(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


class _JsonlWriter:
  """Appends one flushed line per record, so a reader (or a resumed run) sees every finished step."""

  what = "metrics writer"

  def __init__(self, path: str):
    self.path = path
    self._file = None

  def write(self, step: int, record: dict[str, Any]):
    del step
    line = json.dumps(record) + "\n"
    if self._file is None:  # opened late: the caller may still cut the file back (truncate_jsonl)
      _end_cleanly(self.path)
      self._file = open(self.path, "a", encoding="utf-8")
    self._file.write(line)
    self._file.flush()

  def close(self):
    if self._file is not None:
      self._file.close()


class _TensorBoardWriter:
  """Scalars as TensorBoard events, written on the calling thread.

  tensorboardX's SummaryWriter hands events to a writer thread through a bounded queue: when that
  thread dies (ENOSPC) nobody is told and the next `put` blocks forever. Its `EventsWriter` (the part
  that thread calls) is used here directly, so a failed write raises to the caller.
  """

  what = "TensorBoard writer"
  flush_secs = 10.0  # the OS buffers in between; a flush also fsyncs

  def __init__(self, logdir: str):
    from tensorboardX.event_file_writer import EventsWriter
    self.path = logdir
    os.makedirs(logdir, exist_ok=True)
    self._events = EventsWriter(os.path.join(logdir, "events"))
    self._next_flush = 0.0  # the first step is flushed at once, as tensorboardX does

  def write(self, step: int, record: dict[str, Any]):
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    # One event holding every scalar of the step: an event per scalar cost the step's thread ~1 ms.
    values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in record.items()
              if key != "step" and _is_scalar(value)]
    if values:
      self._events.write_event(Event(wall_time=time.time(), step=int(step), summary=Summary(value=values)))
    if time.monotonic() >= self._next_flush:
      self._events.flush()
      self._next_flush = time.monotonic() + self.flush_secs

  def write_text(self, step: int, tag: str, text: str):
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.summary import text as text_summary
    self._events.write_event(Event(wall_time=time.time(), step=int(step), summary=text_summary(tag, text)))

  def close(self):
    self._events.close()


class _WandbWriter:
  """Scalars to a Weights & Biases run kept in WORKDIR/wandb (`WANDB_MODE=offline`: only there).

  The W&B run follows metrics.jsonl: a logger that continues a non-empty metrics.jsonl (a resumed
  run) resumes the W&B run whose id is kept in WORKDIR/wandb/run_id; an empty one starts a new run.
  W&B accepts only increasing steps: steps redone after a resume are dropped there (with a warning),
  while metrics.jsonl is cut back and rewritten.
  """

  what = "W&B writer"

  def __init__(self, workdir: str, *, project: str, config: Mapping[str, Any] | None, resume: bool):
    try:
      import wandb
    except ImportError as e:
      raise ImportError("log.wandb=True needs the wandb package: pip install wandb") from e
    id_path = os.path.join(workdir, "wandb", "run_id")
    run_id = open(id_path, encoding="utf-8").read().strip() if resume and os.path.exists(id_path) else None
    if run_id is None:
      run_id = uuid.uuid4().hex[:12]
      os.makedirs(os.path.dirname(id_path), exist_ok=True)
      with open(id_path, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    self._run = wandb.init(project=project, dir=workdir, id=run_id, resume="allow",
                           config=dict(config) if config is not None else None)
    self.path = self._run.settings.sync_dir  # the local copy of the run (online runs also print their URL)

  def write(self, step: int, record: dict[str, Any]):
    self._run.log({k: v for k, v in record.items() if k != "step" and _is_scalar(v)}, step=int(step))

  def write_table(self, step: int, name: str, rows: list[dict[str, Any]]):
    import wandb
    columns = sorted({k for r in rows for k in r})
    data = [[json.dumps(r[k]) if isinstance(r.get(k), (dict, list)) else r.get(k) for k in columns] for r in rows]
    self._run.log({name: wandb.Table(columns=columns, data=data)}, step=int(step))

  def close(self):
    self._run.finish()


def _abandon(writer):
  """Releases a writer that failed; its buffered data cannot be written either."""
  try:
    writer.close()
  except OSError:
    pass


class MetricsLogger:
  """One record per call of `write(step, metrics)`; `time_s` counts from the logger's creation.

  Appends to an existing metrics.jsonl, so a resumed run continues the same file (opened at the first
  write). A log that fails to write raises `LogWriteError` once and is dropped: the other logs go on.
  `outputs` names where the logs go: "metrics", and "tensorboard" / "wandb" when they are on.
  A NaN / inf metric (no value yet) is null in metrics.jsonl and left out of TensorBoard and W&B.
  The console shows one progress bar per stage (`progress`), none before the first stage starts.
  """

  def __init__(self, workdir: str, *, tensorboard: bool, progress_bar: bool, wandb: bool, wandb_project: str,
               time_offset_s: float = 0.0, config: Mapping[str, Any] | None = None):
    try:
      os.makedirs(workdir, exist_ok=True)
    except OSError as e:
      raise _write_error([(workdir, "metrics logger", e)]) from e
    self.workdir = workdir
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._session_start = time.monotonic()
    self._start = self._session_start - time_offset_s
    resume = os.path.exists(self.path) and os.path.getsize(self.path) > 0  # before the first write
    self._writers: list = [_JsonlWriter(self.path)]
    self.outputs = {"metrics": self.path}
    if tensorboard:
      logdir = os.path.join(workdir, "tensorboard")
      try:
        self._writers.append(_TensorBoardWriter(logdir))
      except OSError as e:
        raise _write_error([(logdir, _TensorBoardWriter.what, e)]) from e
      self.outputs["tensorboard"] = logdir
    if wandb:
      self._writers.append(_WandbWriter(workdir, project=wandb_project, config=config, resume=resume))
      self.outputs["wandb"] = self._writers[-1].path
    self._completions = _JsonlWriter(os.path.join(workdir, "completions.jsonl"))
    self._progress_bar = progress_bar
    self._bar = None
    self._shown: dict[str, float] = {}

  @property
  def elapsed_s(self) -> float:
    """The run's wall clock: this session's time plus the earlier sessions' of a resumed run."""
    return time.monotonic() - self._start

  @property
  def session_s(self) -> float:
    """This process's time since the logger was made (a resumed run's own session)."""
    return time.monotonic() - self._session_start

  def progress(self, desc: str, total: int, initial: int = 0):
    """Shows the progress bar of a stage (closing the one before); `write` advances it by a step and
    `info` lines print above it. Nothing is shown without `progress_bar`."""
    self.end_progress()
    self._shown = {}
    if self._progress_bar:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

  def progress_to(self, done: int):
    """Moves the stage's bar to `done` steps (for a stage that writes no record per step)."""
    if self._bar is not None and done != self._bar.n:
      self._bar.update(done - self._bar.n)

  def end_progress(self):
    if self._bar is not None:
      bar, self._bar = self._bar, None
      bar.close()

  def write(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> dict[str, Any]:
    """Logs one record; raises LogWriteError when a log could not be written."""
    record = {"step": int(step), "time_s": round(self.elapsed_s, 3)}
    record.update({k: _plain(v) for k, v in metrics.items()})
    self._each(lambda w: w.write(step, record))
    if self._bar is not None and advance:
      self._bar.update(1)
    self.show(record)
    return record

  def write_completions(self, step: int, rows: list[dict[str, Any]], markdown: str):
    """Appends sampled completions (`rl.completions_log`) to WORKDIR/completions.jsonl, and shows them
    as a text summary (`markdown`) in TensorBoard and a table in W&B when those are on."""
    try:
      for row in rows:
        self._completions.write(step, row)
    except OSError as e:
      raise _write_error([(self._completions.path, "completions log", e)]) from e
    self._each(lambda w: w.write_text(step, "completions", markdown) if hasattr(w, "write_text") else None)
    self._each(lambda w: w.write_table(step, "completions", rows) if hasattr(w, "write_table") else None)

  def show(self, metrics: Mapping[str, Any]):
    """Puts the CONSOLE_KEYS among `metrics` on the progress bar (kept until the stage ends)."""
    self._shown.update({k: metrics[k] for k, _ in CONSOLE_KEYS if _is_scalar(metrics.get(k))})
    if self._bar is not None:
      self._bar.set_postfix({label: f"{self._shown[k]:.3g}" for k, label in CONSOLE_KEYS if k in self._shown},
                            refresh=True)

  def _each(self, call: Callable[[Any], None], *, closing: bool = False):
    """`call(writer)` for every live writer; the ones that fail are dropped, not retried each step."""
    failures = []
    for writer in list(self._writers):
      try:
        call(writer)
      except OSError as e:
        self._writers.remove(writer)
        _abandon(writer)
        failures.append((writer.path, writer.what, e))
    if closing:
      self._writers = []
    if failures:
      raise _write_error(failures)

  def info(self, message: str):
    """A readable line that does not tear the progress bar."""
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def close(self):
    """Flushes and closes every log (also after a failure); raises LogWriteError if one failed now."""
    self.end_progress()
    self._completions.close()
    self._each(lambda w: w.close(), closing=True)


def _parse(line: bytes) -> dict[str, Any] | None:
  """The record of a line, or None when it is not a JSON object (torn or corrupt)."""
  try:
    record = json.loads(line)
  except ValueError:  # also a multi-byte character cut in half
    return None
  return record if isinstance(record, dict) else None


def _lines(path: str) -> tuple[list[tuple[bytes, dict[str, Any]]], bool]:
  """(line, record) of each record of a JSONL log, and whether a torn last line was dropped.

  Only the last non-blank line can be torn by a crash mid-write; a bad line before it is corruption.
  """
  with open(path, "rb") as f:
    raw = f.read().split(b"\n")
  numbers = [i for i, line in enumerate(raw) if line.strip()]
  out = []
  for i in numbers:
    record = _parse(raw[i])
    if record is not None:
      out.append((raw[i], record))
    elif i == numbers[-1]:
      _log.warning("%s: dropped a torn last line %d (%d bytes; a crash mid-write)", path, i + 1, len(raw[i]))
      return out, True
    else:
      raise ValueError(f"{path}: line {i + 1} is not a JSON record: {raw[i][:80]!r}; the file is corrupt")
  return out, False


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The records of a JSONL log; a torn last line is dropped with a warning, a bad line before it raises."""
  return [record for _, record in _lines(path)[0]]


def truncate_jsonl(path: str, below_step: int, *, key: str = "step",
                   keep: Callable[[dict[str, Any]], bool] | None = None) -> int:
  """Cuts a JSONL log back to the records with `record[key] < below_step` (or `keep(record)`), e.g.
  to the step a resumed run restarts from. Returns the number of records dropped (a torn last line,
  dropped with a warning, is not one). The file is replaced atomically; a missing file is left alone.
  """
  if not os.path.exists(path):
    return 0
  lines, torn = _lines(path)
  for number, (_, record) in enumerate(lines, 1):
    if not _is_scalar(record.get(key)):
      raise ValueError(f"{path}: record {number} has no numeric {key!r}: {record}")
  kept = [line for line, record in lines if record[key] < below_step or (keep is not None and keep(record))]
  if torn or len(kept) < len(lines):
    _replace(path, b"".join(line + b"\n" for line in kept))
  return len(lines) - len(kept)


def _replace(path: str, data: bytes):
  """Writes `data` to `path` atomically: a crash leaves the old file or the new one, never half of it."""
  directory = os.path.dirname(os.path.abspath(path))
  mode = os.stat(path).st_mode & 0o777
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}-", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, mode)  # mkstemp makes it private
    os.replace(tmp, path)
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise _write_error([(path, "log rewrite", e)]) from e


def _end_cleanly(path: str):
  """Before appending to an existing log: a torn last line is cut (with a warning), so the next record
  starts a line of its own instead of merging into a line the readers would reject as corrupt."""
  try:
    f = open(path, "r+b")
  except FileNotFoundError:
    return
  with f:
    start = size = f.seek(0, os.SEEK_END)
    tail = b""
    while start > 0 and b"\n" not in tail:  # back to the last newline
      start -= min(start, 1 << 16)
      f.seek(start)
      tail = f.read(size - start)
    if not tail or tail.endswith(b"\n"):
      return
    last = tail[tail.rfind(b"\n") + 1:]
    f.seek(0, os.SEEK_END)
    if not last.strip() or _parse(last) is not None:
      f.write(b"\n")  # a whole record that only lacks its newline
    else:
      _log.warning("%s: cut a torn last line (%d bytes; a crash mid-write) before appending", path, len(last))
      f.truncate(size - len(last))


def last_time_s(path: str) -> float:
  """`time_s` of the last record of a metrics log that has one (0.0 if none, or no file): the
  `time_offset_s` of a resumed run's MetricsLogger, so its wall clock goes on from there."""
  if not os.path.exists(path):
    return 0.0
  times = [r["time_s"] for r in read_jsonl(path) if _is_scalar(r.get("time_s"))]
  return float(times[-1]) if times else 0.0


def plot(metrics_path: str, out_path: str) -> str:
  """PNG of reward mean and eval accuracy against wall-clock time."""
  # A Figure with its own Agg canvas: no pyplot state, so a notebook's backend is left alone.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_jsonl(metrics_path)
  fig = Figure(figsize=(7, 4))
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  train = [(r["time_s"], r["reward/mean"]) for r in records if _is_scalar(r.get("reward/mean"))]  # null: no value
  evals = [(r["time_s"], r["eval/accuracy"]) for r in records if _is_scalar(r.get("eval/accuracy"))]
  if train:
    ax.plot(*zip(*train), label="train reward (mean)", color="tab:blue", alpha=0.8)
  if evals:
    ax.plot(*zip(*evals), "o-", label="held-out accuracy", color="tab:red")
  ax.set_xlabel("wall-clock time (s)")
  ax.set_ylabel("reward / accuracy")
  ax.set_ylim(-0.05, 1.05)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  ax.set_title(os.path.basename(os.path.dirname(os.path.abspath(metrics_path))) or "run")
  fig.tight_layout()
  fig.savefig(out_path, dpi=110)
  return out_path
