"""The one config tree: `Config`, whose sections are the library's own frozen dataclasses.

Each key is one dataclass field written with `settings.setting(default, why, check=...)`: its
default, its line in the reference (docs/config.md) and its check live there and nowhere else.
The ConfigDict that `configs/*.py` and `--config.a.b=v` edit is generated from the tree
(`default_config_dict`), and `from_config_dict` turns it back into a validated `Config`, checking
every key against the dataclasses (unknown keys, wrong types). Errors are `ConfigError`s that name
the full key and the bad value, e.g. `rl.max_staleness=-1: must be >= 0`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import types
import typing
from typing import Any, ClassVar, Mapping

import ml_collections
from ml_collections.config_dict import placeholder

from tunixlike import mesh as mesh_lib, shipped_configs
from tunixlike.data.tasks import TASKS, AdditionTask, DatasetTask
from tunixlike.distributed import DistributedConfig
from tunixlike.learner.config import OFFLOAD_COMPONENTS, PPO_LOSSES, AlgoConfig, OptimConfig
from tunixlike.models.config import (ATTENTION_IMPLEMENTATIONS, CONTEXT_PARALLEL_LAYOUTS, CONTEXT_PARALLEL_SCHEMES,
                                     ModelConfig)
from tunixlike.multi_agent.config import MultiAgentSection
from tunixlike.rl.config import RuntimeConfig
from tunixlike.sampler.config import SamplerConfig
from tunixlike.settings import (DTYPES, ConfigError, check_fields, in_range, is_key, library_setting, non_negative,
                                one_of, optional, positive, positive_int, require, setting)

__all__ = ["Config", "ConfigError", "check_paths", "default_config_dict", "from_config_dict", "from_saved", "load",
           "parse_arg", "replace"]


def _seed(v) -> str | None:
  # JAX's PRNG keys and numpy's generators take 32-bit seeds; a larger one would wrap or overflow.
  return None if 0 <= v < 2**32 else "must be in [0, 2**32)"


def _divides(n: int, of: str) -> str:
  return f"must divide {of}={n}"


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """Either a local Hugging Face directory (hf_path) or a fresh random model of these sizes."""

  SECTION: ClassVar[str] = "model"

  hf_path: str | None = setting(None, "a Hugging Face model: a local directory or a Hub name 'org/name' (read "
                                "through the huggingface_hub cache; HF_HUB_OFFLINE=1: the cache only); when set, the "
                                "sizes below are ignored")
  revision: str | None = setting(None, "a Hub name's branch, tag or commit (None: main)")
  teacher_path: str | None = setting(None, "on-policy distillation (algo.advantage='distill'): frozen teacher's HF dir")
  critic_path: str | None = setting(None, "PPO: HF dir of a separate critic model (same vocab); None = a value head "
                                    "on the policy trunk")
  hidden_size: int = setting(64, "tiny defaults: the built-in tasks learn on a CPU in minutes", check=positive)
  num_layers: int = setting(2, "two layers suffice for reversed-digit addition", check=positive)
  num_heads: int = setting(4, "query heads", check=positive)
  num_kv_heads: int = setting(2, "GQA: key/value heads (must divide num_heads)", check=positive)
  head_dim: int = setting(16, "per-head width", check=positive)
  intermediate_size: int = setting(256, "SwiGLU width (4x hidden)", check=positive)
  # Architecture and precision: their defaults are ModelConfig's, the description of every model.
  rope_theta: float = library_setting(ModelConfig, "rope_theta", "RoPE base; short sequences need no more",
                                      check=positive)
  rms_norm_eps: float = library_setting(ModelConfig, "rms_norm_eps", "as in Qwen2 / Llama 3", check=positive)
  qkv_bias: bool = library_setting(ModelConfig, "qkv_bias", "Qwen2-style biases on q/k/v projections")
  qk_norm: bool = library_setting(ModelConfig, "qk_norm", "Qwen3-style RMSNorm on queries and keys")
  tie_embeddings: bool = library_setting(ModelConfig, "tie_embeddings",
                                         "share input embedding and output projection (fewer params)")
  param_dtype: str = library_setting(ModelConfig, "param_dtype", "master weights", check=one_of(*DTYPES))
  dtype: str = library_setting(ModelConfig, "dtype", "compute dtype ('bfloat16' on TPU/GPU)", check=one_of(*DTYPES))
  remat: bool = library_setting(ModelConfig, "remat", "recompute activations in the backward pass to save memory")
  attention: str = library_setting(ModelConfig, "attention", "attention kernel of training and prefill "
                                   "(docs/learner.md#attention-kernels): auto = the fastest correct one on this "
                                   "backend | reference | blockwise | cudnn | pallas_tpu",
                                   check=one_of(*ATTENTION_IMPLEMENTATIONS))
  context_parallel_attention: str = library_setting(
      ModelConfig, "context_parallel_attention", "with optim.context_parallel, how each device's queries meet the "
      "keys of the rest of the row (docs/learner.md#context-parallelism): ring = K/V chunks passed around the "
      "devices, K/V memory T/N per device | all_gather = every device holds the row's K/V (one collective per "
      "layer; fewer, larger transfers where K/V are small next to the activations)",
      check=one_of(*CONTEXT_PARALLEL_SCHEMES))
  context_parallel_layout: str = library_setting(
      ModelConfig, "context_parallel_layout", "with optim.context_parallel, which of the row's tokens each device "
      "holds (docs/learner.md#context-parallelism): zigzag = runs i and 2N-1-i of 2N, so that under the causal "
      "mask every device computes as many (query, key) pairs | contiguous = the i-th N-th of the row (device 0 "
      "idles while the last computes N times as much)",
      check=one_of(*CONTEXT_PARALLEL_LAYOUTS))

  def __post_init__(self):
    check_fields(self)
    require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
            _divides(self.num_heads, "model.num_heads"))


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """Device split: sampler devices decode, learner devices train (per host with several hosts); or, colocated,
  both on all of them, taking turns."""

  SECTION: ClassVar[str] = "mesh"
  RESUMABLE: ClassVar[bool] = True  # checkpoints restore onto any device layout

  layout: str = setting("split", "split: sampler and learner on their own devices, working at once | colocated: both on "
                        "all sampler_devices + learner_devices devices, taking turns (docs/runtime.md: which to pick)",
                        check=one_of(*mesh_lib.LAYOUTS))
  sampler_devices: int = setting(4, "devices that decode (4 + 4 of 8 virtual CPU devices)", check=positive)
  learner_devices: int = setting(4, "devices that train (fsdp x tensor); colocated on one device: 1 + 0",
                                 check=non_negative)
  sampler_tensor: int = setting(1, "tensor parallelism hurts on CPU; use it on TPU/GPU for big models; must "
                                "divide the model's attention and KV heads", check=positive)
  learner_tensor: int = setting(1, "tensor-parallel degree of the learner (divides the model's attention and KV "
                                "heads); the rest is FSDP", check=positive)
  sampler_hosts: int = setting(0, "several processes: 0 = every host decodes and trains (the layouts above); N > 0 = "
                               "the last N processes only decode and the others only train, weights crossing by "
                               "cross-host device_put (docs/hosts_and_accelerators.md#whole-hosts-per-side); the "
                               "device counts above are then totals over each side's hosts", check=non_negative)
  host_timeout_s: float = setting(120.0, "whole hosts per side: a sampler host silent this long (dead or hung) stops "
                                  "the run, naming it; also the limit of each cross-host weight transfer",
                                  check=positive)
  save_synced_weights: bool = setting(False, "whole hosts per side, to debug the weight sync: after every sync learner "
                                      "host 0 writes the arrays it sent to WORKDIR/synced_weights/v{version}_{part}.npz "
                                      "and sampler host i those that arrived to WORKDIR/process_i/synced_weights/, "
                                      "equal bit for bit (np.array_equal) when the sync is right; gathers the whole "
                                      "model onto every learner device at each sync: small models only")

  def __post_init__(self):
    check_fields(self)
    require(not self.save_synced_weights or self.sampler_hosts, "mesh.save_synced_weights", self.save_synced_weights,
            "needs mesh.sampler_hosts > 0 (it checks the sync across hosts)")
    require(not self.sampler_hosts or self.layout == "split", "mesh.sampler_hosts", self.sampler_hosts,
            "needs mesh.layout='split' (whole hosts per side share no devices)")
    require(self.learner_devices > 0 or self.layout == "colocated", "mesh.learner_devices", self.learner_devices,
            "must be > 0 (0 only with mesh.layout='colocated', where both sides use every device)")
    require(self.sampler_devices % self.sampler_tensor == 0, "mesh.sampler_tensor", self.sampler_tensor,
            _divides(self.sampler_devices, "mesh.sampler_devices"))
    require(self.learner_devices % self.learner_tensor == 0, "mesh.learner_tensor", self.learner_tensor,
            _divides(self.learner_devices, "mesh.learner_devices"))

  @property
  def sampler_size(self) -> int:
    """Devices the sampler decodes on (all of them when colocated)."""
    return self.sampler_devices + self.learner_devices if self.layout == "colocated" else self.sampler_devices

  @property
  def learner_size(self) -> int:
    """Devices the learner trains on (all of them when colocated)."""
    return self.sampler_devices + self.learner_devices if self.layout == "colocated" else self.learner_devices

  def sizes_named(self, side: str) -> str:
    """How a side's device count is written in the config, for error messages."""
    own = f"mesh.{side}_devices"
    return own if self.layout == "split" else "mesh.sampler_devices + mesh.learner_devices (mesh.layout='colocated')"


