"""What a run is made of, built from the typed config: the pieces `trainer.run` sequences.

    setup = build(cfg)                 # meshes, tokenizer, task data, the model (before any training)
    warm_start(setup)                  # optional supervised warm start of setup.model
    rl = build_rl(setup)               # LoRA, the policy (learner), sampler engines, the reward stage
    runtime = make_runtime(setup, rl, PromptStream(setup.train_pipe))   # queue -> rewards -> driver -> loop
    runtime.hooks.add(lambda info: print(info.step, info.metrics["reward/mean"]))
    runtime.run()

Tests, benchmarks and notebooks use these directly. Several processes: every process builds the
same objects; data is sharded by process (see `trainer.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np
from flax import nnx

from tunixlike import device_turns, distributed, mesh as mesh_lib, models, rewards as rewards_lib, trace as trace_lib
from tunixlike import config as config_lib
from tunixlike.config import Config
from tunixlike.data import char_tokenizer, pipeline, tasks, tokenizer as tokenizer_lib
from tunixlike.learner import offload as offload_lib, ppo as ppo_lib, prompt_rows, value as value_lib
from tunixlike.learner.config import LearnerConfig
from tunixlike.learner.train_step import Learner
from tunixlike.models import attention, hub, lora as lora_lib, transformer
from tunixlike.rewards import loader, process as process_lib
from tunixlike.rewards.envs import Env
from tunixlike.rl import distill as distill_lib, evaluate as eval_lib, scoring, warm_start as warm_start_lib
from tunixlike.rl import in_flight, transport as transport_lib, truncation_guard, weight_sync
from tunixlike.agents.driver import AgentConfig, AgentDriver
from tunixlike.rl.collapse import CollapseConfig, CollapseDetector
from tunixlike.rl import policy as policy_lib
from tunixlike.rl.policy import Policy
from tunixlike.rl.in_process import InProcess
from tunixlike.rl import prompts as prompts_lib
from tunixlike.rl import starting_point
from tunixlike.rl.prompts import PromptStream, requests_for
from tunixlike.rl.config import AGENT_API_KEY_ENV, BUILT_IN_ENVS, RuntimeConfig
from tunixlike.rl.lockstep import LockstepQueue
from tunixlike.rl.queue import RolloutQueue
from tunixlike.rl.runtime import AsyncRuntime, RewardStage
from tunixlike.sampler.config import SamplerConfig
from tunixlike.sampler.driver import RolloutDriver
from tunixlike.sampler import make_engine
from tunixlike.sampler.engine import Engine
from tunixlike.sampler.episodes import EpisodeConfig, EpisodeDriver
from tunixlike.sampler.process_steps import ProcessRewardRecorder


# ---- config -> library configs -------------------------------------------------------------------
def learner_config(cfg: Config) -> LearnerConfig:
  """The algo and optim sections with their run values."""
  # The behaviour logprobs are at the sampler's temperature; the learner's must match.
  algo = dataclasses.replace(cfg.algo, sampling_temperature=cfg.sampler.temperature or 1.0)
  # rl.num_steps = 0 (the supervised stage only) still builds the learner whose state is saved; its
  # schedule is never stepped, but must be one (a cosine's last step after its warm-up).
  total = cfg.rl.num_steps or cfg.optim.warmup_steps + 1
  return LearnerConfig(algo=algo, optim=dataclasses.replace(cfg.optim, total_steps=total))


def sampler_config(cfg: Config, tok, decoders: int) -> SamplerConfig:
  """This process's sampler: the decode slots of sampler.max_concurrent_decodes are split over the
  `decoders` processes that decode (`Transport.decoders`; its checks see this process's share: a group
  must fit in it)."""
  slots = cfg.sampler.max_concurrent_decodes // decoders
  return dataclasses.replace(cfg.sampler, max_concurrent_decodes=slots, eos_ids=tuple(tok.stop_ids),
                             group_size=cfg.algo.group_size, seed=cfg.seed)


def start_processes(cfg: Config) -> InProcess:
  """This process's part of a multi-process run started, with the sampler side in every process
  (`InProcess`), and the keys that split across the processes checked. Before anything touches a JAX
  backend; a no-op when started already. The entry point starts other layouts (`tunixlike.layouts`)."""
  transport = InProcess(cfg, local_sampler_side)
  distributed.initialize(cfg.distributed)
  check_process_split(cfg, jax.process_count())
  return transport


def check_process_split(cfg: Config, n: int):
  """Keys that are totals over all hosts must split evenly across the `n` processes."""
  for key, total in (("rl.prompts_per_step", cfg.rl.prompts_per_step),
                     ("sampler.max_concurrent_decodes", cfg.sampler.max_concurrent_decodes)):
    if total % n:
      raise ValueError(f"{key}={total} must be divisible by the {n} processes (each host takes its share)")


# ---- before training: meshes, data, model ----------------------------------------------------------
Task = tasks.SyntheticTask | tasks.Gsm8kTask | tasks.DatasetTask  # a built-in task or the user's dataset


@dataclasses.dataclass(frozen=True)
class Setup:
  """The run's inputs, built once: nothing here changes afterwards except the weights of `model`."""

  cfg: Config
  meshes: mesh_lib.Meshes
  tok: tokenizer_lib.Tokenizer
  task: Task
  model: nnx.Module  # the policy on the learner submesh (warm-started in place); abstract where it only decodes
  train_pipe: pipeline.PromptPipeline | None  # None when built to sample a checkpoint (`build(training=False)`)
  eval_records: list  # this process's share of the held-out prompts
  tracer: trace_lib.Tracer
  transport: transport_lib.Transport  # the layout: where this process's work runs, and the way to the sampler side
  reward: rewards_lib.CombinedReward | None = None  # the training reward; its first term is the evals' verifier
  make_env: Callable[[], Env] | None = None  # rl.env: builds one `Env` per episode (None: single-turn)
  agent: Callable[..., Any] | None = None  # rl.agent: run_episode(base_url, api_key, episode_id, row), behind the agent server
  warm_start_records: list | None = None  # held-out set of the warm start: the same on every process
  critic: nnx.Module | None = None  # PPO's separate critic trunk (model.critic_path), on the learner mesh
  teacher: distill_lib.Teacher | None = None  # on-policy distillation's frozen teacher (model.teacher_path)


