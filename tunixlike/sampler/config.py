"""SamplerConfig: the `sampler` section of the config, every setting of the engine and the driver."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from tunixlike.sampler.sampling import SamplingParams
from tunixlike.settings import (DTYPES, ConfigError, an_int, check_fields, in_range, ints_at_least, library_setting,
                                one_of, optional, positive_int, run_value, setting)


def _token_ids(v) -> str | None:
  ok = isinstance(v, tuple) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
  return None if ok else "must be a tuple of token ids >= 0"


def _stop_strings(v) -> str | None:
  ok = isinstance(v, tuple) and all(isinstance(s, str) and s for s in v)
  return None if ok else "must be a tuple of non-empty strings"


def _power_of_two(v) -> str | None:
  ok = isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0
  return None if ok else "must be a power of two"


KV_LAYOUTS = ("contiguous", "paged")
# An engine built without a run (which chooses sampler.temperature) samples the model as is.
OUTSIDE_A_RUN_TEMPERATURE = 1.0


def check_sized(config: SamplerConfig) -> None:
  """Refuses a config whose completion limit was never set: a run sizes it from the data (`rl.build.build`);
  an engine built any other way must be given one."""
  if config.max_new_tokens is None:
    raise ValueError("sampler.max_new_tokens is None: an engine needs a completion length limit (a run sizes it "
                     "from the data's answers at start-up; elsewhere set it, e.g. SamplerConfig(max_new_tokens=8))")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  SECTION: ClassVar[str] = "sampler"

  max_concurrent_decodes: int = setting(
      128, "decode slots (the decode batch), shared by all replicas; the run splits them over the hosts",
      check=positive_int, resumable=True)
  max_prefill_length: int = setting(64, "longest prompt; prefill compiles once per power-of-two bucket",
                                    check=positive_int)
  max_new_tokens: int | None = setting(None, "completion length limit (finish_reason 'length'; a request may ask "
                                       "for fewer); None: sized at the start of the run from the data's longest "
                                       "tokenized answer, plus room", check=optional(positive_int))
  temperature: float | None = setting(
      None, "0 = greedy; the learner scores tokens at the same temperature; None: chosen at the start of a run by "
      "what it starts from: 1.0 for a pretrained model.hf_path (TRL's GRPO default) and for distillation, 0.7 for "
      "the built-in model (an engine built outside a run samples at 1.0)")
  top_k: int = library_setting(SamplingParams, "top_k", "0 = off")
  top_p: float = library_setting(SamplingParams, "top_p", "1 = off; with < 1 consider algo.keep_sampling_mask",
                                 check=in_range(0, 1, low_open=True))
  stop_strings: tuple[str, ...] = setting((), "completions also end at these strings (checked on the host)",
                                          check=_stop_strings)
  steps_per_call: int = setting(4, "decode steps per host round-trip (EOS and length stops stay exact on device)",
                                check=positive_int, resumable=True)
  record_sampling_mask: bool = setting(False, "'Keep Sampling Mask' payload: the packed kept-token set per token")
  record_routing: bool = setting(False, "'Keep Routing' payload: the experts each MoE layer chose (MoE models only)")
  attend_bucket: int = setting(32, "decode attends the filled cache rounded up to this many positions (one "
                               "compiled decode program per size)", check=positive_int, resumable=True)
  slot_groups: int = setting(1, "slot groups with their own attention windows (2: long sequences kept together)",
                             check=positive_int, resumable=True)
  warmup: bool = setting(False, "compile every decode program before the run (no mid-run compile stalls; costs "
                         "start-up)", resumable=True)
  truncate_long_prompts: bool = setting(False, "prompts longer than max_prefill_length keep their last tokens "
                                        "(counted) instead of failing")
  min_prefill_bucket: int = setting(16, "smallest prefill bucket (tiny buckets only add compilations)",
                                    check=positive_int)
  cache_dtype: str | None = setting(None, "KV cache dtype; None = the model's activation dtype",
                                    check=optional(one_of(*DTYPES)))
  kv_layout: str = setting("contiguous", "decode cache: 'contiguous' (a window per slot) or 'paged' (blocks "
                           "through block tables: shared prompts, a memory budget, preemption)",
                           check=one_of(*KV_LAYOUTS), resumable=True)
  kv_block_size: int = setting(32, "positions per block of the paged cache (a power of two)",
                               check=_power_of_two, resumable=True)
  kv_cache_bytes: int | None = setting(None, "paged cache pool per sampler replica in bytes (K and V of every "
                                       "layer; the pool array grows to it as blocks are used); None = what "
                                       "the contiguous cache of all slots would take",
                                       check=optional(positive_int), resumable=True)
  prefill_chunk: int = setting(512, "prompts longer than this prefill a chunk per call (one program per chunk "
                               "size; decoding goes on between chunks)", check=_power_of_two, resumable=True)
  speculative: bool = setting(False, "speculative decoding: drafts by n-gram lookup in the sequence's own text, its "
                              "group's other samples and its prompt's earlier rollouts, verified in one forward; "
                              "the same tokens and logprobs as plain decoding (needs kv_layout='paged')",
                              resumable=True)
  draft_tokens: int = setting(8, "most draft tokens verified per sequence and verify step (a verify call's "
                              "steps_per_call steps each verify this many; one verify program per decode width: "
                              "the draft length is fixed)", check=positive_int, resumable=True)
  draft_ngram: int = setting(3, "longest suffix of a sequence looked up in the draft sources (shorter ones down to 2 "
                             "if it is not found)", check=ints_at_least(2), resumable=True)
  draft_min_acceptance: float = setting(0.3, "a sequence whose drafts were accepted less than this over its last "
                                        "tries stops drafting for a while (then tries again, waiting longer each "
                                        "time)", check=in_range(0, 1), resumable=True)
  draft_history: int = setting(4, "earlier completions of each prompt kept on the host as draft sources (0 = none)",
                               check=ints_at_least(0), resumable=True)
  idle_wait_s: float = setting(0.01, "how long the driver sleeps when it has nothing to do",
                               check=in_range(0, 10, low_open=True))
  eos_ids: tuple[int, ...] = run_value((), "the tokenizer's stop ids: sampling one ends the completion (kept)",
                                       check=_token_ids)
  group_size: int = run_value(1, "algo.group_size: G completions per prompt, sharing one prefill",
                              check=positive_int)
  seed: int = run_value(0, "the run's seed", check=an_int)

  def __post_init__(self):
    check_fields(self)
    # The one check of a group against the decode slots: the run's config runs it with algo.group_size,
    # and the run with this process's share of the slots (`build.sampler_config`).
    if self.group_size > self.max_concurrent_decodes:
      raise ConfigError(f"sampler.max_concurrent_decodes: {self.max_concurrent_decodes} decode slots (per process) "
                        f"are fewer than algo.group_size={self.group_size}: the G samples of one prompt could "
                        "never all be decoding")
    if self.kv_layout == "paged" and self.prefill_chunk % self.kv_block_size:
      raise ConfigError(f"sampler.kv_block_size={self.kv_block_size} does not divide "
                        f"sampler.prefill_chunk={self.prefill_chunk}")
    if self.kv_layout == "paged" and self.slot_groups > 1:
      raise ConfigError(f"sampler.slot_groups={self.slot_groups} needs sampler.kv_layout='contiguous' (a paged "
                        "cache reads each sequence's own blocks already)")
    if self.speculative and self.kv_layout != "paged":
      raise ConfigError("sampler.speculative=True needs sampler.kv_layout='paged' (drafts are verified over the "
                        f"paged cache), got sampler.kv_layout={self.kv_layout!r}")
    if self.speculative and self.record_routing:
      raise ConfigError("sampler.speculative=True does not record routing (sampler.record_routing=True): a verify "
                        "forward routes several tokens at once")
    try:
      self.sampling  # validates temperature / top_k / top_p
    except ValueError as e:
      raise ConfigError(f"sampler.{e}") from None

  @property
  def sampling(self) -> SamplingParams:
    temperature = OUTSIDE_A_RUN_TEMPERATURE if self.temperature is None else self.temperature
    return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=self.top_p)

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
  def prompt_batch_sizes(self) -> tuple[int, ...]:
    """Prompts per batched prefill / insert call (`Engine.prefill_many` / `insert_many`): powers of
    two up to the number of groups that fit the slots, which is also the largest (one program each)."""
    top = -(-self.max_concurrent_decodes // self.group_size)
    sizes, n = [], 1
    while n < top:
      sizes.append(n)
      n *= 2
    return tuple(sizes) + (top,)

  @property
  def cache_length(self) -> int:
    """Most KV positions per slot: the longest prompt plus the longest completion, bucket-aligned."""
    check_sized(self)
    need = max(self.prefill_buckets[-1], self.max_prefill_length + self.max_new_tokens)
    return -(-need // self.attend_bucket) * self.attend_bucket

  def attend_window(self, max_position: int) -> int:
    """Cache size covering positions [0, max_position]: a multiple of attend_bucket."""
    return min(-(-(max_position + 1) // self.attend_bucket) * self.attend_bucket, self.cache_length)

  @property
  def attend_windows(self) -> tuple[int, ...]:
    """Every window `attend_window` can return (one compiled decode program each)."""
    return tuple(sorted({self.attend_window(p) for p in range(self.cache_length)}))