@dataclasses.dataclass(frozen=True)
class DataSection:
  """A built-in task or the user's own dataset."""

  SECTION: ClassVar[str] = "data"

  task: str | None = setting("addition", "built-in task, a preset of data, prompt template and rewards: "
                             + " | ".join(TASKS) + " (data.train replaces its data, `rewards` its rewards)",
                             check=optional(one_of(*TASKS)))
  train: str | None = setting(None, "your training prompts: a JSONL / Parquet / Arrow file, a glob of them, or a "
                                    "Hugging Face save_to_disk directory")
  eval: str | None = setting(None, "held-out prompts, the same kinds; None: a seeded held-out split carved from "
                                   "data.train")
  prompt_field: str = library_setting(DatasetTask, "prompt_field", "the column holding the prompt text (every column reaches the rewards)")
  messages_field: str | None = setting(None, "instead: a column of chat messages [{role, content}], rendered with "
                                             "the model's chat template (a last assistant turn is the supervised "
                                             "stage's answer, not part of the RL prompt)")
  answer_field: str | None = setting(None, "the column of answers the supervised stage (warm_start.*) learns; None: "
                                           "a built-in task's 'answer', else the assistant turns of data.messages_field")
  system_prompt: str | None = setting(None, "a system message before each prompt (with a chat template)")
  allow_change: bool = setting(False, "a resume may read changed data.train / data.eval (each checkpoint keeps their "
                               "fingerprint): the prompt stream starts again on the new data, warned; with data.train "
                               "changed, needs data.eval (a carved held-out split would change)", resumable=True)
  skip_bad_lines: bool = library_setting(DatasetTask, "skip_bad_lines", "JSONL lines that do not parse, and rows whose prompt is not text (null, a "
                                 "number), are skipped and counted instead of failing")
  path: str | None = setting(None, "gsm8k: a directory with train.jsonl and test.jsonl (None: the copy shipped with "
                                   "tunixlike)")
  digits: int = library_setting(AdditionTask, "digits", "addition: operand digits (difficulty)", check=positive)
  max_prompt_length: int = setting(64, "longer prompts are filtered out and counted", check=positive)
  train_size: int | None = setting(None, "training prompts read: the first N (a generated task makes that many, "
                                         "each formatted and length-checked at start-up, ~0.1 ms apiece; a file's "
                                         "first N after the held-out split is carved); None: all (generated: 50,000)",
                                   check=optional(positive_int))
  shuffle_seed: int = setting(0, "order of the training prompts (reshuffled every epoch) and the carved eval split",
                              check=_seed)
  num_eval_examples: int = setting(500, "held-out accuracy swings 10-15 points on small evals", check=positive, resumable=True)

  def __post_init__(self):
    check_fields(self)
    require(self.task == "gsm8k" or self.path is None, "data.path", self.path,
            f"is only read by data.task='gsm8k' (data.task={self.task!r} generates its own data)")
    require(self.eval is None or self.train is not None, "data.eval", self.eval, "needs data.train")
    cap = getattr(TASKS.get(self.task), "MAX_ROWS", None) if self.train is None else None  # a generated task's
    if cap is not None and self.train_size is not None:
      require(self.train_size <= cap, "data.train_size", self.train_size, f"data.task={self.task!r} generates at "
              f"most {cap:,} rows (each formatted and length-checked at start-up); epochs reshuffle them")
    require(self.messages_field is None or self.train is not None, "data.messages_field", self.messages_field,
            "is read from a user dataset (data.train)")


