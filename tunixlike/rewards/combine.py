"""A weighted sum of reward functions, each run safely, with per-function metrics."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tunixlike.rewards import loader, registry
from tunixlike.rewards.safe import SafeReward

# Scores past float32's range saturate rather than turn into inf; algo.reward_clip then clips them (counted).
_F32_MAX = float(np.finfo(np.float32).max)


def _saturated(x_n: np.ndarray) -> np.ndarray:
  return np.clip(x_n, -_F32_MAX, _F32_MAX)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """One term of the reward: `weight * fn(...)`, with `kwargs` bound.

  `fn`: a registered name (`exact_match`), an import path (`package.module:function`), a file
  (`/path/rewards.py:function`) or a callable. `name` (its metric name) defaults to the registered
  or function name.
  """

  fn: str | Callable
  weight: float = 1.0
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  name: str | None = None

  def __post_init__(self):
    if not (callable(self.fn) or isinstance(self.fn, str)):
      raise ValueError(f"RewardSpec.fn={self.fn!r}: a registered name, an import path or a callable")
    if not isinstance(self.weight, (int, float)) or not np.isfinite(self.weight):
      raise ValueError(f"RewardSpec({self.fn!r}).weight={self.weight!r} must be a finite number")


class CombinedReward:
  """`__call__(prompts, completions, **columns) -> (rewards float32 [N], metrics)`.

  No finite input overflows: each score is saturated to float32's range, so is each weighted term
  (weight * score, in float64, may pass it: +-inf saturates too, never NaN), and the float64 sum of the
  terms is saturated again; algo.reward_clip then clips the total.

  metrics: `rewards/<name>` (mean unweighted score over the samples it scored, saturated),
  `rewards/<name>/failures` (samples that scored 0 by failure in this call), `rewards/<name>/skipped`
  (samples it returned None for: they get no term from it) and `rewards/total` (mean weighted sum).
  `timeout_s`: each call's limit (a run passes `rl.reward_timeout_s`); `where` names the specs in errors (the
  config key, `rewards`); `columns`, when known, are the dataset's columns each function's parameters are checked
  against before any call.
  """

  def __init__(self, specs: Sequence[RewardSpec | str | tuple | Callable | Mapping], *, timeout_s: float,
               where: str = "rewards", columns: Iterable[str] | None = None):
    if not specs:
      raise ValueError("CombinedReward needs at least one reward function")
    self.specs, self.fns = [], []
    for i, s in enumerate(specs):
      key = f"{where}[{i}]"
      try:
        spec = _as_spec(s)
      except (TypeError, ValueError) as e:
        raise loader.LoadError(f"{key}: {e}") from None
      fn = loader.load(spec.fn, key=f"{key}.fn", registry=registry.registered())
      name = spec.name or loader.name_of(fn, spec.fn)
      self.specs.append(dataclasses.replace(spec, name=name))
      call = loader.batch_reward(fn, key=f"{key}.fn", bound=dict(spec.kwargs), columns=columns)
      self.fns.append(SafeReward(call, name=name, timeout_s=timeout_s))
    names = [s.name for s in self.specs]
    if len(set(names)) != len(names):
      raise ValueError(f"{where}: reward names repeat: {names} (give one a name=)")
    self.where = where

  def check_counts(self, rows: Sequence[Mapping[str, Any]], prompts: Sequence[str]) -> None:
    """Calls each function once on dataset `rows` with empty completions: one that returns the wrong
    number of scores is a bug reported now (LoadError naming its key), not a 0 at every step. A call
    that raises or is slow proves nothing here and is let go."""
    n = len(rows)
    columns = {k: [r.get(k) for r in rows] for k in rows[0]}
    batch = dict(columns, completion_lengths=[0] * n, finish_reasons=["eos"] * n,
                 prompt_ids=[r.get("id", i) for i, r in enumerate(rows)])
    for i, (spec, fn) in enumerate(zip(self.specs, self.fns)):
      count = fn.count_of(list(prompts), [""] * n, **batch)
      if isinstance(count, str):
        raise loader.LoadError(f"{self.where}[{i}].fn: {spec.name} returned {count} instead of a list of {n} "
                               "scores: return one float (or None) per completion")
      if count is not None and count != n:
        raise loader.LoadError(f"{self.where}[{i}].fn: {spec.name} returned {count} scores for {n} completions: "
                               "return one float (or None) per completion")

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> tuple[np.ndarray,
                                                                                             dict[str, float]]:
    total_n, _, metrics = self.score(prompts, completions, **columns)
    return total_n, metrics

  def score(self, prompts: Sequence[str], completions: Sequence[str], **columns
            ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
    """(weighted total [N], each term's own scores [N] by name, NaN where skipped, metrics)."""
    if len(prompts) != len(completions):
      raise ValueError(f"CombinedReward: {len(prompts)} prompts for {len(completions)} completions")
    total_n = np.zeros(len(completions), np.float64)  # float32 would overflow a sum of huge finite scores
    terms: dict[str, np.ndarray] = {}
    metrics: dict[str, float] = {}
    for spec, fn in zip(self.specs, self.fns):
      scores, failed = fn(prompts, completions, **columns)
      scored_n = np.array([s is not None for s in scores], bool)
      scores_n = _saturated(np.array([0.0 if s is None else s for s in scores], np.float64))
      with np.errstate(over="ignore"):  # weight 10 * score 1e38 is inf in float32, 1e39 here: saturated below
        total_n += _saturated(spec.weight * scores_n)
      terms[spec.name] = np.where(scored_n, scores_n, np.nan).astype(np.float32)
      metrics[f"rewards/{spec.name}"] = float(scores_n[scored_n].mean()) if scored_n.any() else 0.0
      metrics[f"rewards/{spec.name}/failures"] = float(failed)
      metrics[f"rewards/{spec.name}/skipped"] = float((~scored_n).sum())
    total_n = _saturated(total_n)
    metrics["rewards/total"] = float(total_n.mean()) if len(total_n) else 0.0
    return total_n.astype(np.float32), terms, metrics


def _as_spec(spec) -> RewardSpec:
  """Accepts a RewardSpec, a name or callable, (fn, weight[, kwargs]) or {fn, weight, kwargs, name}."""
  if isinstance(spec, RewardSpec):
    return spec
  if isinstance(spec, str) or callable(spec):
    return RewardSpec(spec)
  if isinstance(spec, tuple) and 1 <= len(spec) <= 3:
    return RewardSpec(*spec)
  if isinstance(spec, Mapping):
    unknown = sorted(set(spec) - {"fn", "weight", "kwargs", "name"})
    if unknown or "fn" not in spec:
      raise ValueError(f"{dict(spec)!r}: a reward is {{fn, weight, kwargs, name}} with fn required"
                       + (f" (unknown {unknown})" if unknown else ""))
    return RewardSpec(spec["fn"], spec.get("weight", 1.0), dict(spec.get("kwargs") or {}), spec.get("name"))
  raise ValueError(f"cannot read reward spec {spec!r}; use a name, a callable, (fn, weight[, kwargs]) or "
                   "{fn, weight, kwargs}")
