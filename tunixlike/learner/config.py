"""Typed, validated settings of the learner (mapped by the trainer from configs/base.py)."""

from __future__ import annotations

import dataclasses

from tunixlike.learner import advantages, is_correction, kl, losses


def _bad(field: str, value, why: str):
  raise ValueError(f"{field}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The RL objective. eps_low / eps_high / aggregation = None take the loss's paper default."""

  advantage: str = "grpo"  # grpo | dr_grpo | rloo
  loss: str = "ppo_clip"  # ppo_clip | dapo | gspo
  aggregation: str | None = None  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  eps_low: float | None = None
  eps_high: float | None = None
  norm_length: int = 0  # constant L of seq_mean_token_sum_norm (Dr. GRPO: the max completion length)
  kl_coef: float = 0.0  # 0 skips the reference forward pass
  kl_estimator: str = "k3"  # k1 | k2 | k3
  decoupled: bool = True  # trust region around the learner's proximal policy (False: around behaviour)
  is_mode: str = "tis"  # none | tis | mis (behaviour -> proximal correction, decoupled only)
  is_level: str = "token"  # token | sequence
  is_cap: float = 2.0  # tis cap
  is_low: float = 0.5  # mis band
  is_high: float = 2.0
  # "Keep Sampling Mask": score tokens under the sampler's recorded top-k / top-p kept set, so the
  # behaviour and learner distributions have the same support (batch needs 'sampling_mask').
  keep_sampling_mask: bool = False
  # "Keep Routing" (MoE): force the experts the sampler recorded in every MoE layer (batch needs
  # 'routing'), so a router that would flip its top-k cannot change which experts run.
  keep_routing: bool = False
  # The sampler's temperature: learner logprobs are log softmax(logits / T), the distribution the
  # behaviour logprobs were taken under.
  sampling_temperature: float = 1.0

  def __post_init__(self):
    advantages.get_advantage_fn(self.advantage)
    losses.get_policy_loss(self.loss)
    losses.check_aggregation(self.resolved_aggregation)
    kl.get_kl_fn(self.kl_estimator)
    if self.is_mode not in is_correction.IS_MODES:
      _bad("algo.is_mode", self.is_mode, f"choose one of {is_correction.IS_MODES}")
    if self.is_level not in is_correction.IS_LEVELS:
      _bad("algo.is_level", self.is_level, f"choose one of {is_correction.IS_LEVELS}")
    if not 0 <= self.eps_low_value < 1:
      _bad("algo.eps_low", self.eps_low, "must be in [0, 1)")
    if not self.eps_high_value >= 0:
      _bad("algo.eps_high", self.eps_high, "must be >= 0")
    if self.kl_coef < 0:
      _bad("algo.kl_coef", self.kl_coef, "must be >= 0")
    if self.is_cap <= 0:
      _bad("algo.is_cap", self.is_cap, "must be > 0")
    if not 0 <= self.is_low < self.is_high:
      _bad("algo.is_low", self.is_low, f"must be in [0, algo.is_high={self.is_high})")
    if self.resolved_aggregation == "seq_mean_token_sum_norm" and self.norm_length <= 0:
      _bad("algo.norm_length", self.norm_length, "seq_mean_token_sum_norm needs a positive constant length")
    if not isinstance(self.keep_sampling_mask, bool):
      _bad("algo.keep_sampling_mask", self.keep_sampling_mask, "must be a bool")
    if not isinstance(self.keep_routing, bool):
      _bad("algo.keep_routing", self.keep_routing, "must be a bool")
    if not (isinstance(self.sampling_temperature, (int, float)) and 0 < self.sampling_temperature < float("inf")):
      _bad("AlgoConfig.sampling_temperature", self.sampling_temperature,
           "must be a finite number > 0 (a greedy sampler has no distribution to train on)")
    if not self.decoupled and self.is_mode != "none":
      _bad("algo.is_mode", self.is_mode,
           "needs algo.decoupled=True (the IS weight corrects behaviour -> proximal); use 'none'")

  @property
  def eps_low_value(self) -> float:
    return losses.get_policy_loss(self.loss).eps_low if self.eps_low is None else float(self.eps_low)

  @property
  def eps_high_value(self) -> float:
    return losses.get_policy_loss(self.loss).eps_high if self.eps_high is None else float(self.eps_high)

  @property
  def resolved_aggregation(self) -> str:
    return self.aggregation or losses.get_policy_loss(self.loss).aggregation


SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 5e-4
  warmup_steps: int = 0
  schedule: str = "constant"  # constant | cosine (decays to 0 at total_steps)
  total_steps: int = 0  # needed by cosine
  grad_clip: float = 1.0  # global-norm clip; 0 = off
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  eps: float = 1e-8
  micro_batches: int = 1  # exact token-weighted gradient accumulation
  # Rows sorted by length; each micro-batch runs at the shortest of N prefix lengths (T * k / N)
  # that holds its rows, so a long tail pads one micro-batch, not all of them. 0 = off.
  group_by_length: int = 0

  def __post_init__(self):
    if not self.learning_rate > 0:
      _bad("optim.learning_rate", self.learning_rate, "must be > 0")
    if self.schedule not in SCHEDULES:
      _bad("optim.schedule", self.schedule, f"choose one of {SCHEDULES}")
    if self.warmup_steps < 0:
      _bad("optim.warmup_steps", self.warmup_steps, "must be >= 0")
    if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
      _bad("rl.num_steps", self.total_steps, f"the cosine schedule needs more than optim.warmup_steps={self.warmup_steps}")
    if self.grad_clip < 0 or self.weight_decay < 0:
      _bad("optim.grad_clip" if self.grad_clip < 0 else "optim.weight_decay",
           min(self.grad_clip, self.weight_decay), "must be >= 0")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        _bad(f"optim.{name}", getattr(self, name), "must be in [0, 1)")
    if not isinstance(self.micro_batches, int) or self.micro_batches <= 0:
      _bad("optim.micro_batches", self.micro_batches, "must be a positive int")
    if not isinstance(self.group_by_length, int) or self.group_by_length < 0:
      _bad("optim.group_by_length", self.group_by_length, "must be an int >= 0 (0 = off)")
    if self.group_by_length and self.micro_batches < 2:
      _bad("optim.group_by_length", self.group_by_length,
           f"needs optim.micro_batches >= 2 to group rows into (got {self.micro_batches})")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  algo: AlgoConfig = AlgoConfig()
  optim: OptimConfig = OptimConfig()
  logprob_chunk_size: int = 128  # positions unembedded at once: bounds the [B, C, V] logits
  batch_axis: str = "fsdp"  # learner mesh axis the batch rows are split over

  def __post_init__(self):
    if not isinstance(self.algo, AlgoConfig):
      _bad("LearnerConfig.algo", self.algo, "must be an AlgoConfig")
    if not isinstance(self.optim, OptimConfig):
      _bad("LearnerConfig.optim", self.optim, "must be an OptimConfig")
    if self.logprob_chunk_size <= 0:
      _bad("LearnerConfig.logprob_chunk_size", self.logprob_chunk_size, "must be > 0")