def _reward_terms(v) -> str | None:
  if not isinstance(v, (tuple, list)):
    return "must be a list of {fn, weight, kwargs}"
  for i, term in enumerate(v):
    if not isinstance(term, Mapping) or not isinstance(term.get("fn"), str) or set(term) - {"fn", "weight", "kwargs",
                                                                                             "name"}:
      return f"item {i} must be a dict with a string 'fn' and optional 'weight', 'kwargs', 'name'"
    weight = term.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
      return f"item {i}: weight={weight!r} must be a finite number"
    if not isinstance(term.get("kwargs", {}), Mapping):
      return f"item {i}: kwargs must be a dict"
  return None


def _offloadable(v) -> str | None:
  bad = [c for c in v if c not in OFFLOAD_COMPONENTS]
  return f"{bad[0]!r} is not a component that can be offloaded; choose from {list(OFFLOAD_COMPONENTS)}" if bad else None


@dataclasses.dataclass(frozen=True)
class LearnerSection:
  """Learner memory: components kept in host memory between steps and streamed in for each step."""

  SECTION: ClassVar[str] = "learner"

  offload: tuple[str, ...] = setting((), "any of 'reference', 'optimizer', 'critic' (the separate model of "
                                     "model.critic_path)", check=_offloadable)

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class LoraSection:
  """LoRA adapters (rank 0 = full fine-tuning)."""

  SECTION: ClassVar[str] = "lora"

  rank: int = setting(0, "adapter rank; 0 trains all weights", check=non_negative)
  alpha: float = setting(16.0, "adapter scale is alpha / rank", check=positive)
  targets: tuple[str, ...] = setting(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     "projections to adapt")

  def __post_init__(self):
    check_fields(self)
    require(self.rank == 0 or len(self.targets) > 0, "lora.targets", self.targets, "must name a module")


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
  """The supervised stage (SFT) before RL, or alone with rl.num_steps=0: next-token training on
  data.answer_field or the assistant turns of data.messages_field (stops at the target accuracy)."""

  SECTION: ClassVar[str] = "warm_start"

  max_steps: int | None = setting(None, "supervised steps (0 = no supervised stage); None: 2000 (stopped at "
                                  "target_accuracy) when the built-in model starts from random weights and the data "
                                  "have answers, else 0", check=optional(non_negative), resumable=True)
  batch_size: int = setting(64, "rows per supervised step (sharded over the learner fsdp devices)", check=positive)
  learning_rate: float = setting(1e-3, "supervised steps tolerate a larger rate than RL (the rest of the optax "
                                 "chain is optim.*'s)", check=positive)
  target_accuracy: float = setting(0.2, "stop once held-out accuracy reaches it: a warm start that memorises stops "
                                   "exploring (1.0: run every max_steps step)",
                                   check=in_range(0, 1, low_open=True), resumable=True)
  eval_every: int = setting(25, "held-out loss and accuracy (greedy, scored by the first reward) this often",
                            check=positive, resumable=True)
  screen_prompts: int = setting(64, "held-out prompts decoded first at each evaluation: while their accuracy is "
                                "under half of target_accuracy the rest are not (0 = every prompt every time)",
                                check=non_negative, resumable=True)

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class EvalSection:
  SECTION: ClassVar[str] = "eval"
  RESUMABLE: ClassVar[bool] = True

  every_steps: int = setting(20, "held-out accuracy every this many RL steps, besides before and after RL (each "
                             "evaluated state is checkpointed, and the unlearning guard reads them); 0 = only "
                             "before and after", check=non_negative)
  unlearn_margin: float = setting(0.05, "held-out accuracy this far below the RL stage's start counts as unlearning "
                                  "(0.05 = 5 points)", check=in_range(0.0, 1.0))
  unlearn_evals: int = setting(2, "stop the run when this many evals in a row fall below the start by more than "
                               "eval.unlearn_margin; 0 = never", check=non_negative)
  timeout_s: float = setting(3600.0, "a held-out evaluation (every prompt's greedy completion, up to "
                             "sampler.max_new_tokens each) that takes longer stops with an error naming this key: "
                             "raise it for long completions on slow devices", check=positive)

  def __post_init__(self):
    check_fields(self)


