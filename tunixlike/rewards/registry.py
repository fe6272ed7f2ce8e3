"""Reward-function registry: the config names reward functions, the trainer looks them up.

Every reward function has the batch interface

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where `columns` holds one list per dataset column (e.g. `answer`) and per rollout field the
trainer provides (e.g. `completion_lengths` in tokens, `finish_reasons`), each of length N.
Functions accept `**_` so that columns they do not use pass through.
"""

from __future__ import annotations

import functools
from typing import Callable

RewardFn = Callable[..., list[float]]
_REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
  """Decorator: `@register("exact_match")` makes the function available as `get("exact_match")`."""

  def decorator(fn: RewardFn) -> RewardFn:
    if name in _REGISTRY and _REGISTRY[name] is not fn:
      raise ValueError(f"reward function {name!r} is already registered ({_REGISTRY[name]})")
    _REGISTRY[name] = fn
    return fn

  return decorator


def get(name: str, **kwargs) -> RewardFn:
  """The reward function called `name`; keyword arguments are bound (e.g. `max_length=512`)."""
  if name not in _REGISTRY:
    raise KeyError(f"unknown reward function {name!r}; registered: {names()}")
  fn = _REGISTRY[name]
  return functools.partial(fn, **kwargs) if kwargs else fn


def names() -> list[str]:
  return sorted(_REGISTRY)


def registered() -> dict[str, RewardFn]:
  return dict(_REGISTRY)