def with_inputs(cfg: Config, *, dataset=None, eval_dataset=None, env=None, agent=None) -> Config:
  """`cfg` with the inputs given in memory (`tunixlike.train(dataset=..., env=..., agent=...)`) standing
  in for the keys they replace (data.train, data.eval, rl.env, rl.agent), so that they go through the
  config's own checks (e.g. an agent and an env at once, a warm start on data without answers)."""
  def named(obj) -> str:
    return obj if isinstance(obj, str) else f"<in memory>:{getattr(obj, '__qualname__', type(obj).__name__)}"

  data = {key: named(value) for key, value in (("train", dataset), ("eval", eval_dataset)) if value is not None}
  rl = {key: named(value) for key, value in (("env", env), ("agent", agent)) if value is not None}
  return config_lib.replace(cfg, **{k: v for k, v in (("data", data), ("rl", rl)) if v})


def build_task(cfg: Config, dataset=None, eval_dataset=None):
  """(tokenizer, task): a character tokenizer for built-in tasks, the model's own for HF models.
  With data.train (or `dataset` / `eval_dataset` given in memory: a list of dicts, a grain
  MapDataset, a RecordSource) the task is the user's dataset, with data.task's rewards as its default."""
  if cfg.model.hf_path:
    tok = tokenizer_lib.load(hub.resolve(cfg.model.hf_path, cfg.model.revision))
  else:
    tok = char_tokenizer.build()
  d = cfg.data
  task = tasks.for_run(d, dataset, eval_dataset)
  if isinstance(task, tasks.DatasetTask):
    key, field = ("data.messages_field", d.messages_field) if d.messages_field else ("data.prompt_field", d.prompt_field)
    if field not in task.columns():  # said plainly, before the prompt template would say it its own way
      where = f"data.train={d.train!r}" if dataset is None else "the dataset given to tunixlike.train"
      raise ValueError(f"{key}={field!r}: {where} has no such column; its columns are {list(task.columns())}")
  return tok, task


def env_factory(cfg: Config, env=None):
  """What builds one environment per episode: `env` given in Python, or rl.env (built in or an import path)."""
  spec = env if env is not None else cfg.rl.env
  if spec is None:
    return None
  cls = loader.load(BUILT_IN_ENVS.get(spec, spec) if isinstance(spec, str) else spec, key="rl.env")
  if not callable(cls):
    raise loader.LoadError(f"rl.env={spec!r}: {cls!r} is not a class or factory of Env")
  return cls


def agent_function(cfg: Config, agent=None):
  """The user's agent loop: `agent` given in Python, or rl.agent (an import path), checked callable."""
  spec = agent if agent is not None else cfg.rl.agent
  if spec is None:
    return None
  fn = loader.load(spec, key="rl.agent")
  if not callable(fn):
    raise loader.LoadError(f"rl.agent={spec!r}: {fn!r} is not a function run_episode(base_url, api_key, episode_id, row)")
  return fn


