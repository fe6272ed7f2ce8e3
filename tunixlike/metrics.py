"""Metrics to the console (a progress bar and readable lines), WORKDIR/metrics.jsonl, TensorBoard, and
a PNG plot of reward and eval accuracy against time written at the end."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping

import numpy as np

# Shown on the progress bar and in console lines, in this order, when present.
CONSOLE_KEYS = ("reward/mean", "accuracy", "eval/accuracy", "loss", "kl", "staleness/max",
                "sampler/tokens_per_s", "sync/ms")


def _plain(value: Any) -> Any:
  if isinstance(value, (np.generic, np.ndarray)):
    value = value.item() if np.ndim(value) == 0 else value.tolist()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no NaN / inf
  return value


class MetricsLogger:
  """One record per call of `write(step, metrics)`; `time_s` counts from the logger's creation.

  Appends to an existing metrics.jsonl, so a resumed run continues the same file.
  """

  def __init__(self, workdir: str, *, total_steps: int, tensorboard: bool = True,
               progress_bar: bool = True, initial_step: int = 0, time_offset_s: float = 0.0):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a", encoding="utf-8")
    self._start = time.monotonic() - time_offset_s
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    self._bar = None
    if progress_bar:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total_steps, initial=initial_step, desc="rl", unit="step", dynamic_ncols=True)

  @property
  def elapsed_s(self) -> float:
    return time.monotonic() - self._start

  def write(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> dict[str, Any]:
    record = {"step": int(step), "time_s": round(self.elapsed_s, 3)}
    record.update({k: _plain(v) for k, v in metrics.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, step)
    shown = {k.split("/")[-1] if k != "eval/accuracy" else "eval_acc": record[k]
             for k in CONSOLE_KEYS if isinstance(record.get(k), (int, float))}
    if self._bar is not None:
      if advance:
        self._bar.update(1)
      self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=True)
    return record

  def info(self, message: str):
    """A readable line that does not tear the progress bar."""
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def close(self):
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    self._file.close()


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot(metrics_path: str, out_path: str) -> str:
  """PNG of reward mean and eval accuracy against wall-clock time."""
  # A Figure with its own Agg canvas: no pyplot state, so a notebook's backend is left alone.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_jsonl(metrics_path)
  fig = Figure(figsize=(7, 4))
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  train = [(r["time_s"], r["reward/mean"]) for r in records if "reward/mean" in r]
  evals = [(r["time_s"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
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