def _needs_wandb(on: bool) -> str | None:
  """Found up front (without importing it: only the run does), so --check_only names the missing package."""
  if on and importlib.util.find_spec("wandb") is None:
    return "needs the wandb package: pip install wandb"
  return None


@dataclasses.dataclass(frozen=True)
class LogSection:
  SECTION: ClassVar[str] = "log"
  RESUMABLE: ClassVar[bool] = True

  tensorboard: bool = setting(True, "WORKDIR/tensorboard event files")
  progress_bar: bool = setting(True, "console progress bars of the warm start and of RL (off in tests and notebooks)")
  completions_every: int = setting(10, "every this many RL steps, append sampled completions (prompt, text, reward "
                                   "per term, length, finish reason, versions) to WORKDIR/completions.jsonl; 0 = off",
                                   check=non_negative)
  completions_groups: int = setting(4, "groups of the step's batch written each time (all their completions)",
                                    check=positive)
  schedule: bool = setting(True, "write WORKDIR/schedule.jsonl: what decided each step (its batch, the sampler's "
                           "weight swaps and admissions, the rewards as scored, a checksum of the weights), so "
                           "`python -m tunixlike.replay --workdir W` reruns the run and checks it step by step; the "
                           "step-0 checkpoint is kept for it (single-turn runs)")
  replay_every: int = setting(100, "with log.schedule, every this many RL steps a replay point: the sampler drains "
                              "(finishes its rollouts, takes the new weights), then a checkpoint is saved and kept, "
                              "which `tunixlike.replay --from-checkpoint` can start from; 0 = only where the run "
                              "started or resumed", check=non_negative)
  trace: bool = setting(False, "write WORKDIR/trace.json (Chrome / Perfetto) of sampler, learner, sync, reward spans")
  wandb: bool = setting(False, "also log every record to Weights & Biases (pip install wandb; WANDB_MODE=offline "
                               "keeps it in WORKDIR/wandb)", check=_needs_wandb)
  wandb_project: str = setting("tunixlike", "the W&B project of log.wandb",
                               check=lambda name: None if name else "must name a project")

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  SECTION: ClassVar[str] = "checkpoint"
  RESUMABLE: ClassVar[bool] = True

  every_steps: int = setting(50, "also saved at step 0, at evals, at the end, on SIGTERM / Ctrl-C and on a crash",
                             check=non_negative)
  every_seconds: float = setting(0.0, "0 = off; e.g. 600 on preemptible TPU VMs", check=non_negative)
  keep: int = setting(2, "latest checkpoints kept, plus the one with the best held-out accuracy", check=positive)
  keep_rollouts: bool = setting(True, "keep the rollouts in flight (tokens so far) in each checkpoint: a resume "
                                "continues them instead of decoding them again (rl/in_flight.py)")

  def __post_init__(self):
    check_fields(self)


