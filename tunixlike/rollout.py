"""The rollout data contract: the one type sampler, queue and learner share.

Every completion that leaves the sampler carries, per token, the id, the logprob under the
*processed* sampling distribution (after temperature / top-k / top-p) and the policy version
(learner step) whose weights produced it. Nothing downstream re-derives what the sampler knew.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np

FINISH_REASONS = ("eos", "stop", "length", "aborted")


@dataclasses.dataclass
class Completion:
  """One sampled continuation of a prompt. All per-token arrays have length T."""

  token_ids: np.ndarray  # int32 [T]; includes the stop token when finish_reason is eos/stop
  logprobs: np.ndarray  # float32 [T]; log p_behaviour(token) after sampling processing
  policy_versions: np.ndarray  # int32 [T]; learner step whose weights produced each token
  finish_reason: str  # one of FINISH_REASONS
  # 1 where the policy produced the token, 0 for tokens inserted by an environment (multi-turn).
  loss_mask: np.ndarray | None = None  # int32 [T]
  # Vocabulary truncation used for each token ("Keep Sampling Mask"): np.packbits over V.
  sampling_mask: np.ndarray | None = None  # uint8 [T, ceil(V / 8)]
  # MoE experts chosen per token and layer ("Keep Routing"). Row t is the routing of the forward
  # pass that produced token t (like logprobs[t]): the experts of its *input* position, i.e. the
  # last prompt token for t = 0 and token t-1 after that.
  expert_routing: np.ndarray | None = None  # int32 [T, L, k]
  # The prefill's experts for prompt[:-1] (with expert_routing, every position whose K/V the
  # completion attended). Completions sharing a prefill share the array.
  prompt_routing: np.ndarray | None = None  # int32 [P-1, L, k]
  # Process rewards (rewards/process.py): step j ends at token step_ends[j] (inclusive, strictly
  # increasing) and a process reward model scored the prefix token_ids[:step_ends[j] + 1].
  step_rewards: np.ndarray | None = None  # float32 [S]
  step_ends: np.ndarray | None = None  # int32 [S]
  # On-policy distillation (rl/distill.py): log p_teacher(token t | prompt, tokens < t).
  teacher_logprobs: np.ndarray | None = None  # float32 [T]
  text: str | None = None

  def __post_init__(self):
    n = len(self.token_ids)
    for name in ("logprobs", "policy_versions", "loss_mask", "sampling_mask", "expert_routing", "teacher_logprobs"):
      value = getattr(self, name)
      if value is not None and len(value) != n:
        raise ValueError(f"Completion.{name} has length {len(value)}, token_ids has {n}")
    for name in ("expert_routing", "prompt_routing"):
      value = getattr(self, name)
      if value is not None and np.ndim(value) != 3:
        raise ValueError(f"Completion.{name} has shape {np.shape(value)}, expected [tokens, L, k]")
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(f"Completion.finish_reason={self.finish_reason!r}, expected one of {FINISH_REASONS}")

  @property
  def num_tokens(self) -> int:
    return len(self.token_ids)


@dataclasses.dataclass(eq=False)  # identity: the queue drops a group by it (arrays have no truth value)
class RolloutGroup:
  """The G completions of one prompt (a GRPO group), the prompt's dataset columns and rewards."""

  prompt_id: Any  # stable id of the dataset element (used to check no prompt is lost or repeated)
  prompt_token_ids: np.ndarray  # int32 [P]
  completions: list[Completion]
  columns: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"answer": "42"}
  prompt_text: str | None = None
  rewards: np.ndarray | None = None  # float32 [G], filled by the reward stage
  term_rewards: dict[str, np.ndarray] | None = None  # each reward term's own float32 [G] (NaN: skipped), too
  # Filled by the reward stage too (`learner/group_advantages.py`): the rewards after shaping (DAPO's
  # overlong penalty), one advantage per completion, and per-token advantages where configured.
  shaped_rewards: np.ndarray | None = None  # float32 [G]
  advantages: np.ndarray | None = None  # float32 [G]
  token_advantages: list[np.ndarray] | None = None  # G arrays of float32 [T_i]
  reward_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  # The sampler's version when the group was admitted, where its first token may come later (an
  # agent's first request); None: the version of its oldest token.
  start_version: int | None = None
  # The sampler's start order of this group in the run (`RolloutDriver`; None elsewhere): it seeds the
  # group's noise, and a deterministic run takes its batches in this order.
  seq: int | None = None

  @property
  def group_size(self) -> int:
    return len(self.completions)

  @property
  def min_version(self) -> int:
    """Version of the oldest token in the group (what staleness is measured from)."""
    return int(np.concatenate([c.policy_versions for c in self.completions if c.num_tokens]).min())

  @property
  def admitted_version(self) -> int:
    """The version the queue admitted this group at (its staleness bound counts from there)."""
    return self.min_version if self.start_version is None else self.start_version

  @property
  def num_tokens(self) -> int:
    return sum(c.num_tokens for c in self.completions)


def truncated_share(groups) -> float:
  """The share of the groups' completions cut at their token limit (finish reason "length")."""
  reasons = [c.finish_reason for g in groups for c in g.completions]
  return float(np.mean([r == "length" for r in reasons])) if reasons else 0.0


def groups_to_json(groups) -> list:
  """Groups as plain JSON (arrays as base64 of their bytes, bit for bit), for a checkpoint."""
  return [to_json(g) for g in groups]


def groups_from_json(items) -> list[RolloutGroup]:
  return [from_json(item) for item in items]


_TYPES = {"RolloutGroup": RolloutGroup, "Completion": Completion}


def to_json(x):
  """Rollouts and what holds them (lists, dicts, arrays) as plain JSON, arrays bit for bit."""
  if isinstance(x, (np.ndarray, np.generic)):
    a = np.asarray(x)
    return {"__array__": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
  if isinstance(x, (RolloutGroup, Completion)):
    return {"__type__": type(x).__name__, **{f.name: to_json(getattr(x, f.name)) for f in dataclasses.fields(x)}}
  if isinstance(x, dict):
    return {"__dict__": [[k, to_json(v)] for k, v in x.items()]}
  if isinstance(x, (list, tuple)):
    return {"__list__": [to_json(v) for v in x], "tuple": isinstance(x, tuple)}
  return x  # str, int, float, bool, None


def from_json(x):
  if not isinstance(x, dict):
    return x
  if "__array__" in x:
    a = np.frombuffer(base64.b64decode(x["data"]), dtype=np.dtype(x["__array__"])).reshape(x["shape"]).copy()
    return a[()] if not x["shape"] else a
  if "__type__" in x:
    cls = _TYPES[x["__type__"]]
    return cls(**{f.name: from_json(x[f.name]) for f in dataclasses.fields(cls)})
  if "__dict__" in x:
    return {k: from_json(v) for k, v in x["__dict__"]}
  values = [from_json(v) for v in x["__list__"]]
  return tuple(values) if x["tuple"] else values