def build_model(cfg: Config, tok, mesh, rules=mesh_lib.LEARNER_RULES, *, abstract: bool = False) -> nnx.Module:
  """The policy on `mesh` (the learner's; a sampler host's own with `mesh_lib.SAMPLER_RULES`).
  `abstract`: a built-in model's structure only (`nnx.eval_shape`: shapes, dtypes and sharding
  annotations; nothing compiled, computed or allocated), for a sampler host, whose weights all come
  from the learner hosts. A Hugging Face model is loaded either way (which checks its files)."""
  m = cfg.model
  if m.hf_path:
    return transformer.with_attention(models.from_pretrained(hub.resolve(m.hf_path, m.revision), mesh=mesh,
                                                             rules=rules, dtype=m.param_dtype),
                                      attention=m.attention, context_parallel_attention=m.context_parallel_attention,
                                      context_parallel_layout=m.context_parallel_layout)
  # The model section's sizes carry ModelConfig's own names; the vocabulary is the tokenizer's.
  sizes = {f.name: getattr(m, f.name) for f in dataclasses.fields(models.ModelConfig) if hasattr(m, f.name)}
  model_cfg = models.ModelConfig(vocab_size=tok.vocab_size, **sizes)
  check_fits(model_cfg, mesh)
  if abstract:
    return nnx.eval_shape(lambda: models.Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)))
  return models.create_sharded(model_cfg, mesh, rules, seed=cfg.seed)