@dataclasses.dataclass(frozen=True)
class Config:
  """The run's config. `sampler`, `algo`, `optim`, `rl` and `distributed` are the library's own configs."""

  SECTION: ClassVar[str] = ""

  seed: int = setting(0, "model init, sampling noise and data order all derive from it", check=_seed)
  rewards: tuple = setting((), "reward terms, each {fn, weight, kwargs}: fn a registered name, 'package.module:"
                           "function' or 'file.py:function'; () = the task's own", check=_reward_terms)
  model: ModelSection = ModelSection()
  mesh: MeshSection = MeshSection()
  data: DataSection = DataSection()
  sampler: SamplerConfig = SamplerConfig()
  algo: AlgoConfig = AlgoConfig()
  optim: OptimConfig = OptimConfig()
  learner: LearnerSection = LearnerSection()
  lora: LoraSection = LoraSection()
  rl: RuntimeConfig = RuntimeConfig()
  multi_agent: MultiAgentSection = MultiAgentSection()
  warm_start: WarmStartSection = WarmStartSection()
  eval: EvalSection = EvalSection()
  log: LogSection = LogSection()
  checkpoint: CheckpointSection = CheckpointSection()
  distributed: DistributedConfig = DistributedConfig()

  def __post_init__(self):
    check_fields(self)  # seed, rewards
    # Checks across sections.
    ppo = self.algo.estimator == "ppo"
    require(ppo or self.model.critic_path is None, "model.critic_path", self.model.critic_path,
            "a critic is only used with algo.estimator='ppo'")
    require(not ppo or self.lora.rank == 0, "lora.rank", self.lora.rank,
            "algo.estimator='ppo' trains the value head with the policy and does not support LoRA yet")
    # Whole sampler hosts hold the policy only: a critic or a teacher would live on the learner hosts.
    require(not self.mesh.sampler_hosts or not (ppo or self.model.teacher_path), "mesh.sampler_hosts",
            self.mesh.sampler_hosts, "is not supported with algo.estimator='ppo' or model.teacher_path yet")
    has_ref = self.lora.rank == 0 and (self.algo.kl_coef > 0 or (ppo and self.algo.kl_reward_coef > 0))
    require("reference" not in self.learner.offload or has_ref, "learner.offload", self.learner.offload,
            "'reference' does not exist: the reference copy is kept only with algo.kl_coef > 0 (or PPO's "
            "algo.kl_reward_coef > 0) and lora.rank=0")
    require("critic" not in self.learner.offload or (ppo and self.model.critic_path is not None), "learner.offload",
            self.learner.offload, "'critic' does not exist: only a separate critic model (algo.estimator='ppo' with "
            "model.critic_path) can be offloaded")
    self._check_token_advantages()
    require(not self.algo.keep_sampling_mask or self.sampler.record_sampling_mask, "algo.keep_sampling_mask",
            True, "needs sampler.record_sampling_mask=True (the sampler must ship the masks)")
    require(not self.algo.keep_routing or self.sampler.record_routing, "algo.keep_routing",
            True, "needs sampler.record_routing=True (the sampler must ship the experts it chose)")
    require(self.rl.agent is None or self.rl.env is None, "rl.agent", self.rl.agent,
            f"and rl.env={self.rl.env!r} are both set: an episode is run by one of them")
    require(self.rl.agent is None or not self.sampler.record_sampling_mask, "sampler.record_sampling_mask", True,
            "is not supported with rl.agent (agent turns are prefilled from the agent's history)")
    require(not self.sampler.record_routing or (self.rl.env is None and self.rl.agent is None
                                                and self.algo.estimator != "ppo"),
            "sampler.record_routing", True, "is supported for single-turn GRPO-family runs only (not rl.env or "
            "rl.agent episodes, whose environment tokens the decode loop never routes, nor algo.estimator='ppo')")
    require(not self.sampler.speculative or (self.rl.env is None and self.rl.agent is None), "sampler.speculative",
            True, "is for single-turn rollouts: rl.env and rl.agent turns are not drafted (set one or the other)")
    require(not self.rl.deterministic or (self.rl.env is None and self.rl.agent is None and not self.mesh.sampler_hosts),
            "rl.deterministic", True, "covers single-turn rollouts on one host's sampler: rl.env and rl.agent episodes "
            "take their turns when an outside program answers, and mesh.sampler_hosts decode on other hosts' clocks")
    # Sections whose run values come from other sections, checked by their own rules with those values.
    dataclasses.replace(self.sampler, group_size=self.algo.group_size)  # a group fits the decode slots
    dataclasses.replace(self.optim, total_steps=self.rl.num_steps)  # the cosine warm-up ends before the last step
    m = self.mesh
    replicas = m.sampler_size // m.sampler_tensor
    require(self.sampler.max_concurrent_decodes % replicas == 0, "sampler.max_concurrent_decodes",
            self.sampler.max_concurrent_decodes, "must be divisible by the number of sampler replicas "
            f"({m.sizes_named('sampler')} / mesh.sampler_tensor = {replicas})")
    self._check_shared_prompts()
    self.multi_agent.check_with(self)
    rows, what = ((self.rl.prompts_per_step, "prompts_per_step (optim.share_prompts: a row per group)")
                  if self.optim.share_prompts else
                  (self.rl.prompts_per_step * self.algo.group_size, "prompts_per_step * algo.group_size"))
    fsdp = m.learner_size // m.learner_tensor
    row_devices = 1 if self.optim.context_parallel else fsdp  # context parallelism splits tokens, not rows
    require(rows % (self.optim.micro_batches * row_devices) == 0, "rl.prompts_per_step", self.rl.prompts_per_step,
            f"{what} = {rows} must be divisible by optim.micro_batches * "
            f"learner fsdp devices = {self.optim.micro_batches} * {row_devices}"
            + ("" if m.layout == "split" else " (mesh.layout='colocated': the learner uses every device)"))
    d = self.data
    require(not self.warm_start.max_steps or d.train is None or d.answer_field is not None
            or d.messages_field is not None, "warm_start.max_steps", self.warm_start.max_steps,
            "the supervised stage on your own data needs its answers: set data.answer_field to the column holding "
            "them, or data.messages_field to chat messages with assistant turns")
    require(not self.warm_start.max_steps or self.warm_start.batch_size % fsdp == 0, "warm_start.batch_size",
            self.warm_start.batch_size, "must be divisible by the learner fsdp devices "
            f"({m.sizes_named('learner')} / mesh.learner_tensor = {fsdp}); the warm start shards its batch over them")
    require(self.sampler.max_prefill_length >= self.data.max_prompt_length, "data.max_prompt_length",
            self.data.max_prompt_length, f"must be <= sampler.max_prefill_length={self.sampler.max_prefill_length}")

  def _check_shared_prompts(self):
    """optim.share_prompts carries per-token advantages and counts sequences per segment: what needs
    one row per sequence (a sequence-level ratio or IS weight, a critic, per-row masks) is refused."""
    if not self.optim.share_prompts:
      return
    a = self.algo
    refused = [(a.estimator == "ppo", "algo.estimator='ppo' (its critic reads one row per sequence)"),
               (a.loss not in PPO_LOSSES, f"algo.loss={a.loss!r} (a ratio per sequence)"),
               (a.is_level != "token", f"algo.is_level={a.is_level!r} (an IS weight per sequence)"),
               (a.keep_sampling_mask, "algo.keep_sampling_mask"), (a.keep_routing, "algo.keep_routing")]
    for bad, what in refused:
      require(not bad, "optim.share_prompts", True, f"is not supported with {what}")

  def _check_token_advantages(self):
    """Process rewards and on-policy distillation: per-token advantages in the GRPO-family step."""
    a, s = self.algo, self.sampler
    distill = a.advantage == "distill"
    require(distill == (self.model.teacher_path is not None), "model.teacher_path", self.model.teacher_path,
            "on-policy distillation needs both algo.advantage='distill' and model.teacher_path (the teacher's HF dir)")
    if a.process_reward is not None:
      from tunixlike.rewards import process  # the PRM registry (a leaf module: numpy only)
      require(a.process_reward in process.process_reward_names() or ":" in a.process_reward, "algo.process_reward",
              a.process_reward, f"not a registered process reward ({process.process_reward_names()}) nor an import "
              "path 'package.module:function'")
      require(a.process_reward_coef > 0, "algo.process_reward_coef", a.process_reward_coef, "must be > 0")
      require(bool(a.step_delimiter) or a.step_every_tokens > 0, "algo.step_delimiter", a.step_delimiter,
              "a process reward needs step boundaries: a delimiter or algo.step_every_tokens > 0")
    if not (distill or a.process_reward is not None):
      return
    what = "algo.advantage='distill'" if distill else "algo.process_reward"
    require(a.loss in PPO_LOSSES, "algo.loss", a.loss,
            f"{what} gives per-token advantages: use one of {list(PPO_LOSSES)}")
    require(a.estimator == "grpo_family", "algo.estimator", a.estimator, f"{what} works with 'grpo_family' only")
    require(self.rl.env is None, "rl.env", self.rl.env, f"{what} is single-turn only")
    require(self.rl.agent is None, "rl.agent", self.rl.agent, f"{what} is single-turn only")
    if distill:  # the sampler's logprobs must be the student's own distribution for r_t to be the reverse KL
      require(s.temperature in (None, 1.0), "sampler.temperature", s.temperature,
              "distillation samples at temperature 1")
      require(s.top_k == 0 and s.top_p == 1.0, "sampler.top_k" if s.top_k else "sampler.top_p",
              s.top_k or s.top_p, "distillation samples the full distribution (top_k=0, top_p=1)")


