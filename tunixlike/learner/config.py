"""The `algo` and `optim` sections of the config, and LearnerConfig, what the learner is built from."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from tunixlike.learner import advantages, is_correction, kl, losses
from tunixlike.settings import (ConfigError, check_fields, in_range, non_negative, one_of, optional, positive,
                                positive_int, require, run_value, setting)

ESTIMATORS = ("grpo_family", "ppo")
PPO_LOSSES = ("ppo_clip", "dapo")  # gspo's ratio is per sequence: it cannot take per-token advantages
# learner.offload's components: name -> (TrainState field, first key inside it or None for the whole field)
OFFLOAD_COMPONENTS = {"reference": ("ref_params", None), "optimizer": ("opt_state", None),
                      "critic": ("params", "critic")}


def _registered(lookup, value):
  """A registry lookup whose ValueError already names the key and the choices."""
  try:
    lookup(value)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _bool(v) -> str | None:
  return None if isinstance(v, bool) else "must be a bool"


# algo.reward_clip's widest bounds: the squares of rewards of this size (PPO's value loss, the gradient norm)
# summed over ten million tokens stay inside float32 (3.4e38), and so do their products and sums.
REWARD_CLIP_LIMIT = 1e15


def _finite_range(v) -> str | None:
  ok = (isinstance(v, (tuple, list)) and len(v) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v))
  if not (ok and v[0] < v[1]):
    return "must be two finite numbers [low, high] with low < high"
  if max(abs(v[0]), abs(v[1])) > REWARD_CLIP_LIMIT:
    return (f"must lie within +-{REWARD_CLIP_LIMIT:g}: wider bounds let the squares and sums of rewards (PPO's value "
            "loss, the gradient norm) overflow float32")
  return None


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The RL objective. eps_low / eps_high / aggregation = None take the loss's paper default."""

  SECTION: ClassVar[str] = "algo"

  group_size: int = setting(8, "G samples per prompt",
                            check=lambda v: None if v >= 2 else "must be >= 2 (group baselines)")
  advantage: str = setting("grpo", "grpo | dr_grpo | rloo | distill (needs model.teacher_path)")
  loss: str = setting("ppo_clip", "ppo_clip | dapo | gspo")
  aggregation: str | None = setting(None, "token_mean | seq_mean_token_mean | seq_mean_token_sum_norm; None = the "
                                    "loss's paper default (ppo_clip: token_mean; dapo: token_mean)")
  eps_low: float | None = setting(None, "lower clip of the ratio (None = the loss's default, 0.2)")
  eps_high: float | None = setting(None, "upper clip (None = the loss's default); DAPO clip-higher uses 0.28")
  norm_length: int = setting(0, "constant L of seq_mean_token_sum_norm (Dr. GRPO: the max completion length)",
                             check=non_negative)
  decoupled: bool = setting(True, "trust region around the learner's proximal policy, IS-correct the sampler "
                            "(False: around the behaviour policy)")
  kl_coef: float = setting(0.0, "KL to the reference; 0 skips the reference forward", check=non_negative)
  kl_estimator: str = setting("k3", "k1 | k2 | k3")
  is_mode: str = setting("tis", "off-policy correction: none | tis (truncate) | mis (icepop mask)",
                         check=one_of(*is_correction.IS_MODES))
  is_level: str = setting("token", "token | sequence", check=one_of(*is_correction.IS_LEVELS))
  is_cap: float = setting(2.0, "TIS cap (verl default)", check=positive)
  is_low: float = setting(0.5, "MIS band lower edge")
  is_high: float = setting(2.0, "MIS band upper edge: tokens outside [is_low, is_high] are masked", check=positive)
  dynamic_sampling: bool = setting(False, "DAPO: drop zero-variance groups and refill")
  keep_sampling_mask: bool = setting(
      False, "'Keep Sampling Mask' (needs sampler.record_sampling_mask): score tokens under the sampler's recorded "
      "top-k/top-p set, so the IS ratio is exactly 1 at staleness 0", check=_bool)
  keep_routing: bool = setting(
      False, "'Keep Routing' (needs sampler.record_routing): force the sampler's recorded MoE experts in the "
      "learner's forward, so experts that would flip cannot move the IS ratio", check=_bool)
  reward_clip: tuple[float, float] = setting(
      (-1e4, 1e4), "rewards are clipped to this finite [low, high] before advantages (the share clipped is "
      "reward/clipped), so no reward, however large, makes the loss non-finite", check=_finite_range)
  overlong_buffer: int = setting(0, "DAPO soft overlong penalty over the last N tokens before max_new_tokens; 0 = off",
                                 check=non_negative)
  overlong_penalty: float = setting(1.0, "the penalty at max_new_tokens (linear over the buffer)", check=non_negative)
  process_reward: str | None = setting(None, "name of a registered process reward (rewards/process.py) scoring each "
                                       "step's prefix while the completion decodes; None = off")
  process_reward_coef: float = setting(1.0, "weight of the process-supervised per-token advantage next to the "
                                       "outcome one")
  step_delimiter: str = setting("\n", "a token completing this string ends a step ('' = off)")
  step_every_tokens: int = setting(0, "also end a step every N tokens (0 = off)", check=non_negative)
  estimator: str = setting("grpo_family", "grpo_family (algo.advantage from group rewards) | ppo (learned critic + "
                           "per-token GAE advantages)", check=one_of(*ESTIMATORS))
  gamma: float = setting(1.0, "PPO discount inside a completion; 1 = the end reward counts fully at every token",
                         check=in_range(0, 1))
  gae_lambda: float = setting(0.95, "PPO GAE bias/variance trade-off (1 = Monte Carlo returns, 0 = one-step TD)",
                              check=in_range(0, 1))
  vf_coef: float = setting(0.5, "PPO weight of the value loss next to the policy loss", check=non_negative)
  vf_clip: float = setting(0.2, "PPO value clipping around the pre-update values; 0 = off", check=non_negative)
  kl_reward_coef: float = setting(0.0, "PPO token-level KL-to-reference penalty folded into the rewards; 0 = off",
                                  check=non_negative)
  whiten_advantages: bool = setting(True, "PPO: normalise the GAE advantages over the batch's tokens")
  sampling_temperature: float = run_value(
      1.0, "sampler.temperature (1 when greedy): learner logprobs are log softmax(logits / T), the distribution "
      "the behaviour logprobs were taken under",
      check=lambda v: None if isinstance(v, (int, float)) and 0 < v < math.inf else
      "must be a finite number > 0 (a greedy sampler has no distribution to train on)")

  def __post_init__(self):
    check_fields(self)
    _registered(advantages.get_advantage_fn, self.advantage)
    _registered(losses.get_policy_loss, self.loss)
    _registered(losses.check_aggregation, self.resolved_aggregation)
    _registered(kl.get_kl_fn, self.kl_estimator)
    require(0 <= self.eps_low_value < 1, "algo.eps_low", self.eps_low, "must be in [0, 1)")
    require(self.eps_high_value >= 0, "algo.eps_high", self.eps_high, "must be >= 0")
    require(0 <= self.is_low < self.is_high, "algo.is_low", self.is_low, f"must be in [0, algo.is_high={self.is_high})")
    require(self.resolved_aggregation != "seq_mean_token_sum_norm" or self.norm_length > 0, "algo.norm_length",
            self.norm_length, "seq_mean_token_sum_norm needs a positive constant length")
    require(self.decoupled or self.is_mode == "none", "algo.is_mode", self.is_mode,
            "needs algo.decoupled=True (the IS weight corrects behaviour -> proximal); use 'none'")
    require(self.estimator != "ppo" or self.loss in PPO_LOSSES, "algo.loss", self.loss,
            f"algo.estimator='ppo' needs a token-level loss, one of {list(PPO_LOSSES)}")

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