def memory_per_device(device) -> tuple[int | None, str]:
  """(bytes one learner device can hold, what that is): an accelerator's own memory, or the host's
  physical memory for CPU devices (they share it). None when neither is known."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.platform.upper()} memory per device"
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
  except (ValueError, OSError, AttributeError):
    return None, "host memory"


def check_fits(model_cfg: models.ModelConfig, mesh) -> None:
  """Refuses, from the sizes alone (`jax.eval_shape`, nothing allocated), a model whose parameters
  cannot fit where the learner keeps them: one copy of the weights, before the optimizer's and the
  sampler's, is a floor that the run cannot go under."""
  abstract = nnx.state(nnx.eval_shape(lambda: models.Transformer(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
  leaves = jax.tree.leaves(abstract)
  n_params, n_bytes = sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)
  devices = mesh.devices.flatten()
  # Several processes: only this process's devices can report their memory.
  mine = [d for d in devices if d.process_index == jax.process_index()] or jax.local_devices()
  limit, what = memory_per_device(mine[0])
  if limit is None:
    return
  need = n_bytes if devices[0].platform == "cpu" else n_bytes / len(devices)  # sharded over the learner devices
  if need > limit:
    sizes = ", ".join(f"model.{k}={getattr(model_cfg, k)}" for k in ("hidden_size", "intermediate_size", "num_layers",
                                                                     "num_heads", "head_dim"))
    raise ValueError(f"{sizes}: the model has {n_params:,} parameters ({n_bytes / 2**30:,.1f} GiB in "
                     f"{model_cfg.param_dtype}), more than the {limit / 2**30:,.1f} GiB of {what}: lower the sizes")


def build(cfg: Config, trace_path: str | None = None, say=print, *, training: bool = True, dataset=None,
          eval_dataset=None, rewards=None, env=None, agent=None, transport=None) -> Setup:
  """Meshes, tokenizer, task, data, rewards and the (not yet warm-started) model on the learner submesh.
  `training=False`: only what sampling a checkpoint needs (no critic, no teacher, no training prompts). `dataset`,
  `eval_dataset`, `rewards`, `env` and `agent` are in-memory objects that replace data.train, data.eval,
  rewards, rl.env and rl.agent (see `tunixlike.train`). User code is loaded and checked before the model is built.
  A sampler.max_new_tokens left None is sized from the data (`sized_completions`), an optim.learning_rate,
  sampler.temperature or warm_start.max_steps left None chosen by what the run starts from (`starting_point`):
  `Setup.cfg` holds them. `transport`: the layout the entry point chose and started (None: the
  sampler side in every process, `start_processes`); the build asks it where this process's work runs."""
  with_inputs(cfg, dataset=dataset, eval_dataset=eval_dataset, env=env, agent=agent)  # the config's checks
  transport = transport or start_processes(cfg)
  wrong_backend = attention.backend_error(cfg.model.attention, jax.default_backend())
  if wrong_backend:  # before any compile: a backend's kernel elsewhere fails deep in tracing
    raise ValueError(wrong_backend)
  tok, task = build_task(cfg, dataset, eval_dataset)
  cfg, lines = starting_point.resolved(cfg)
  for line in lines:
    say(line)
  if cfg.sampler.max_new_tokens is None:  # sized once, here: the engines, the learner and the checkpoints take it
    limit, line = sized_completions(cfg, tok, task)
    say(line)
    cfg = config_lib.replace(cfg, sampler=dict(max_new_tokens=limit))
  # This process's share of the decode slots holds a group: checked before the model.
  sampler_config(cfg, tok, transport.decoders)
  terms = tasks.reward_terms(cfg.rewards, task, rewards)
  # What a reward can name besides the rollout's fields (`PromptStream` passes every other column).
  columns = ([c for c in task.columns() if c not in prompts_lib.NOT_COLUMNS] if isinstance(task, tasks.DatasetTask)
             else None)
  # Loaded and tried on two rows now, so that a bad import path, signature or count fails before any compilation.
  reward = rewards_lib.CombinedReward(terms, timeout_s=cfg.rl.reward_timeout_s, columns=columns)
  rows = [dict(task.source("train", seed=cfg.data.shuffle_seed)[i]) for i in range(2)]
  field = cfg.data.prompt_field if isinstance(task, tasks.DatasetTask) else "prompt"
  reward.check_counts([{k: v for k, v in r.items() if k not in prompts_lib.NOT_COLUMNS} for r in rows],
                      [str(r.get(field, "")) for r in rows])
  make_env = env_factory(cfg, env)
  agent = agent_function(cfg, agent)
  meshes = transport.meshes()
  # A process that only decodes computes only on its own devices, with the weights the learner's
  # processes send: its policy is only the structure its engine and weight receiver need (compiling
  # and running the initialiser there would cost it seconds of start-up for weights never used).
  model = (build_model(cfg, tok, meshes.learner) if transport.learns
           else build_model(cfg, tok, meshes.sampler, mesh_lib.SAMPLER_RULES, abstract=True))
  mesh_lib.check_whole_heads(model.cfg.num_heads, model.cfg.num_kv_heads, cfg.mesh.sampler_tensor,
                             cfg.mesh.learner_tensor)
  training = training and transport.learns
  critic = None
  if training and cfg.model.critic_path:  # loaded (and checked against the policy) before any training starts
    critic = value_lib.load_critic(hub.resolve(cfg.model.critic_path, key="model.critic_path"), model, mesh=meshes.learner, rules=mesh_lib.LEARNER_RULES,
                                   dtype=cfg.model.param_dtype)
  teacher = None
  if training and cfg.model.teacher_path:  # frozen, on the learner submesh; it scores groups in the reward stage
    teacher = distill_lib.Teacher.load(hub.resolve(cfg.model.teacher_path, key="model.teacher_path"), mesh=meshes.learner, rules=mesh_lib.LEARNER_RULES,
                                       dtype=cfg.model.param_dtype, vocab_size=model.cfg.vocab_size, pad_id=tok.pad_id)
  pipe_cfg = pipeline_config(cfg, transport.data_shard)
  # Not for an eval: the pipeline formats and tokenizes every training prompt up front (5 s for a built-in task).
  train_pipe = pipeline.from_task(task, tok, split="train", size=cfg.data.train_size,
                                  config=pipe_cfg) if training or not transport.learns else None
  eval_pipe = pipeline.from_task(task, tok, split="test", config=dataclasses.replace(pipe_cfg, shuffle=False,
                                                                                      num_epochs=1))
  # Each process evaluates its shard; together they cover data.num_eval_examples prompts.
  index, count = transport.data_shard
  n_local = len(range(index, cfg.data.num_eval_examples, count)) if transport.learns else 0
  eval_records = list(itertools.islice(iter(eval_pipe), n_local))
  warm_records = None
  if distributed.group_size() > 1 and cfg.warm_start.max_steps and transport.learns:
    # The warm start is a learner (global) computation: its held-out batch must be the same everywhere.
    whole = eval_pipe.resharded(shard_index=0, shard_count=1)
    warm_records = list(itertools.islice(iter(whole), cfg.data.num_eval_examples))
  if train_pipe is not None:
    if train_pipe.num_filtered:
      say(f"data: {train_pipe.num_filtered} train prompts longer than data.max_prompt_length dropped")
    if getattr(train_pipe.source, "skipped", 0):
      say(f"data: {train_pipe.source.skipped} bad lines skipped (data.skip_bad_lines)")
  train_bad = 0 if train_pipe is None else train_pipe.num_bad_rows
  if train_bad or eval_pipe.num_bad_rows:
    say(f"data: {train_bad} train and {eval_pipe.num_bad_rows} held-out rows whose prompt is not "
        "text skipped (data.skip_bad_lines)")
  return Setup(cfg, meshes, tok, task, model, train_pipe, eval_records, trace_lib.Tracer(trace_path),
               transport, reward=reward, make_env=make_env, agent=agent,
               warm_start_records=warm_records, critic=critic, teacher=teacher)


def pipeline_config(cfg: Config, shard: tuple[int, int], **changes) -> pipeline.PipelineConfig:
  """The prompt pipeline's settings from the data section, for `shard` (index, count) of the data
  (`Transport.data_shard`: this process's)."""
  index, count = shard
  return pipeline.PipelineConfig.from_config(cfg, **{"shard_index": index, "shard_count": count, **changes})


def example_format(cfg: Config) -> warm_start_lib.ExampleFormat:
  """Where the supervised stage finds a row's answer: data.answer_field (a built-in task's 'answer'),
  else the assistant turns of data.messages_field."""
  d = cfg.data
  if d.answer_field is None and d.messages_field is not None:
    return warm_start_lib.ExampleFormat(messages_field=d.messages_field, system_prompt=d.system_prompt)
  return warm_start_lib.ExampleFormat(answer_field=d.answer_field or "answer")


def longest_answer_in(cfg: Config, tok, records: Iterable[Mapping[str, Any]]) -> int | None:
  """The token length (with its end) of the longest answer (`example_format`'s) among `records`, or None
  when none has one."""
  fmt = example_format(cfg)
  return max((n for r in records if (n := warm_start_lib.answer_length(r, tok, fmt)) is not None), default=None)


def longest_answer(setup: Setup) -> int | None:
  """The longest answer among the held-out rows (`longest_answer_in`): what sampler.max_new_tokens must
  fit for the evaluations to be whole."""
  records = setup.eval_records if setup.warm_start_records is None else setup.warm_start_records
  return longest_answer_in(setup.cfg, setup.tok, records)


NO_ANSWERS = ("sampler.max_new_tokens is not set and the data has no answer column to size it from: set "
              "sampler.max_new_tokens (or data.answer_field)")


def sized_completions(cfg: Config, tok, task: Task) -> tuple[int, str]:
  """(sampler.max_new_tokens, the line that says why) for a config that leaves it None: the longest
  answer with its end (data.answer_field, a built-in task's 'answer', or the last assistant turn of
  data.messages_field) among every training and held-out row the run reads, plus room
  (`fitting_limit`). Every row, not this process's shard: every process sizes alike. Refuses, naming
  the key, when no row has an answer."""
  d = cfg.data
  splits = (task.source("train", size=d.train_size, seed=d.shuffle_seed), task.source("test", seed=d.shuffle_seed))
  longest = longest_answer_in(cfg, tok, (rows[i] for rows in splits for i in range(len(rows))))
  if longest is None:
    raise ValueError(NO_ANSWERS)
  limit = truncation_guard.fitting_limit([longest])
  column = (f"data.answer_field {d.answer_field!r}" if d.answer_field is not None
            else f"the last assistant turns of data.messages_field {d.messages_field!r}" if d.messages_field
            else "the 'answer' column")
  return limit, (f"sampler.max_new_tokens={limit}: the longest answer in {column} is {longest} tokens with its "
                 "end, plus room (set sampler.max_new_tokens to choose)")


def warm_start(setup: Setup, say=print, should_stop=lambda: False, on_step=lambda step, metrics: None,
               on_eval=lambda metrics: None, optimizer=None, start_step: int = 0) -> dict[str, float]:
  """The supervised stage on `setup.model` (`warm_start_lib`); an interrupted one continues from
  `start_step` with its `optimizer`. Every process trains on the same batches (a learner computation:
  the batch is sharded over the learner mesh), drawn from the whole training set in a seeded order."""
  cfg, tok = setup.cfg, setup.tok
  pipe = setup.train_pipe.resharded(shard_index=0, shard_count=1)
  records = (pipe.dataset[i] for i in itertools.count(start_step * cfg.warm_start.batch_size))
  held_out = setup.eval_records if setup.warm_start_records is None else setup.warm_start_records
  engine = make_engine(setup.model, eval_lib.eval_sampler_config(sampler_config(cfg, tok, setup.transport.decoders)),
                       mesh=setup.meshes.sampler)
  correctness = correctness_reward(setup)

  def evaluate_held_out(limit: int | None) -> dict:  # greedy, scored by the first reward's verifier, as the RL evals
    params, _ = weight_sync.sync(nnx.state(setup.model), engine.param_shardings, dtype=cfg.rl.sync_dtype)
    return evaluate_params(setup, engine, params, correctness, limit=limit)

  stage = warm_start_lib.SupervisedStage(setup.model, tok, cfg.warm_start, example_format(cfg),
                                         length=cfg.data.max_prompt_length + cfg.sampler.max_new_tokens,
                                         mesh=setup.meshes.learner, optimizer=optimizer, optim=cfg.optim)
  return stage.run(records, held_out, evaluate_held_out, start_step=start_step, log=say, should_stop=should_stop,
                   on_step=on_step, on_eval=on_eval)


# ---- RL: the policy, the sampler, the reward stage ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RLStack:
  """The objects the RL loop runs; each owns its own state (the policy owns the learner state)."""

  policy: Policy  # owns the learner state and its version; its `weight_sync` feeds `engine`
  engine: Engine | None  # the rollout sampler (None where the sampler side is elsewhere: `Transport.engine`)
  eval_engine: Engine  # greedy decoding of the held-out prompts, on the same devices
  scorer: scoring.GroupScorer  # the reward stage, run on the reward workers
  correctness: rewards_lib.CombinedReward  # the 0/1 verifier the evals score with

  def close(self):
    self.scorer.close()


def build_learner(cfg: Config, model: nnx.Module, mesh, critic: nnx.Module | None = None):
  """The GRPO-family Learner, or for algo.estimator='ppo' a PPOLearner over the policy plus a value
  head (on the policy trunk, or on `critic`); wrapped to keep learner.offload components on the host."""
  a, rules = cfg.algo, mesh_lib.LEARNER_RULES
  if a.estimator == "ppo":
    # The head starts at V = 0 (zero kernel; it gets gradient from the first step on): an untrained
    # critic's random values would otherwise be the advantage of every failed completion.
    both = (value_lib.PolicyWithValue.create(model, seed=cfg.seed, init_std=0.0) if critic is None
            else value_lib.PolicyWithCritic.create(model, critic, seed=cfg.seed, init_std=0.0))
    learner = ppo_lib.PPOLearner(both, learner_config(cfg), mesh=mesh, rules=rules)
  else:
    learner = Learner(model, learner_config(cfg), mesh=mesh, rules=rules)
  if cfg.learner.offload:
    learner = offload_lib.OffloadedLearner(learner, cfg.learner.offload)
  return learner


def policy_model(setup: Setup) -> nnx.Module:
  """`setup.model` with LoRA adapters when lora.rank > 0 (the base weights frozen), else itself."""
  cfg = setup.cfg
  if not cfg.lora.rank:
    return setup.model
  lora = lora_lib.LoRAConfig.from_config(cfg)
  return lora_lib.apply_lora(setup.model, lora, seed=cfg.seed, mesh=setup.meshes.learner, rules=mesh_lib.LEARNER_RULES)


def policy_rows(cfg: Config, num_processes: int, share_prompts: bool) -> tuple[int, tuple[int, ...]]:
  """(this process's rows of each learner batch, the sequence lengths they are padded to): a row per
  completion, or with `share_prompts` a row per group (packed up to optim.pack_tokens a row)."""
  longest = cfg.sampler.max_prefill_length + cfg.sampler.max_new_tokens
  if share_prompts:
    return (cfg.rl.prompts_per_step // num_processes,
            prompt_rows.row_buckets(cfg.optim.pack_tokens or longest * cfg.algo.group_size))
  return cfg.rl.prompts_per_step * cfg.algo.group_size // num_processes, policy_lib.length_buckets(longest)


def build_policy(cfg: Config, learner, engine: Engine | None, pad_id: int, *, tracer=trace_lib.NULL_TRACER,
                 rows: int | None = None, share_prompts: bool | None = None,
                 sync: weight_sync.WeightSync | None = None) -> Policy:
  """The policy over `learner` with its weight sync to `engine`'s shardings (rl.sync_dtype), or
  `sync`. `rows` and `share_prompts` replace the run's (`policy_rows`, optim.share_prompts)."""
  sync = sync or weight_sync.for_learner(learner, engine.param_shardings, dtype=cfg.rl.sync_dtype, tracer=tracer)
  n_proc = 1 if learner.mesh is None else len({d.process_index for d in learner.mesh.devices.flat})
  share = cfg.optim.share_prompts if share_prompts is None else share_prompts
  run_rows, buckets = policy_rows(cfg, n_proc, share)
  return Policy(learner, sync, rows=run_rows if rows is None else rows, seq_buckets=buckets, pad_id=pad_id,
                seed=cfg.seed, share_prompts=share, routing=cfg.sampler.record_routing, tracer=tracer)


def correctness_reward(setup: Setup) -> rewards_lib.CombinedReward:
  """The 0/1 verifier evals score with (the first reward term), not the shaped training reward."""
  return rewards_lib.CombinedReward(setup.reward.specs[:1], timeout_s=setup.cfg.rl.reward_timeout_s)


def build_rl(setup: Setup, *, reward: rewards_lib.CombinedReward | None = None,
             correctness: rewards_lib.CombinedReward | None = None) -> RLStack:
  """LoRA (if configured), the policy, the sampler engines and the reward stage. `reward` and
  `correctness` replace the task's training reward and its eval verifier."""
  cfg, tok, transport = setup.cfg, setup.tok, setup.transport
  model = policy_model(setup)
  learner = build_learner(cfg, model, setup.meshes.learner, critic=setup.critic)
  s_cfg = sampler_config(cfg, tok, transport.decoders)
  engine = transport.engine(lambda: make_engine(model, s_cfg, mesh=setup.meshes.sampler))
  eval_engine = make_engine(model, eval_lib.eval_sampler_config(s_cfg), mesh=setup.meshes.sampler)
  sync = transport.weight_sync(setup, learner)
  policy = build_policy(cfg, learner, engine, tok.pad_id, tracer=setup.tracer, sync=sync)
  correctness = correctness or correctness_reward(setup)
  return RLStack(policy, engine, eval_engine, build_scorer(setup, reward), correctness)


def build_scorer(setup: Setup, reward: rewards_lib.CombinedReward | None = None) -> scoring.GroupScorer:
  """The reward stage's scorer: `reward` (default the task's), process rewards, the teacher."""
  cfg, tok = setup.cfg, setup.tok
  reward = reward or setup.reward
  a, process = cfg.algo, None
  if a.process_reward is not None:  # PRM calls run on their own daemon threads while the sampler decodes
    steps = process_lib.StepConfig.from_config(cfg)
    prm = (process_lib.get_process_reward(a.process_reward) if a.process_reward in process_lib.process_reward_names()
           else loader.load(a.process_reward, key="algo.process_reward"))
    process = process_lib.ProcessRewardScorer(prm, name=a.process_reward, steps=steps, tracer=setup.tracer)
  return scoring.GroupScorer(reward, tokenizer=tok, advantages=scoring.advantage_config(cfg),
                             primary=reward.specs[0].name, process=process, teacher=setup.teacher,
                             tracer=setup.tracer)


def evaluate(setup: Setup, rl: RLStack) -> dict[str, Any]:
  """Held-out accuracy of the policy (see `evaluate_params`), with the weights the transport gives
  the eval engine (`Transport.eval_weights`)."""
  params, version = setup.transport.eval_weights(setup, rl)
  with setup.tracer.span("eval", cat="eval", version=version):
    return evaluate_params(setup, rl.eval_engine, params, rl.correctness, version=version)


def evaluate_params(setup: Setup, engine, params, correctness, *, version: int = 0,
                    limit: int | None = None) -> dict[str, Any]:
  """Greedy completions of the held-out prompts (the first `limit` of them; None: all) scored by
  `correctness`; on several processes each evaluates its shard and the numbers are combined (weighted
  by prompts), so every process reports the same result."""
  records = setup.eval_records
  if limit is not None:
    records = records[:max(1, limit // distributed.group_size())]
  out = eval_lib.evaluate(engine, params, requests_for(records), correctness, setup.tok, version=version,
                          timeout_s=setup.cfg.eval.timeout_s)
  if distributed.group_size() == 1:
    return out
  keys = sorted(k for k in out if k != "eval/num_prompts")
  counts = [k for k in keys if k.endswith("failures")]  # summed over processes, the rest averaged
  n = out["eval/num_prompts"]
  rows = distributed.allgather(np.array([n] + [out[k] * (1 if k in counts else n) for k in keys], np.float32))
  total = float(rows[:, 0].sum())
  return {"eval/num_prompts": int(total), **{k: float(rows[:, 1 + i].sum() / (1.0 if k in counts else max(total, 1.0)))
                                             for i, k in enumerate(keys)}}


def collapse_detector(cfg: Config, policy: Policy) -> CollapseDetector:
  return CollapseDetector(CollapseConfig.from_config(cfg, vocab_size=policy.model().cfg.vocab_size))


def make_queue(cfg: Config, policy: Policy, stream, counts: dict | None = None,
               kept: in_flight.Kept | None = None) -> RolloutQueue:
  """The rollout queue: this process's share of every batch, admission from the policy's version;
  `counts` (a checkpoint's `queue.counts()`) continues its counters and `kept` (its rollouts in
  flight) are admitted again. With rl.deterministic a `LockstepQueue`, which starts with the kept
  groups and reads `stream`'s position at each round. Built before the driver and the runtime,
  which it is handed to."""
  batch_groups = cfg.rl.prompts_per_step // policy.num_processes
  kept = kept or in_flight.Kept(scored=[], in_flight=[], next_seq=0)
  if cfg.rl.deterministic:
    return LockstepQueue(batch_groups, cfg.rl.max_staleness, stream_position=lambda: stream.position,
                         start_version=policy.version, counts=counts, pending=kept.scored)
  return RolloutQueue(batch_groups, cfg.rl.max_staleness, start_version=policy.version, counts=counts,
                      carried=kept.scored, continued=len(kept.in_flight), first_seq=kept.next_seq)


def make_driver(setup: Setup, engine: Engine, scorer: scoring.GroupScorer, stream, queue, sink, synced, *,
                turns=device_turns.NO_TURNS, say=print, on_step=None, resume=()) -> RolloutDriver:
  """The driver of this run's rollouts on `engine` (single-turn, env episodes, or the user's agent
  behind its server), from `synced` weights and version; its admission is `queue.try_admit` (a
  `RolloutQueue`, or a sampler host's `hosts.rollouts.RemoteAdmission`); not started. `on_step`:
  the driver's (what `rl.schedule` records); `resume`: a checkpoint's groups in flight it continues."""
  cfg, tok, tracer = setup.cfg, setup.tok, setup.tracer
  common = dict(source=stream, sink=sink, version=synced.version, may_start_group=queue.try_admit, tracer=tracer)
  if setup.agent is not None:  # the user's agent loop, served over HTTP on the same decode slots
    driver = AgentDriver(engine, synced.params, agent=setup.agent, tokenizer=tok,
                         agent_config=AgentConfig.from_config(
                             cfg, api_key=os.environ.get(AGENT_API_KEY_ENV) or None), **common)
    say(f"agent server: {driver.base_url} (model {driver.model_name!r})")
  elif setup.make_env is None:
    # Process rewards: step prefixes go to the PRM threads while decoding goes on.
    recorders = [] if scorer.process is None else [ProcessRewardRecorder(scorer.process, tok.decode)]
    # rl.deterministic: rounds (Config refuses it with episodes and agents).
    rounds = queue.next_round if isinstance(queue, LockstepQueue) else None
    driver = RolloutDriver(engine, synced.params, recorders=recorders, detokenize=tok.decode, on_step=on_step,
                           first_seq=getattr(queue, "first_seq", 0), next_round=rounds, resume=resume, **common)
  else:  # Config refuses what episodes cannot record (process rewards, routing).
    driver = EpisodeDriver(engine, synced.params, make_env=setup.make_env, detokenize=tok.decode,
                           tokenize=lambda text: tok.encode(text, add_special_tokens=False),
                           episode_config=EpisodeConfig.from_config(cfg), **common)
  driver.turns = turns
  return driver


def runtime_config(cfg: Config, policy: Policy) -> RuntimeConfig:
  """The loop's settings: `rl`, with this process's share of every batch and algo.dynamic_sampling."""
  return dataclasses.replace(cfg.rl, prompts_per_step=cfg.rl.prompts_per_step // policy.num_processes,
                             dynamic_sampling=cfg.algo.dynamic_sampling)


def first_weights(setup: Setup, rl: RLStack) -> weight_sync.Synced:
  """The sampler's first weights, every decode program compiled with them first (sampler.warmup)."""
  synced = rl.policy.sync_weights()
  if setup.cfg.sampler.warmup:  # every decode program compiled now, not in the middle of the run
    with setup.tracer.span("sampler_warmup", cat="sampler"):
      rl.engine.warmup(synced.params)
      if rl.policy.lora:  # later syncs hand over packed adapters (`WithAdapters`): their programs too
        synced = rl.policy.sync_weights()
        rl.engine.warmup(synced.params)
  return synced


def local_sampler_side(setup: Setup, rl: RLStack, stream, queue, *, say=print, on_sampler_step=None,
                       resume=()) -> transport_lib.SamplerSide:
  """The sampler side in this process (`in_process.InProcess`): the reward stage and the driver, each
  handed to the next, from the first weights (every decode program compiled first, sampler.warmup)."""
  cfg = setup.cfg
  synced = first_weights(setup, rl)
  rewards = RewardStage(rl.scorer, queue, cfg.rl.reward_workers)
  turns = device_turns.DeviceTurns(cfg.rl.wait_timeout_s) if setup.meshes.colocated else device_turns.NO_TURNS
  driver = make_driver(setup, rl.engine, rl.scorer, stream, queue, rewards, synced, turns=turns, say=say,
                       on_step=on_sampler_step, resume=resume)
  if isinstance(queue, LockstepQueue):  # a checkpoint does not wait for a sampler that died
    queue.sampler_alive = lambda: driver.running
  return transport_lib.SamplerSide(driver, rewards, turns)


def make_runtime(setup: Setup, rl: RLStack, stream: PromptStream, *, num_steps: int | None = None,
                 collapse: CollapseDetector | None = None, queue: RolloutQueue | None = None,
                 say=print, on_fault=None, on_sampler_step=None, resume=()) -> AsyncRuntime:
  """The async loop over `stream`'s prompts: the queue (`make_queue`, or `queue`), the sampler side
  through the run's transport (`Transport.sampler_side`: here, the reward stage and the driver with
  every decode program compiled first), the runtime, each handed to the next. Add the run's periodic
  work with `runtime.hooks.add(fn, every=N)`. `on_fault(error)`: what this process does when the other
  end fails while the loop is stuck (`hosts.learner_host.RemoteSampling`). `on_sampler_step`: the
  driver's `on_step`; `resume`: the groups in flight it continues (`rl/in_flight.py`)."""
  cfg, policy = setup.cfg, rl.policy
  queue = queue or make_queue(cfg, policy, stream)
  side = setup.transport.sampler_side(setup, rl, stream, queue, say=say, on_fault=on_fault,
                                          on_sampler_step=on_sampler_step, resume=resume)
  # Each process's queue admits its own share of every batch (`runtime_config`).
  runtime = AsyncRuntime(runtime_config(cfg, policy), queue=queue, rewards=side.rewards, driver=side.driver,
                         policy=policy, collapse=collapse, num_steps=num_steps, turns=side.turns)
  for hook in side.hooks:
    runtime.hooks.add(hook)
  return runtime