# ---- the ConfigDict that config files and --config.a.b=v edit -------------------------------------
def _unset_type(hint: Any) -> type:
  """`str | None` -> str: the type of an optional key's placeholder."""
  return next(h for h in typing.get_args(hint) if h is not type(None))


def _config_dict(section) -> ml_collections.ConfigDict:
  hints = typing.get_type_hints(type(section))
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(section):
    if not is_key(f):
      continue
    value = getattr(section, f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = _config_dict(value)
    elif value is None:
      out[f.name] = placeholder(_unset_type(hints[f.name]))
    else:
      out[f.name] = value
  return out


def optional_keys(cls=None, prefix: str = "") -> set[str]:
  """The keys that may be None (`str | None`), e.g. 'data.task'."""
  cls = Config if cls is None else cls
  hints, out = typing.get_type_hints(cls), set()
  for f in dataclasses.fields(cls):
    if not is_key(f):
      continue
    if dataclasses.is_dataclass(f.default):
      out |= optional_keys(type(f.default), f"{prefix}{f.name}.")
    elif type(None) in typing.get_args(hints[f.name]):
      out.add(f"{prefix}{f.name}")
  return out


def default_config_dict() -> ml_collections.ConfigDict:
  """Every key of `Config` at its default: what `configs/*.py` start from."""
  return _config_dict(Config())


def parse_arg(arg: str | None, **spec) -> ml_collections.ConfigDict:
  """A config file's variant string (`configs/x.py:size=tiny,steps=10`) as a ConfigDict.

  `spec` names every key with its default; a tuple default lists the allowed values (the first is
  the default), any other default gives the type (int, float, bool or str).
  """
  out = ml_collections.ConfigDict({k: v[0] if isinstance(v, tuple) else v for k, v in spec.items()})
  expected = ", ".join(f"{k}={'|'.join(map(str, v)) if isinstance(v, tuple) else type(v).__name__}"
                       for k, v in spec.items())
  for item in filter(None, (arg or "").split(",")):
    key, eq, text = item.partition("=")
    if key not in spec or not eq:
      raise ValueError(f"unknown variant {item!r} in {arg!r} (expected {expected})")
    default = spec[key]
    try:
      if isinstance(default, tuple):
        if text not in default:
          raise ValueError
        value = text
      elif isinstance(default, bool):
        value = {"true": True, "false": False}[text.lower()]
      else:
        value = type(default)(text)
    except (ValueError, KeyError):
      raise ValueError(f"unknown variant {item!r} in {arg!r} (expected {expected})") from None
    out[key] = value
  return out


def load(path: str | os.PathLike, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of the config file at `path` (from any directory; `path:arg` also works), or of
  the shipped config of that name (`load("addition_grpo", "size=tiny")`, tunixlike/shipped_configs.py)."""
  path = os.fspath(path)
  if arg is None and ":" in os.path.basename(path):
    path, arg = path.rsplit(":", 1)
  path = shipped_configs.find(path)
  name = "tunixlike_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None:
    raise OSError(f"{path}: not a Python config file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return resolve_beside(module.get_config(arg), os.path.dirname(os.path.abspath(path)))


def _beside(value: str | None, directory: str) -> str | None:
  """`./x` or `../x` (a path, or the file of an import path `./x.py:fn`) made absolute under `directory`."""
  if isinstance(value, str) and value.startswith(("./", "../")):
    return os.path.normpath(os.path.join(directory, value))
  return value


def resolve_beside(config: ml_collections.ConfigDict, directory: str) -> ml_collections.ConfigDict:
  """A config file's paths that start with ./ or ../ (data.train, data.eval, rewards[i].fn, rl.env,
  rl.agent, algo.process_reward) are relative to the file's own directory: made absolute here."""
  if config is None:
    return config
  with config.unlocked() if hasattr(config, "unlocked") else contextlib.nullcontext():
    for section, key in (("data", "train"), ("data", "eval"), ("rl", "env"), ("rl", "agent"),
                         ("algo", "process_reward"), ("multi_agent", "env")):
      if section in config and key in config[section]:
        config[section][key] = _beside(config[section][key], directory)
    if "rewards" in config and config.rewards:
      config.rewards = tuple({**term, "fn": _beside(term["fn"], directory)} if isinstance(term, Mapping) and "fn" in term
                             else term for term in config.rewards)
  return config


# ---- ConfigDict -> Config -------------------------------------------------------------------------
def _is_instance(value: Any, hint: Any) -> bool:
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_is_instance(value, h) for h in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if hint is tuple or origin is tuple:  # a list too: a config read back from JSON (a checkpoint's meta) has lists
    item = typing.get_args(hint)[0] if typing.get_args(hint) else Any
    return isinstance(value, (tuple, list)) and (item is Any or all(_is_instance(v, item) for v in value))
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, hint)


