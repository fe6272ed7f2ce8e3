"""Typed, frozen configuration built from the ml_collections ConfigDict of `configs/*.py`.

The ConfigDict stops here: `from_config_dict` checks every key against these dataclasses (unknown
keys, wrong types) and each section validates its values in `__post_init__`. Errors are `ConfigError`s
that name the full key and the bad value, e.g. `rl.max_staleness=-1: must be >= 0`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any, Mapping


class ConfigError(ValueError):
  """A config key that is unknown, of the wrong type or has an invalid value."""


def _check(cond: bool, key: str, value: Any, why: str):
  if not cond:
    raise ConfigError(f"{key}={value!r}: {why}")


def _positive(section, prefix: str, *names: str, allow_zero: bool = False):
  for n in names:
    v = getattr(section, n)
    _check(v >= 0 if allow_zero else v > 0, f"{prefix}.{n}", v, "must be >= 0" if allow_zero else "must be > 0")


def _one_of(section, prefix: str, name: str, choices):
  v = getattr(section, name)
  _check(v in choices, f"{prefix}.{name}", v, f"must be one of {list(choices)}")


DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  hf_path: str | None = None
  critic_path: str | None = None
  teacher_path: str | None = None
  hidden_size: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  intermediate_size: int = 256
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = True
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: bool = False

  def __post_init__(self):
    _positive(self, "model", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rope_theta", "rms_norm_eps")
    _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
           f"must divide model.num_heads={self.num_heads}")
    _one_of(self, "model", "param_dtype", DTYPES)
    _one_of(self, "model", "dtype", DTYPES)


@dataclasses.dataclass(frozen=True)
class MeshSection:
  sampler_devices: int = 4
  learner_devices: int = 4
  sampler_tensor: int = 1
  learner_tensor: int = 1

  def __post_init__(self):
    _positive(self, "mesh", "sampler_devices", "learner_devices", "sampler_tensor", "learner_tensor")
    _check(self.sampler_devices % self.sampler_tensor == 0, "mesh.sampler_tensor", self.sampler_tensor,
           f"must divide mesh.sampler_devices={self.sampler_devices}")
    _check(self.learner_devices % self.learner_tensor == 0, "mesh.learner_tensor", self.learner_tensor,
           f"must divide mesh.learner_devices={self.learner_devices}")


TASKS = ("addition", "reverse", "gsm8k")


@dataclasses.dataclass(frozen=True)
class DataSection:
  task: str = "addition"
  path: str | None = None
  digits: int = 3
  max_prompt_length: int = 64
  shuffle_seed: int = 0
  num_eval_examples: int = 500

  def __post_init__(self):
    _one_of(self, "data", "task", TASKS)
    _positive(self, "data", "digits", "max_prompt_length", "num_eval_examples")
    _check(self.task == "gsm8k" or self.path is None, "data.path", self.path,
           f"is only read by data.task='gsm8k' (data.task={self.task!r} generates its own data)")


@dataclasses.dataclass(frozen=True)
class SamplerSection:
  max_concurrent_decodes: int = 128
  max_prefill_length: int = 64
  max_new_tokens: int = 8
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  steps_per_call: int = 4
  record_sampling_mask: bool = False
  record_routing: bool = False
  stop_strings: tuple[str, ...] = ()
  attend_bucket: int = 32
  slot_groups: int = 1
  warmup: bool = False

  def __post_init__(self):
    _positive(self, "sampler", "max_concurrent_decodes", "max_prefill_length", "max_new_tokens",
              "steps_per_call", "attend_bucket", "slot_groups")
    _positive(self, "sampler", "temperature", "top_k", allow_zero=True)
    _check(0.0 < self.top_p <= 1.0, "sampler.top_p", self.top_p, "must be in (0, 1]")


ESTIMATORS = ("grpo_family", "ppo")
PPO_LOSSES = ("ppo_clip", "dapo")  # gspo's ratio is per sequence: it cannot take per-token advantages
OFFLOAD_COMPONENTS = ("reference", "optimizer", "critic")


@dataclasses.dataclass(frozen=True)
class AlgoSection:
  group_size: int = 8
  advantage: str = "grpo"
  loss: str = "ppo_clip"
  aggregation: str | None = None
  eps_low: float | None = None
  eps_high: float | None = None
  norm_length: int = 0
  decoupled: bool = True
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  is_mode: str = "tis"
  is_level: str = "token"
  is_cap: float = 2.0
  is_low: float = 0.5
  is_high: float = 2.0
  dynamic_sampling: bool = False
  keep_sampling_mask: bool = False
  keep_routing: bool = False
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  estimator: str = "grpo_family"
  gamma: float = 1.0
  gae_lambda: float = 0.95
  vf_coef: float = 0.5
  vf_clip: float = 0.2
  kl_reward_coef: float = 0.0
  whiten_advantages: bool = True
  process_reward: str | None = None
  process_reward_coef: float = 1.0
  step_delimiter: str = "\n"
  step_every_tokens: int = 0

  def __post_init__(self):
    _one_of(self, "algo", "estimator", ESTIMATORS)
    for n in ("gamma", "gae_lambda"):
      _check(0.0 <= getattr(self, n) <= 1.0, f"algo.{n}", getattr(self, n), "must be in [0, 1]")
    _positive(self, "algo", "vf_coef", "vf_clip", "kl_reward_coef", allow_zero=True)
    _check(self.estimator != "ppo" or self.loss in PPO_LOSSES, "algo.loss", self.loss,
           f"algo.estimator='ppo' needs a token-level loss, one of {list(PPO_LOSSES)}")
    _check(self.group_size >= 2, "algo.group_size", self.group_size, "must be >= 2 (group baselines)")
    _positive(self, "algo", "kl_coef", "norm_length", "overlong_buffer", "overlong_penalty", allow_zero=True)
    _one_of(self, "algo", "kl_estimator", ("k1", "k2", "k3"))
    _one_of(self, "algo", "is_mode", ("none", "tis", "mis"))
    _one_of(self, "algo", "is_level", ("token", "sequence"))
    _positive(self, "algo", "is_cap", "is_high")
    _check(0 <= self.is_low < self.is_high, "algo.is_low", self.is_low, "must be in [0, algo.is_high)")


@dataclasses.dataclass(frozen=True)
class OptimSection:
  learning_rate: float = 5e-4
  warmup_steps: int = 0
  schedule: str = "constant"
  grad_clip: float = 1.0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  micro_batches: int = 1
  group_by_length: int = 0

  def __post_init__(self):
    _positive(self, "optim", "learning_rate", "micro_batches")
    _positive(self, "optim", "warmup_steps", "grad_clip", "weight_decay", "group_by_length", allow_zero=True)
    _check(not self.group_by_length or self.micro_batches >= 2, "optim.group_by_length", self.group_by_length,
           f"needs optim.micro_batches >= 2 to group rows into (got {self.micro_batches})")
    _one_of(self, "optim", "schedule", ("constant", "cosine"))
    for n in ("b1", "b2"):
      _check(0.0 <= getattr(self, n) < 1.0, f"optim.{n}", getattr(self, n), "must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class LearnerSection:
  offload: tuple[str, ...] = ()

  def __post_init__(self):
    for c in self.offload:
      _check(c in OFFLOAD_COMPONENTS, "learner.offload", self.offload,
             f"{c!r} is not a component that can be offloaded; choose from {list(OFFLOAD_COMPONENTS)}")


@dataclasses.dataclass(frozen=True)
class LoraSection:
  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

  def __post_init__(self):
    _positive(self, "lora", "rank", allow_zero=True)
    _positive(self, "lora", "alpha")
    _check(self.rank == 0 or len(self.targets) > 0, "lora.targets", self.targets, "must name a module")


@dataclasses.dataclass(frozen=True)
class RLSection:
  num_steps: int = 60
  prompts_per_step: int = 32
  max_staleness: int = 1
  sync_mode: str = "soft_pause"
  sync_dtype: str | None = None
  reward_workers: int = 4
  reward_timeout_s: float = 10.0
  max_nonfinite_steps: int = 3
  wait_timeout_s: float = 300.0
  env: str | None = None
  env_max_turns: int = 4
  env_step_timeout_s: float = 30.0
  stop_on_collapse: bool = True
  collapse_entropy_frac: float = 0.01
  collapse_spike_factor: float = 1000.0

  def __post_init__(self):
    _positive(self, "rl", "num_steps", "prompts_per_step", "reward_workers", "reward_timeout_s",
              "max_nonfinite_steps", "wait_timeout_s", "env_max_turns", "env_step_timeout_s")
    _check(self.env in (None, "calculator"), "rl.env", self.env, "must be None or 'calculator'")
    _positive(self, "rl", "max_staleness", "collapse_spike_factor", allow_zero=True)
    _check(0.0 < self.collapse_entropy_frac < 1.0, "rl.collapse_entropy_frac", self.collapse_entropy_frac,
           "must be in (0, 1)")
    _one_of(self, "rl", "sync_mode", ("soft_pause", "drain"))
    _check(self.sync_dtype in (None,) + DTYPES, "rl.sync_dtype", self.sync_dtype, f"must be one of {DTYPES}")


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
  max_steps: int = 0
  batch_size: int = 64
  learning_rate: float = 1e-3
  target_accuracy: float = 0.2
  eval_every: int = 25

  def __post_init__(self):
    _positive(self, "warm_start", "max_steps", allow_zero=True)
    _positive(self, "warm_start", "batch_size", "learning_rate", "eval_every")
    _check(0.0 < self.target_accuracy <= 1.0, "warm_start.target_accuracy", self.target_accuracy,
           "must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class EvalSection:
  every_steps: int = 0

  def __post_init__(self):
    _positive(self, "eval", "every_steps", allow_zero=True)


@dataclasses.dataclass(frozen=True)
class LogSection:
  tensorboard: bool = True
  progress_bar: bool = True
  trace: bool = False


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every_steps: int = 50
  every_seconds: float = 0.0
  keep: int = 2

  def __post_init__(self):
    _positive(self, "checkpoint", "every_steps", "every_seconds", allow_zero=True)
    _positive(self, "checkpoint", "keep")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto_detect: bool = False
  timeout_s: int = 300

  def __post_init__(self):
    _check(self.num_processes is None or self.num_processes >= 1, "distributed.num_processes",
           self.num_processes, "must be >= 1")
    _check(self.process_id is None or self.process_id >= 0, "distributed.process_id", self.process_id,
           "must be >= 0")
    _check(self.process_id is None or self.num_processes is None or self.process_id < self.num_processes,
           "distributed.process_id", self.process_id, f"must be < distributed.num_processes={self.num_processes}")
    _positive(self, "distributed", "timeout_s")


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = 0
  model: ModelSection = ModelSection()
  mesh: MeshSection = MeshSection()
  data: DataSection = DataSection()
  sampler: SamplerSection = SamplerSection()
  algo: AlgoSection = AlgoSection()
  optim: OptimSection = OptimSection()
  learner: LearnerSection = LearnerSection()
  lora: LoraSection = LoraSection()
  rl: RLSection = RLSection()
  warm_start: WarmStartSection = WarmStartSection()
  eval: EvalSection = EvalSection()
  log: LogSection = LogSection()
  checkpoint: CheckpointSection = CheckpointSection()
  distributed: DistributedSection = DistributedSection()

  def __post_init__(self):
    # Cross-section checks.
    ppo = self.algo.estimator == "ppo"
    _check(ppo or self.model.critic_path is None, "model.critic_path", self.model.critic_path,
           "a critic is only used with algo.estimator='ppo'")
    _check(not ppo or self.lora.rank == 0, "lora.rank", self.lora.rank,
           "algo.estimator='ppo' trains the value head with the policy and does not support LoRA yet")
    has_ref = self.lora.rank == 0 and (self.algo.kl_coef > 0 or (ppo and self.algo.kl_reward_coef > 0))
    _check("reference" not in self.learner.offload or has_ref, "learner.offload", self.learner.offload,
           "'reference' does not exist: the reference copy is kept only with algo.kl_coef > 0 (or PPO's "
           "algo.kl_reward_coef > 0) and lora.rank=0")
    _check("critic" not in self.learner.offload or (ppo and self.model.critic_path is not None), "learner.offload",
           self.learner.offload, "'critic' does not exist: only a separate critic model (algo.estimator='ppo' with "
           "model.critic_path) can be offloaded")
    self._check_token_advantages()
    _check(not self.algo.keep_sampling_mask or self.sampler.record_sampling_mask, "algo.keep_sampling_mask",
           True, "needs sampler.record_sampling_mask=True (the sampler must ship the masks)")
    _check(not self.algo.keep_routing or self.sampler.record_routing, "algo.keep_routing",
           True, "needs sampler.record_routing=True (the sampler must ship the experts it chose)")
    _check(not self.sampler.record_routing or (self.rl.env is None and self.algo.estimator != "ppo"),
           "sampler.record_routing", True, "is supported for single-turn GRPO-family runs only (not rl.env "
           "episodes, whose environment tokens the decode loop never routes, nor algo.estimator='ppo')")
    _check(self.sampler.max_concurrent_decodes >= self.algo.group_size, "sampler.max_concurrent_decodes",
           self.sampler.max_concurrent_decodes, f"must be >= algo.group_size={self.algo.group_size}")
    _check(self.sampler.max_concurrent_decodes % (self.mesh.sampler_devices // self.mesh.sampler_tensor) == 0,
           "sampler.max_concurrent_decodes", self.sampler.max_concurrent_decodes,
           "must be divisible by the number of sampler replicas "
           f"(mesh.sampler_devices / mesh.sampler_tensor = {self.mesh.sampler_devices // self.mesh.sampler_tensor})")
    batch = self.rl.prompts_per_step * self.algo.group_size
    fsdp = self.mesh.learner_devices // self.mesh.learner_tensor
    _check(batch % (self.optim.micro_batches * fsdp) == 0, "rl.prompts_per_step", self.rl.prompts_per_step,
           f"prompts_per_step * algo.group_size = {batch} must be divisible by optim.micro_batches * "
           f"learner fsdp devices = {self.optim.micro_batches} * {fsdp}")
    _check(not self.warm_start.max_steps or self.warm_start.batch_size % fsdp == 0, "warm_start.batch_size",
           self.warm_start.batch_size, "must be divisible by the learner fsdp devices "
           f"(mesh.learner_devices / mesh.learner_tensor = {fsdp}); the warm start shards its batch over them")
    _check(self.sampler.max_prefill_length >= self.data.max_prompt_length, "data.max_prompt_length",
           self.data.max_prompt_length, f"must be <= sampler.max_prefill_length={self.sampler.max_prefill_length}")

  def _check_token_advantages(self):
    """Process rewards and on-policy distillation: per-token advantages in the GRPO-family step."""
    a, s = self.algo, self.sampler
    distill = a.advantage == "distill"
    _check(distill == (self.model.teacher_path is not None), "model.teacher_path", self.model.teacher_path,
           "on-policy distillation needs both algo.advantage='distill' and model.teacher_path (the teacher's HF dir)")
    if a.process_reward is not None:
      from tunixlike.rewards import process  # the PRM registry (a leaf module: numpy only)
      _check(a.process_reward in process.process_reward_names(), "algo.process_reward", a.process_reward,
             f"not a registered process reward; choose one of {process.process_reward_names()}")
      _check(a.process_reward_coef > 0, "algo.process_reward_coef", a.process_reward_coef, "must be > 0")
      _check(bool(a.step_delimiter) or a.step_every_tokens > 0, "algo.step_delimiter", a.step_delimiter,
             "a process reward needs step boundaries: a delimiter or algo.step_every_tokens > 0")
    _check(a.step_every_tokens >= 0, "algo.step_every_tokens", a.step_every_tokens, "must be >= 0")
    if not (distill or a.process_reward is not None):
      return
    what = "algo.advantage='distill'" if distill else "algo.process_reward"
    _check(a.loss in PPO_LOSSES, "algo.loss", a.loss, f"{what} gives per-token advantages: use one of {list(PPO_LOSSES)}")
    _check(a.estimator == "grpo_family", "algo.estimator", a.estimator, f"{what} works with 'grpo_family' only")
    _check(self.rl.env is None, "rl.env", self.rl.env, f"{what} is single-turn only")
    if distill:  # the sampler's logprobs must be the student's own distribution for r_t to be the reverse KL
      _check(s.temperature == 1.0, "sampler.temperature", s.temperature, "distillation samples at temperature 1")
      _check(s.top_k == 0 and s.top_p == 1.0, "sampler.top_k" if s.top_k else "sampler.top_p",
             s.top_k or s.top_p, "distillation samples the full distribution (top_k=0, top_p=1)")


def _is_instance(value: Any, hint: Any) -> bool:
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_is_instance(value, h) for h in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if origin is tuple:
    (item, _) = typing.get_args(hint)
    return isinstance(value, (tuple, list)) and all(_is_instance(v, item) for v in value)
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, hint)


def _build(cls, values: Mapping[str, Any], prefix: str):
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, value in values.items():
    name = f"{prefix}{key}"
    if key not in hints:
      raise ConfigError(f"{name}: unknown config key (known: {', '.join(sorted(hints))})")
    hint = hints[key]
    if dataclasses.is_dataclass(hint):
      if not isinstance(value, Mapping):
        raise ConfigError(f"{name}={value!r}: must be a section")
      kwargs[key] = _build(hint, value, f"{name}.")
      continue
    if not _is_instance(value, hint):
      raise ConfigError(f"{name}={value!r}: wrong type {type(value).__name__}, expected {hint}")
    if isinstance(value, float) and not math.isfinite(value):  # inf passes every range check
      raise ConfigError(f"{name}={value!r}: must be finite")
    kwargs[key] = tuple(value) if isinstance(value, list) else (float(value) if hint is float else value)
  return cls(**kwargs)


def from_config_dict(config: Mapping[str, Any]) -> Config:
  """Builds and validates the typed config. Raises ConfigError naming the key and the value."""
  values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  return _build(Config, values, "")


# What a run reads from each directory (alternatives in a tuple), checked before anything is built.
_HF_FILES = (("config.json",), ("model.safetensors", "model.safetensors.index.json"))
_GSM8K_FILES = (("train.jsonl",), ("test.jsonl",))


def _check_dir(key: str, path: str, needs: tuple[tuple[str, ...], ...]):
  where = f"{key}={path!r}"
  if not os.path.exists(path):
    raise ConfigError(f"{where}: directory does not exist")
  if not os.path.isdir(path):
    raise ConfigError(f"{where}: not a directory")
  if not os.listdir(path):
    raise ConfigError(f"{where}: directory is empty")
  for names in needs:
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
      raise ConfigError(f"{where}: has no {' or '.join(names)}")


def check_paths(config: Config):
  """The local directories the config names, as the commands see them before a run builds anything.

  Kept out of the dataclasses: a config stays a value that can be built (and tested) on any machine.
  """
  m = config.model
  if m.hf_path is not None:  # the run's tokenizer comes from the same directory
    _check_dir("model.hf_path", m.hf_path, _HF_FILES + (("tokenizer.json",),))
  for key, path in (("model.critic_path", m.critic_path), ("model.teacher_path", m.teacher_path)):
    if path is not None:
      _check_dir(key, path, _HF_FILES)
  if config.data.task == "gsm8k" and config.data.path is not None:  # None: the copy shipped with the package
    _check_dir("data.path", config.data.path, _GSM8K_FILES)


def replace(config: Config, **changes) -> Config:
  """`replace(cfg, rl=dict(num_steps=3))`: a copy with some keys of some sections changed."""
  out = {}
  for section, value in changes.items():
    current = getattr(config, section)
    out[section] = dataclasses.replace(current, **value) if isinstance(value, Mapping) else value
  return dataclasses.replace(config, **out)
