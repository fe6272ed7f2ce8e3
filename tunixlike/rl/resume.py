"""What a resumed run must agree on with its checkpoint, and the logs cut back to the restored step.

A checkpoint's meta keeps the whole config it was trained with. A restart compares its own config
key by key; any difference outside the resumable keys (model shapes, task and data, algorithm,
optimizer, sampling, seed) would silently train another experiment on the old weights and data
position, so it is refused with the list of what changed. A key is resumable when its field says
so (`setting(..., resumable=True)`, or a section's `RESUMABLE = True`): it only decides how long,
how fast, or how visibly the run goes on.

The data is checked too, by content: each checkpoint keeps a fingerprint of every data source
(`data_fingerprints`), and a restart whose data changed is refused, naming the file and what
changed, unless data.allow_change says it may.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from tunixlike import metrics as metrics_lib, settings
from tunixlike.config import Config
from tunixlike.data import fingerprint as fingerprint_lib, tasks


class IncompatibleResume(ValueError):
  """The workdir's checkpoint was trained with settings this run would change."""


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
  return out


def config_changes(saved: Mapping[str, Any], current) -> list[str]:
  """`key: saved -> current` for every non-resumable key that differs. Keys only one side knows
  (a config of another tunixlike version) are not compared."""
  resumable = set(settings.resumable_keys(Config))
  now = _flat(dataclasses.asdict(current) if dataclasses.is_dataclass(current) else current)
  then = _flat(saved)
  return [f"{k}: {then[k]!r} -> {now[k]!r}" for k in sorted(then.keys() & now.keys())
          if then[k] != now[k] and k not in resumable]


def check_compatible(meta: Mapping[str, Any], cfg, model_cfg: Mapping[str, Any], where: str) -> None:
  """Raises IncompatibleResume naming every changed key (config and model shapes)."""
  changes = config_changes(meta.get("config", {}), cfg)
  changed_keys = {change.split(":")[0] for change in changes}
  saved_model = meta.get("model", {})
  changes += [f"model shape {k}: {saved_model[k]!r} -> {model_cfg[k]!r}"
              for k in sorted(saved_model.keys() & model_cfg.keys())
              if saved_model[k] != model_cfg[k] and f"model.{k}" not in changed_keys]  # named once
  if changes:
    raise IncompatibleResume(
        f"{where} was trained with other settings; resuming would change {'; '.join(changes)}. Use a new --workdir, "
        f"or restore those keys (a resume may change only: {_resumable_summary()})")


def data_fingerprints(task) -> dict[str, dict]:
  """What the run's data holds (`data/fingerprint.py`), by the key that names it: the user's data.train
  and data.eval (files or rows in memory), gsm8k's files. Built-in generated tasks are their config."""
  if isinstance(task, tasks.DatasetTask):
    return {key: fingerprint_lib.fingerprint(source) for key, source in task.data().items()}
  if isinstance(task, tasks.Gsm8kTask):
    paths = [os.path.join(task.directory, f"{split}.jsonl") for split in ("train", "test")]
    return {"data.path": {"files": {p: fingerprint_lib.file_digest(p) for p in paths}}}
  return {}


def data_changes(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
  """`key: what changed` for every data source that differs from the checkpoint's ([] for a
  checkpoint saved without fingerprints)."""
  if saved is None:
    return []
  out = []
  for key in sorted(saved.keys() | now.keys()):
    if key not in now or key not in saved:
      out.append(f"{key} was {'given' if key in saved else 'not given'} and is {'now' if key in now else 'not'}")
      continue
    out += [f"{key}: {change}" for change in fingerprint_lib.changes(saved[key], now[key])]
  return out


def _resumable_summary() -> str:
  """The resumable keys, a section whose every key is resumable by its name."""
  out = []
  for f in dataclasses.fields(Config):
    if getattr(type(f.default), "RESUMABLE", False):
      out.append(f"{f.name}.*")
    else:
      out += [k for k in settings.resumable_keys(Config) if k.startswith(f"{f.name}.")]
  return ", ".join(out)


def cut_logs(directory: str, step: int | None) -> float:
  """Cuts metrics.jsonl and prompts.jsonl back to what checkpoint `step` holds (None: no checkpoint,
  nothing is kept); returns the wall-clock time (time_s) the run had reached, so time continues.

  Kept: every record of a step < `step` (those trained batches are in the checkpoint), and the
  non-training records of `step` itself (warm start, evals), which are written before that step's
  checkpoint is saved.
  """
  metrics_path = os.path.join(directory, "metrics.jsonl")
  below = -1 if step is None else step
  metrics_lib.truncate_jsonl(metrics_path, below, keep=lambda r: r["step"] == step and "loss" not in r)
  metrics_lib.truncate_jsonl(os.path.join(directory, "prompts.jsonl"), below)
  metrics_lib.truncate_jsonl(os.path.join(directory, "completions.jsonl"), below)
  return metrics_lib.last_time_s(metrics_path)