def _type_error(name: str, value: Any, hint: Any) -> str:
  """`name=value: ...` for a value of the wrong type. A tuple of numbers says so: `--config.algo.reward_clip=
  (nan,1)` reaches here as the one string ml_collections could not read as numbers ('(nan,1)',)."""
  items = typing.get_args(hint) if typing.get_origin(hint) is tuple else ()
  if items and all(item is float for item in items):
    unread = isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], str)
    example = "(-1.0, 1.0)" if len(items) == 2 else f"({', '.join(['1.0'] * len(items))})"
    return (f"{name}={value[0] if unread else repr(value)}: must be {len(items)} finite numbers, e.g. {example} (nan "
            "and inf are not numbers a run can use)")
  return f"{name}={value!r}: wrong type {type(value).__name__}, expected {hint}"


def _build(cls, values: Mapping[str, Any], prefix: str):
  all_hints = typing.get_type_hints(cls)
  hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls) if is_key(f)}  # run values are not keys
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
      raise ConfigError(_type_error(name, value, hint))
    if isinstance(value, float) and not math.isfinite(value):  # inf passes every range check
      raise ConfigError(f"{name}={value!r}: must be finite")
    kwargs[key] = tuple(value) if isinstance(value, list) else (float(value) if hint is float else value)
  return cls(**kwargs)


