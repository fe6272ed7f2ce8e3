"""What goes into a rollout driver and what comes out of it: the prompts it samples
(`PromptRequest`), the groups a checkpoint keeps in flight (`InFlightGroup`), the recorders that watch
its tokens (`Recorder`), its counters (`DriverStats`) and errors. Shared by the driver shell, the
admission loop and every episode strategy."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np

from tunixlike.rollout import Completion, RolloutGroup


@dataclasses.dataclass
class PromptRequest:
  """One prompt to sample G completions of."""

  prompt_id: Any
  token_ids: np.ndarray  # int [P]
  columns: dict[str, Any] = dataclasses.field(default_factory=dict)
  prompt_text: str | None = None
  max_new_tokens: int | None = None  # None = sampler.max_new_tokens
  # Seeds the group's sampling noise instead of its start order (a caller whose requests may
  # arrive in any order, e.g. multi-agent turns, keeps its samples reproducible this way).
  noise_id: int | None = None


@dataclasses.dataclass
class InFlightGroup:
  """A group admitted but not emitted, as a checkpoint keeps it (`RolloutDriver.in_flight`) and a
  resumed driver continues it (`RolloutDriver(resume=...)`): each sample is a finished `Completion`
  or its tokens so far, with their logprobs, versions (and sampling masks), which the resumed driver
  prefills after the prompt and goes on decoding with the same noise (`fold_in(key, n)` for token n)."""

  seq: int
  request: PromptRequest
  prompt_ids: np.ndarray  # int32 [P], after truncation
  keys: np.ndarray  # uint32 [group_size, 2]: the samples' noise keys
  version: int  # the sampler's version when it was admitted
  samples: list[Completion | dict[str, np.ndarray]]  # a dict: tokens, logprobs, versions (, masks)

  @property
  def kept_tokens(self) -> int:
    return sum(s.num_tokens if isinstance(s, Completion) else len(s["tokens"]) for s in self.samples)


class Recorder(Protocol):
  """Work on what a driver decodes, composed into it (`RolloutDriver(recorders=[...])`).

  Called on the sampler thread, so it must not block. `key` = (group start order, sample index)
  names one completion; `tokens` is what it has sampled so far (read, do not keep: it grows).
  """

  def token(self, key: tuple[int, int], prompt_ids: np.ndarray, tokens: Sequence[int],
            request: PromptRequest) -> None:
    """After each sampled token of completion `key`."""

  def completion(self, key: tuple[int, int], prompt_ids: np.ndarray, tokens: Sequence[int],
                 request: PromptRequest) -> None:
    """When completion `key` ends (its last token was passed to `token` first)."""

  def group(self, seq: int, group: RolloutGroup) -> None:
    """Just before the group that started `seq`-th leaves the driver."""


@dataclasses.dataclass
class DriverStats:
  tokens_generated: int = 0  # tokens kept in completions
  live_slot_steps: int = 0  # sum over decode steps of slots holding a live sequence
  total_slot_steps: int = 0  # decode steps x slots
  generate_calls: int = 0
  moves: int = 0  # live sequences moved to another slot (slot groups' plan_insert, a paged cache's compact_slots)
  prefills: int = 0
  completions: int = 0
  groups_emitted: int = 0
  truncated_prompts: int = 0
  param_swaps: int = 0
  prefill_chunks: int = 0  # chunks of long prompts run between generate calls
  preemptions: int = 0  # sequences whose blocks a paged cache took back (each resumed later)
  resumed: int = 0  # preempted (or checkpoint-kept) sequences prefilled again and decoding
  tokens_kept: int = 0  # tokens of sequences continued from a checkpoint (`resume`), not decoded again
  verify_calls: int = 0  # generate calls whose steps verified drafts (sampler.speculative)
  verify_fallbacks: int = 0  # verify calls run as plain ones: the paged pool had no blocks for the drafts
  draft_s: float = 0.0  # the drafter's host work on the sampler thread (lookups, the gate, its bookkeeping)
  drafted_tokens: int = 0  # draft tokens verified
  accepted_tokens: int = 0  # draft tokens accepted (emitted as drafted)
  decoded_tokens: int = 0  # tokens the decode calls emitted (preempted or stop-string tails included)
  drafts: bool = False  # the driver drafts (sampler.speculative): its step metrics include the drafts'
  busy_time_s: float = 0.0  # time in prefill / insert / generate (incl. fetching results)

  @property
  def slot_occupancy(self) -> float:
    return self.live_slot_steps / self.total_slot_steps if self.total_slot_steps else 0.0

  @property
  def tokens_per_decode_step(self) -> float:
    """Tokens per live slot and model forward: 1 for plain decoding, more as drafts are accepted."""
    return self.decoded_tokens / self.live_slot_steps if self.live_slot_steps else 0.0

  @property
  def draft_acceptance(self) -> float:
    return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


class DriverError(RuntimeError):
  pass


class DriverTimeout(DriverError):
  """`run(max_wall_s=...)` ran out of time."""