def _b(v) -> str | None:
  return in_range(0, 1, high_open=True)(v)


# Updates on one batch: TRL's num_iterations and verl's ppo_epochs are 1-4, PPO's epochs at most tens;
# past this a step only overfits its batch, and the step's compiled loop stacks a row of metrics per update.
MAX_UPDATES_PER_BATCH = 64


def _updates(v) -> str | None:
  if positive_int(v):
    return positive_int(v)
  return None if v <= MAX_UPDATES_PER_BATCH else (
      f"must be <= {MAX_UPDATES_PER_BATCH}: each update is a full pass over the batch (TRL and verl use 1-4), so "
      "more only overfit it and multiply the step's time")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  SECTION: ClassVar[str] = "optim"

  learning_rate: float | None = setting(
      None, "peak rate; None: chosen at the start of a run by what it starts from: 1e-6 for a pretrained "
      "model.hf_path (TRL's GRPO default; 1e-5 with LoRA), 2e-4 for the built-in model (after its supervised "
      "stage)", check=optional(positive))
  warmup_steps: int = setting(0, "linear warm-up of the learning rate", check=non_negative)
  schedule: str = setting("constant", "constant | cosine (decays to 0 at the last RL step)",
                          check=one_of(*SCHEDULES))
  grad_clip: float = setting(1.0, "global-norm clip; 0 = off", check=non_negative)
  weight_decay: float = setting(0.0, "AdamW decay; RL moves little, none needed by default", check=non_negative)
  b1: float = setting(0.9, "Adam first-moment decay", check=_b)
  b2: float = setting(0.99, "faster than 0.999: RL gradients are non-stationary", check=_b)
  eps: float = setting(1e-8, "Adam denominator epsilon", check=positive)
  micro_batches: int = setting(1, "exact token-weighted gradient accumulation", check=positive_int)
  updates_per_batch: int = setting(
      1, "K optimizer updates on each sampled batch, one RL step (TRL num_iterations, verl ppo_epochs): the "
      "proximal logprobs are fixed before the first, so from the second on the ratio moves and eps_low / eps_high "
      "clip; the schedule still counts RL steps", check=_updates)
  group_by_length: int = setting(
      0, "N > 0: rows sorted by length, each micro-batch runs at the shortest of N prefix lengths (T*k/N) that "
      "holds its rows, so a long tail pads one micro-batch, not all", check=non_negative)
  share_prompts: bool = setting(
      False, "one learner row per GRPO group, its prompt once and then its answers, each answer attending the "
      "prompt and itself (learner/prompt_rows.py): the same loss and gradients as a row per answer, without "
      "repeating the prompt in every row or padding every answer to the longest", check=_bool)
  pack_tokens: int = setting(
      0, "with share_prompts, N > 0: several whole groups per learner row, up to N tokens a row, each attending "
      "its own prompt (learner/prompt_rows.py#pack): rows filled instead of padded to the longest group, the "
      "same loss and gradients; the step then has as many rows as the groups need (rounded up to "
      "micro_batches * learner devices). 0 = one group per row", check=non_negative)
  context_parallel: bool = setting(
      False, "split each row along its tokens over the learner's fsdp devices instead of splitting the rows "
      "(models/context_parallel.py): a row longer than one device's activations hold trains, with the same loss "
      "and gradients; attention by model.context_parallel_attention (ring by default)",
      check=_bool)
  total_steps: int = run_value(0, "rl.num_steps: where cosine reaches 0 (0 = not set yet)", check=non_negative)

  def __post_init__(self):
    check_fields(self)
    require(not self.group_by_length or self.micro_batches >= 2, "optim.group_by_length", self.group_by_length,
            f"needs optim.micro_batches >= 2 to group rows into (got {self.micro_batches})")
    require(not (self.share_prompts and self.group_by_length), "optim.share_prompts", True,
            "and optim.group_by_length trim rows differently: set one of them")
    require(not self.pack_tokens or self.share_prompts, "optim.pack_tokens", self.pack_tokens,
            "packs shared-prompt rows: it needs optim.share_prompts=True")
    # The one check of the cosine warm-up (the run's config runs it with total_steps = rl.num_steps).
    require(self.schedule != "cosine" or not self.total_steps or self.total_steps > self.warmup_steps,
            "optim.warmup_steps", self.warmup_steps,
            f"cosine decays to 0 at rl.num_steps={self.total_steps}: must be less")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """What the learner is built from: the config's algo and optim sections with their run values."""

  algo: AlgoConfig = AlgoConfig()
  optim: OptimConfig = OptimConfig()
  logprob_chunk_size: int = 128  # positions unembedded at once: bounds the [B, C, V] logits
  batch_axis: str = "fsdp"  # learner mesh axis the batch rows are split over

  def __post_init__(self):
    require(isinstance(self.algo, AlgoConfig), "learner.algo", self.algo, "must be an AlgoConfig")
    require(isinstance(self.optim, OptimConfig), "learner.optim", self.optim, "must be an OptimConfig")
    require(self.logprob_chunk_size > 0, "learner.logprob_chunk_size", self.logprob_chunk_size, "must be > 0")
