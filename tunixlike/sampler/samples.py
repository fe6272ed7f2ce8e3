"""A single-turn group and its samples as they decode (`single_turn.SingleTurn`; checkpoints keep
them: `kept`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tunixlike.rollout import Completion
from tunixlike.sampler.driver_api import PromptRequest


@dataclasses.dataclass
class Group:
  seq: int  # start order: seeds the group's sampling noise
  request: PromptRequest
  prompt_ids: np.ndarray  # after truncation
  completions: list[Completion | None]
  started: int = 0  # samples inserted so far
  keys: np.ndarray | None = None  # [group_size, 2] noise keys of its samples (made when first inserted)
  version: int = 0  # the sampler's version when it was admitted
  resumed_at: int | None = None  # a group continued from a checkpoint: the version the driver resumed at


@dataclasses.dataclass
class Sample:
  """A slot's occupant: one sample of a group, decoding."""

  group: Group
  index: int  # sample index within the group
  max_new: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  masks: list[np.ndarray] = dataclasses.field(default_factory=list)
  # Keep Routing: experts of each token's forward ([L, k] per token) and the prefill's for the prompt.
  routing: list[np.ndarray] = dataclasses.field(default_factory=list)
  # The prefix this slot was filled from: its prefill's routing (device int32 [rows, bucket, L, k]) and row.
  prompt_routing: tuple[Any, int] | None = None
  kept: int = 0  # tokens it came back with from a checkpoint (`InFlightGroup`), not decoded by this run