def from_config_dict(config: Mapping[str, Any]) -> Config:
  """Builds and validates the typed config. Raises ConfigError naming the key and the value."""
  values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  return _build(Config, values, "")


def _keys_only(cls, values: Mapping[str, Any]) -> dict[str, Any]:
  """`values` without the run values (`settings.run_value`) that `dataclasses.asdict` also writes."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  out = {}
  for key, value in values.items():
    f = fields.get(key)
    if f is not None and not is_key(f):
      continue
    if f is not None and dataclasses.is_dataclass(f.default) and isinstance(value, Mapping):
      value = _keys_only(type(f.default), value)
    out[key] = value
  return out


def from_saved(saved: Mapping[str, Any]) -> Config:
  """The config a checkpoint's meta holds (`dataclasses.asdict` of it, through JSON: lists for
  tuples, the run values filled in) as a validated `Config`."""
  return from_config_dict(_keys_only(Config, saved))


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
  Also the data's presence: `tunixlike.train(dataset=rows)` supplies data the config does not name.
  """
  if config.data.task is None and config.data.train is None:
    raise ConfigError("data.task=None: needs a dataset instead: set data.train to a file, a glob or a directory")
  m = config.model
  for key, path, needs, revision in (("model.hf_path", m.hf_path, _HF_FILES + (("tokenizer.json",),), m.revision),
                                     ("model.critic_path", m.critic_path, _HF_FILES, None),
                                     ("model.teacher_path", m.teacher_path, _HF_FILES, None)):
    if path is None:
      continue
    from tunixlike.models import hub  # noqa: PLC0415 (huggingface_hub only when a model is named)
    if hub.is_hub_name(path):  # checked where it is cached; online, the run downloads it
      local = hub.cached(path, revision)
      if local is None and hub.offline():
        raise ConfigError(hub.not_cached(path, revision, key))
      if local is not None:
        _check_dir(f"{key} ({path!r} in the Hugging Face cache)", local, needs)
      continue
    _check_dir(key, path, needs)  # the run's tokenizer comes from model.hf_path's directory too
  if config.data.task == "gsm8k" and config.data.path is not None:  # None: the copy shipped with the package
    _check_dir("data.path", config.data.path, _GSM8K_FILES)


def replace(config: Config, **changes) -> Config:
  """`replace(cfg, rl=dict(num_steps=3))`: a copy with some keys of some sections changed."""
  out = {}
  for section, value in changes.items():
    current = getattr(config, section)
    out[section] = dataclasses.replace(current, **value) if isinstance(value, Mapping) else value
  return dataclasses.replace(config, **out)
