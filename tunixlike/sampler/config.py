"""SamplerConfig: every setting of the engine and the rollout driver, validated once."""

from __future__ import annotations

import dataclasses
import math

from tunixlike.sampler.sampling import SamplingParams


# Errors name a field by its key in the run config (configs/base.py); the fields it has no
# `sampler.<field>` key for are named by where they come from, so no message names a missing key.
_NAMES = {"group_size": "algo.group_size", "min_prefill_bucket": "SamplerConfig.min_prefill_bucket"}


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  # Decode slots (the decode batch), shared by all replicas of the sampler mesh.
  max_concurrent_decodes: int = 16
  # Longest prompt; prefill lengths are bucketed to powers of two up to it.
  max_prefill_length: int = 64
  # Default cap on generated tokens per completion (a request may ask for fewer).
  max_new_tokens: int = 64
  temperature: float = 1.0  # 0 = greedy (argmax whatever top_k / top_p say)
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  eos_ids: tuple[int, ...] = ()  # sampling one of these ends the completion (and is kept)
  stop_strings: tuple[str, ...] = ()  # checked on the host; needs a detokenizer in the driver
  # Decode steps per host round-trip; EOS and length stops are applied on device step by step.
  steps_per_call: int = 4
  record_sampling_mask: bool = False  # "Keep Sampling Mask": packed kept-token set per token
  # "Keep Routing" (MoE models only): the experts every MoE layer chose, per token, for the learner to replay.
  record_routing: bool = False
  group_size: int = 1  # G completions per prompt, sharing one prefill
  # Prompts longer than max_prefill_length: error (False) or keep their last tokens and count it.
  truncate_long_prompts: bool = False
  min_prefill_bucket: int = 16  # smallest prefill bucket (tiny buckets only add compilations)
  # The decode cache holds the filled part rounded up to a multiple of this many positions; it
  # grows and shrinks with the longest live sequence (one compiled decode program per size).
  attend_bucket: int = 32
  # Slot groups, each with its own attended window: long sequences are kept together so a group of
  # short ones reads only its own window (continuous batching). 1 = one window for all slots.
  slot_groups: int = 1
  seed: int = 0
  cache_dtype: str | None = None  # KV cache dtype; None = the model's activation dtype
  idle_wait_s: float = 0.01  # how long the driver sleeps when it has nothing to do

  def __post_init__(self):
    for name in ("max_concurrent_decodes", "max_prefill_length", "max_new_tokens", "steps_per_call",
                 "group_size", "min_prefill_bucket", "attend_bucket", "slot_groups"):
      value = getattr(self, name)
      if not _is_int(value) or value < 1:
        raise ValueError(f"{_NAMES.get(name, 'sampler.' + name)}={value!r}: must be an int >= 1")
    if not _is_int(self.seed):
      raise ValueError(f"seed={self.seed!r}: must be an int")
    if self.group_size > self.max_concurrent_decodes:
      raise ValueError(f"algo.group_size={self.group_size} is larger than "
                       f"sampler.max_concurrent_decodes={self.max_concurrent_decodes}: the G samples "
                       "of one prompt could never all be decoding")
    if not isinstance(self.eos_ids, tuple) or not all(_is_int(i) and i >= 0 for i in self.eos_ids):
      raise ValueError(f"SamplerConfig.eos_ids={self.eos_ids!r}: must be a tuple of token ids >= 0")
    if not isinstance(self.stop_strings, tuple) or not all(
        isinstance(s, str) and s for s in self.stop_strings):
      raise ValueError(f"sampler.stop_strings={self.stop_strings!r}: must be a tuple of non-empty strings")
    if self.cache_dtype is not None and self.cache_dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"SamplerConfig.cache_dtype={self.cache_dtype!r}: expected None, float32, bfloat16 or float16")
    if not (isinstance(self.idle_wait_s, (int, float)) and 0 < self.idle_wait_s <= 10):
      raise ValueError(f"SamplerConfig.idle_wait_s={self.idle_wait_s!r}: must be in (0, 10]")
    try:
      self.sampling  # validates temperature / top_k / top_p
    except ValueError as e:
      raise ValueError(f"sampler.{e}") from None

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

  @property
  def prefill_buckets(self) -> tuple[int, ...]:
    """Powers of two from min_prefill_bucket up to (the power of two >= ) max_prefill_length."""
    top = 1 << max(0, math.ceil(math.log2(self.max_prefill_length)))
    b = min(1 << math.ceil(math.log2(self.min_prefill_bucket)), top)
    out = []
    while b < top:
      out.append(b)
      b *= 2
    out.append(top)
    return tuple(out)

  @property
  def cache_length(self) -> int:
    """Most KV positions per slot: the longest prompt plus the longest completion, bucket-aligned."""
    need = max(self.prefill_buckets[-1], self.max_prefill_length + self.max_new_tokens)
    return -(-need // self.attend_bucket) * self.attend_bucket

  def attend_window(self, max_position: int) -> int:
    """Cache size covering positions [0, max_position]: a multiple of attend_bucket."""
    return min(-(-(max_position + 1) // self.attend_bucket) * self.attend_bucket, self.cache_length)

  @property
  def attend_windows(self) -> tuple[int, ...]:
    """Every window `attend_window` can return (one compiled decode program each)."""
    return tuple(sorted({self.attend_window(p) for p in range(self.cache_length)}))
