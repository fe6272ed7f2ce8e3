"""`run(config, workdir)`: builds meshes, task, model, learner, sampler and runtime from the typed
config, then warm start -> eval -> async RL -> eval, with metrics, TensorBoard, trace and a plot.

Several processes (hosts, `tunixlike.distributed`): every process runs this same program. The
learner loop runs in lockstep on all of them (each contributes its own share of every batch,
`prompts_per_step / process_count` groups from its own sampler and data shard); each sampler decodes
on its own host; evals combine every host's shard; process 0 writes WORKDIR/metrics.jsonl and the
plot, process i > 0 writes its own logs under WORKDIR/process_i/. Decisions that lead to global
computations and depend on local state (preemption, time-based checkpoints) are agreed on first.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
import tempfile
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tunixlike import distributed
from tunixlike import mesh as mesh_lib
from tunixlike import metrics as metrics_lib
from tunixlike import checkpoint as checkpoint_lib
from tunixlike import models, rewards, trace as trace_lib, workdir as workdir_lib
from tunixlike.rewards.envs import CalculatorEnv
from tunixlike.config import Config
from tunixlike.data import char_tokenizer, pipeline, tasks, tokenizer as tokenizer_lib
from tunixlike.learner.config import LearnerConfig
from tunixlike.learner import offload as offload_lib, ppo as ppo_lib, value as value_lib
from tunixlike.learner.train_step import Learner
from tunixlike.models import lora as lora_lib
from tunixlike.rl import collapse as collapse_lib, distill as distill_lib, evaluate as eval_lib
from tunixlike.rl import resume as resume_lib, warm_start as warm_start_lib
from tunixlike.rewards import process as process_lib
from tunixlike.sampler.process_driver import ProcessRewardDriver
from tunixlike.rl.policy import PolicyLearner
from tunixlike.rl.preemption import Preemption
from tunixlike.rl.prompts import PromptStream, requests_for
from tunixlike.rl.runtime import AsyncRuntime
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler.config import SamplerConfig
from tunixlike.sampler.driver import RolloutDriver
from tunixlike.sampler.engine import Engine
from tunixlike.sampler.episodes import EpisodeConfig, EpisodeDriver

log = logging.getLogger("tunixlike")


# ---- building blocks ----------------------------------------------------------------------------
def build_task(cfg: Config):
  """(tokenizer, task): a character tokenizer for built-in tasks, the model's own for HF models."""
  if cfg.model.hf_path:
    tok = tokenizer_lib.load(cfg.model.hf_path)
  else:
    tok = char_tokenizer.build()
  kwargs = {"digits": cfg.data.digits} if cfg.data.task == "addition" else {}
  if cfg.data.task == "gsm8k":
    kwargs = {} if cfg.data.path is None else {"path": cfg.data.path}
  return tok, tasks.get(cfg.data.task, **kwargs)


def build_model(cfg: Config, tok, mesh) -> nnx.Module:
  m = cfg.model
  if m.hf_path:
    return models.from_pretrained(m.hf_path, mesh=mesh, rules=mesh_lib.LEARNER_RULES, dtype=m.param_dtype)
  # The model section's sizes carry ModelConfig's own names; the vocabulary is the tokenizer's.
  sizes = {f.name: getattr(m, f.name) for f in dataclasses.fields(models.ModelConfig) if hasattr(m, f.name)}
  return models.create_sharded(models.ModelConfig(vocab_size=tok.vocab_size, **sizes), mesh, mesh_lib.LEARNER_RULES,
                               seed=cfg.seed)


def learner_config(cfg: Config) -> LearnerConfig:
  """The algo and optim sections with their run values."""
  # The behaviour logprobs are at the sampler's temperature; the learner's must match.
  algo = dataclasses.replace(cfg.algo, sampling_temperature=cfg.sampler.temperature or 1.0)
  return LearnerConfig(algo=algo, optim=dataclasses.replace(cfg.optim, total_steps=cfg.rl.num_steps))


def sampler_config(cfg: Config, tok) -> SamplerConfig:
  """This process's sampler: the decode slots of sampler.max_concurrent_decodes are split over the hosts."""
  slots = cfg.sampler.max_concurrent_decodes // jax.process_count()
  return dataclasses.replace(cfg.sampler, max_concurrent_decodes=slots, eos_ids=tuple(tok.stop_ids),
                             group_size=cfg.algo.group_size, seed=cfg.seed)


# ---- the run -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Parts:
  """Everything a run is made of (tests and notebooks build these and drive them directly)."""

  cfg: Config
  meshes: mesh_lib.Meshes
  tok: Any
  task: Any
  model: nnx.Module
  train_pipe: Any
  eval_records: list  # this process's share of the held-out prompts
  tracer: Any
  say: Any = print
  policy: PolicyLearner | None = None
  engine: Engine | None = None
  eval_engine: Engine | None = None
  train_reward: Any = None
  correctness: Any = None
  warm_start_records: list | None = None  # held-out set of the warm start: the same on every process
  critic: nnx.Module | None = None  # PPO's separate critic trunk (model.critic_path), on the learner mesh
  teacher: distill_lib.Teacher | None = None  # on-policy distillation's frozen teacher (model.teacher_path)
  process_scorer: process_lib.ProcessRewardScorer | None = None  # algo.process_reward's PRM worker threads


def _check_process_split(cfg: Config, n: int):
  """Keys that are totals over all hosts must split evenly across the `n` processes."""
  if n == 1:
    return
  if cfg.rl.prompts_per_step % n:
    raise ValueError(f"rl.prompts_per_step={cfg.rl.prompts_per_step} must be divisible by the {n} processes "
                     "(each host samples its share of every batch)")
  slots = cfg.sampler.max_concurrent_decodes // n
  if cfg.sampler.max_concurrent_decodes % n or slots < cfg.algo.group_size:
    raise ValueError(f"sampler.max_concurrent_decodes={cfg.sampler.max_concurrent_decodes} must split over the "
                     f"{n} processes into at least algo.group_size={cfg.algo.group_size} slots each")


def is_remote(workdir: str) -> bool:
  return "://" in workdir


def local_dir(workdir: str) -> str:
  """Where this process writes its own logs: WORKDIR for process 0, WORKDIR/process_i otherwise.

  A remote WORKDIR (gs://...) holds the checkpoints (orbax writes there directly); logs, which are
  appended to line by line, go to a local mirror that `upload_logs` copies to WORKDIR/logs.
  """
  root = workdir
  if is_remote(workdir):
    root = os.path.join(tempfile.gettempdir(), "tunixlike_logs", re.sub(r"[^\w.-]+", "_", workdir))
  i = jax.process_index()
  return root if i == 0 else os.path.join(root, f"process_{i}")


def upload_logs(workdir: str, say=print):
  """Copies this process's local log mirror to WORKDIR/logs (remote workdirs only)."""
  if not is_remote(workdir):
    return
  from etils import epath
  local = local_dir(workdir)
  for root, _, files in os.walk(local):
    for name in files:
      path = os.path.join(root, name)
      target = epath.Path(workdir) / "logs" / os.path.relpath(path, local)
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(open(path, "rb").read())
  say(f"logs copied from {local} to {workdir}/logs")


def initialize_distributed(cfg: Config) -> bool:
  """`jax.distributed` from the config's `distributed` section (or JAX_* env vars); see distributed.py."""
  return distributed.initialize(cfg.distributed)


def build(cfg: Config, workdir: str | None = None, say=print) -> Parts:
  """Meshes, tokenizer, task, data and the (not yet warm-started) model on the learner submesh."""
  initialize_distributed(cfg)
  _check_process_split(cfg, jax.process_count())
  meshes = mesh_lib.make_meshes(cfg.mesh.sampler_devices, cfg.mesh.learner_devices, cfg.mesh.sampler_tensor,
                                cfg.mesh.learner_tensor)
  tok, task = build_task(cfg)
  tracer = trace_lib.Tracer(os.path.join(local_dir(workdir), "trace.json") if cfg.log.trace and workdir else None)
  model = build_model(cfg, tok, meshes.learner)
  critic = None
  if cfg.model.critic_path:  # loaded (and checked against the policy) before any training starts
    critic = value_lib.load_critic(cfg.model.critic_path, model, mesh=meshes.learner, rules=mesh_lib.LEARNER_RULES,
                                   dtype=cfg.model.param_dtype)
  teacher = None
  if cfg.model.teacher_path:  # frozen, on the learner submesh; it scores groups in the reward stage
    teacher = distill_lib.Teacher.load(cfg.model.teacher_path, mesh=meshes.learner, rules=mesh_lib.LEARNER_RULES,
                                       dtype=cfg.model.param_dtype, vocab_size=model.cfg.vocab_size, pad_id=tok.pad_id)
  pipe_cfg = pipeline.PipelineConfig(seed=cfg.data.shuffle_seed, shard_index=jax.process_index(),
                                     shard_count=jax.process_count(), max_prompt_tokens=cfg.data.max_prompt_length)
  train_pipe = pipeline.from_task(task, tok, split="train", config=pipe_cfg)
  eval_pipe = pipeline.from_task(task, tok, split="test", config=dataclasses.replace(pipe_cfg, shuffle=False,
                                                                                      num_epochs=1))
  # Each process evaluates its shard; together they cover data.num_eval_examples prompts.
  n_local = len(range(jax.process_index(), cfg.data.num_eval_examples, jax.process_count()))
  eval_records = list(itertools.islice(iter(eval_pipe), n_local))
  warm_records = None
  if jax.process_count() > 1 and cfg.warm_start.max_steps:
    # The warm start is a learner (global) computation: its held-out batch must be the same everywhere.
    whole = pipeline.from_task(task, tok, split="test", config=dataclasses.replace(
        pipe_cfg, shuffle=False, num_epochs=1, shard_index=0, shard_count=1))
    warm_records = list(itertools.islice(iter(whole), cfg.data.num_eval_examples))
  if train_pipe.num_filtered:
    say(f"data: {train_pipe.num_filtered} train prompts longer than data.max_prompt_length dropped")
  return Parts(cfg, meshes, tok, task, model, train_pipe, eval_records, tracer, say,
               warm_start_records=warm_records, critic=critic, teacher=teacher)


def warm_start(parts: Parts, should_stop=lambda: False, optimizer=None, start_step: int = 0) -> dict[str, float]:
  """Supervised warm start of `parts.model` (synthetic tasks: the answers are known); an interrupted
  one continues from `start_step` with its `optimizer`."""
  cfg = parts.cfg
  source = parts.task.source("train")
  first = cfg.seed * 7919 + start_step * cfg.warm_start.batch_size
  records = (source[i % len(source)] for i in itertools.count(first))
  held_out = parts.eval_records if parts.warm_start_records is None else parts.warm_start_records
  return warm_start_lib.warm_start(parts.model, records, held_out, parts.tok, cfg.warm_start,
                                   mesh=parts.meshes.learner,
                                   length=cfg.data.max_prompt_length + cfg.sampler.max_new_tokens, log=parts.say,
                                   should_stop=should_stop, optimizer=optimizer, start_step=start_step)


def build_learner(cfg: Config, model: nnx.Module, mesh, critic: nnx.Module | None = None):
  """The GRPO-family Learner, or for algo.estimator='ppo' a PPOLearner over the policy plus a value
  head (on the policy trunk, or on `critic`); wrapped to keep learner.offload components on the host."""
  a, rules = cfg.algo, mesh_lib.LEARNER_RULES
  if a.estimator == "ppo":
    # The head starts at V = 0 (zero kernel; it gets gradient from the first step on): an untrained
    # critic's random values would otherwise be the advantage of every failed completion.
    both = (value_lib.PolicyWithValue.create(model, seed=cfg.seed, init_std=0.0) if critic is None
            else value_lib.PolicyWithCritic.create(model, critic, seed=cfg.seed, init_std=0.0))
    ppo = ppo_lib.PPOConfig(gamma=a.gamma, gae_lambda=a.gae_lambda, vf_coef=a.vf_coef, vf_clip=a.vf_clip or None,
                            kl_reward_coef=a.kl_reward_coef, whiten_advantages=a.whiten_advantages)
    learner = ppo_lib.PPOLearner(both, learner_config(cfg), ppo, mesh=mesh, rules=rules)
  else:
    learner = Learner(model, learner_config(cfg), mesh=mesh, rules=rules)
  if cfg.learner.offload:
    learner = offload_lib.OffloadedLearner(learner, cfg.learner.offload)
  return learner


def build_rl(parts: Parts) -> Parts:
  """LoRA (if configured), the learner, the sampler engines and the rewards."""
  cfg, tok, task = parts.cfg, parts.tok, parts.task
  model = parts.model
  if cfg.lora.rank:
    model = lora_lib.apply_lora(model, lora_lib.LoRAConfig(rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                                                           targets=tuple(cfg.lora.targets)),
                                seed=cfg.seed, mesh=parts.meshes.learner, rules=mesh_lib.LEARNER_RULES)
  learner = build_learner(cfg, model, parts.meshes.learner, critic=parts.critic)
  s_cfg = sampler_config(cfg, tok)
  parts.engine = Engine(model, s_cfg, mesh=parts.meshes.sampler)
  parts.eval_engine = Engine(model, eval_lib.eval_sampler_config(s_cfg), mesh=parts.meshes.sampler)
  parts.policy = PolicyLearner(learner, parts.engine, cfg, tok.pad_id, tracer=parts.tracer)
  parts.correctness = rewards.CombinedReward([task.default_rewards[0]], timeout_s=cfg.rl.reward_timeout_s)
  parts.train_reward = rewards.CombinedReward(list(task.default_rewards), timeout_s=cfg.rl.reward_timeout_s)
  a = cfg.algo
  if a.process_reward is not None:  # PRM calls run on their own daemon threads while the sampler decodes
    steps = process_lib.StepConfig(delimiter=a.step_delimiter, every_tokens=a.step_every_tokens,
                                   timeout_s=cfg.rl.reward_timeout_s, workers=cfg.rl.reward_workers)
    parts.process_scorer = process_lib.ProcessRewardScorer(process_lib.get_process_reward(a.process_reward),
                                                           name=a.process_reward, steps=steps, tracer=parts.tracer)
  return parts


def evaluate(parts: Parts) -> dict[str, Any]:
  """Held-out accuracy; on several processes each evaluates its shard and the numbers are combined
  (weighted by prompts), so every process reports the same result."""
  params, _ = parts.policy.sampler_weights()
  with parts.tracer.span("eval", cat="eval", version=parts.policy.version):
    out = eval_lib.evaluate(parts.eval_engine, params, requests_for(parts.eval_records), parts.correctness,
                            parts.tok, version=parts.policy.version)
  if jax.process_count() == 1:
    return out
  keys = sorted(k for k in out if k != "eval/num_prompts")
  counts = [k for k in keys if k.endswith("failures")]  # summed over processes, the rest averaged
  n = out["eval/num_prompts"]
  rows = distributed.allgather(np.array([n] + [out[k] * (1 if k in counts else n) for k in keys], np.float32))
  total = float(rows[:, 0].sum())
  return {"eval/num_prompts": int(total), **{k: float(rows[:, 1 + i].sum() / (1.0 if k in counts else max(total, 1.0)))
                                             for i, k in enumerate(keys)}}


def make_runtime(parts: Parts, stream: PromptStream, log=lambda step, m: None,
                 on_step=lambda version: None, on_batch=lambda step, trained, dropped: None,
                 should_stop=lambda: False, num_steps: int | None = None,
                 collapse: collapse_lib.CollapseDetector | None = None,
                 queue_counts: dict | None = None) -> AsyncRuntime:
  cfg, tok, tracer = parts.cfg, parts.tok, parts.tracer
  params, _ = parts.policy.sampler_weights()
  if cfg.sampler.warmup:  # every decode program compiled now, not in the middle of the run
    with tracer.span("sampler_warmup", cat="sampler"):
      parts.engine.warmup(params)
      if parts.policy.lora:  # later syncs hand over packed adapters (`WithAdapters`): their programs too
        params, _ = parts.policy.sampler_weights()
        parts.engine.warmup(params)

  def driver_factory(sink, may_start_group):
    common = dict(source=stream, sink=sink, version=parts.policy.version, may_start_group=may_start_group,
                  detokenize=tok.decode, tracer=tracer)
    if parts.process_scorer is not None:  # hands step prefixes to the PRM threads while it decodes
      return ProcessRewardDriver(parts.engine, params, scorer=parts.process_scorer, **common)
    if cfg.rl.env is None:
      return RolloutDriver(parts.engine, params, **common)
    return EpisodeDriver(parts.engine, params, make_env=CalculatorEnv,
                         tokenize=lambda text: tok.encode(text, add_special_tokens=False),
                         episode_config=EpisodeConfig(max_turns=cfg.rl.env_max_turns,
                                                      step_timeout_s=cfg.rl.env_step_timeout_s), **common)

  primary = f"rewards/{parts.task.default_rewards[0]}"

  def score(group: RolloutGroup):
    if group.rewards is not None:  # episodes carry their environment's reward
      return
    with tracer.span("reward", cat="reward", prompt=str(group.prompt_id)):
      rewards.score_groups(parts.train_reward, [group], tokenizer=tok)
      if primary in group.reward_metrics:
        group.reward_metrics["accuracy"] = group.reward_metrics[primary]
    if parts.process_scorer is not None:  # waits only for this group's PRM calls still running
      with tracer.span("process_reward_wait", cat="reward", prompt=str(group.prompt_id)):
        parts.process_scorer.collect(group)
    if parts.teacher is not None:
      with tracer.span("teacher", cat="reward", prompt=str(group.prompt_id)):
        parts.teacher.score(group)

  r = cfg.rl
  n_proc = parts.policy.num_processes
  stop = should_stop
  if n_proc > 1:  # a signal reaches the hosts at different times: stop only when all agree
    stop = lambda: distributed.any_process(should_stop())
  return AsyncRuntime(
      # Each process's queue admits its own share of every batch.
      dataclasses.replace(r, prompts_per_step=r.prompts_per_step // n_proc,
                          dynamic_sampling=cfg.algo.dynamic_sampling), num_steps=num_steps,
      driver_factory=driver_factory, learner=parts.policy, score=score, log=log, on_step=on_step,
      on_batch=on_batch, should_stop=stop, collapse=collapse, queue_counts=queue_counts)


def checkpoint_meta(parts: Parts, stream: PromptStream, counters: dict, queue: dict | None = None) -> dict[str, Any]:
  """Everything besides arrays that resuming (and export) needs, as plain JSON: the policy version,
  the data position with the prompts in flight (replayed on resume), the run's counters, the
  queue's admission counters, and the config it was trained with (checked on resume)."""
  cfg, model_cfg = parts.cfg, parts.policy.learner.model(parts.policy.learner.state).cfg
  # Each process reads its own data shard: keep every process's stream position (in process order).
  streams = distributed.allgather_json(stream.state()) if jax.process_count() > 1 else None
  return json.loads(json.dumps({
      "version": parts.policy.version, "stream": stream.state() if streams is None else streams[0],
      **({"streams": streams} if streams is not None else {}), "counters": counters,
      **({"queue": queue} if queue is not None else {}),
      "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(model_cfg),
      "lora": ({"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets)}
               if cfg.lora.rank else None),
      **({"hf_path": cfg.model.hf_path} if cfg.model.hf_path else {})}))


class SetupError(ValueError):
  """Bad input found while building the run (mesh sizes, model files, data, workdir): one clear line."""


class _Run:
  """One run's bookkeeping shared by its stages: logs, checkpoints, prompt accounting and evals."""

  def __init__(self, parts: Parts, workdir: str, ckpt: checkpoint_lib.Checkpointer, preemption: Preemption):
    self.parts, self.cfg, self.workdir, self.ckpt, self.preemption = parts, parts.cfg, workdir, ckpt, preemption
    self.multi, self.pid = jax.process_count() > 1, jax.process_index()
    self.dir = local_dir(workdir)  # this process's logs (WORKDIR itself on process 0)
    self.prompts_log = os.path.join(self.dir, "prompts.jsonl")
    self.logger: metrics_lib.MetricsLogger | None = None
    self.counters = {"groups_trained": 0, "groups_dropped": 0, "groups_regenerated": 0}
    self.stream: PromptStream | None = None
    self.runtime: AsyncRuntime | None = None
    self.queue_counts: dict | None = None
    self.evals: dict[int, float] = {}  # version -> held-out accuracy measured at it

  def open_logs(self, step: int | None):
    """Logs cut back to checkpoint `step` (None: a fresh start), continued from there."""
    offset = resume_lib.cut_logs(self.dir, step)
    cfg = self.cfg
    self.logger = metrics_lib.MetricsLogger(self.dir, total_steps=cfg.rl.num_steps,
                                            tensorboard=cfg.log.tensorboard and self.pid == 0,
                                            progress_bar=cfg.log.progress_bar and self.pid == 0,
                                            initial_step=step or 0, time_offset_s=offset)
    self.parts.say = self.preemption.say = self.logger.info

  def stop_requested(self) -> bool:
    """A preemption seen by any process (a signal reaches the hosts at different times)."""
    requested = self.preemption.requested
    return distributed.any_process(requested) if self.multi else requested

  def close_logs(self):
    if self.logger is not None:
      logger, self.logger = self.logger, None
      logger.close()

  def eval(self) -> float:
    version = self.parts.policy.version
    out = evaluate(self.parts)
    self.logger.write(version, out, advance=False)
    failures = out.get("eval/reward_failures", 0)
    self.parts.say(f"eval at step {version}: accuracy {out['eval/accuracy']:.3f} on {out['eval/num_prompts']} "
                   f"held-out prompts" + (f" ({failures} completions the verifier failed on)" if failures else ""))
    self.evals[version] = out["eval/accuracy"]
    return out["eval/accuracy"]

  def save(self, force: bool = False):
    version = self.parts.policy.version
    due = force or self.ckpt.should_save(version)
    if self.multi:  # a save is a collective: the time-based rule must not fire on one host only
      due = distributed.any_process(due)
    if due:
      acc = self.evals.get(version)
      self.ckpt.save(version, self.parts.policy.learner.state, self.meta(),
                     metrics=None if acc is None else {"eval/accuracy": acc}, force=True)

  def meta(self) -> dict[str, Any]:
    if self.runtime is not None:
      self.queue_counts = self.runtime.queue.counts()
    return checkpoint_meta(self.parts, self.stream, self.counters, queue=self.queue_counts)

  def on_step(self, version: int):
    """After every learner step: an eval when due, then a checkpoint when due (in that order, so a
    checkpoint's eval is in the logs it restores, and is the metric the best checkpoint is kept by)."""
    every, last = self.cfg.eval.every_steps, self.cfg.rl.num_steps
    evaluated = bool(every and version % every == 0 and version < last)
    if evaluated:
      self.eval()  # the sampler keeps decoding meanwhile; only the learner waits
    if version < last:  # the last step's checkpoint is saved after the final eval
      self.save(force=evaluated)  # every evaluated state is saved: it may be the best one to keep

  def on_batch(self, step: int, trained: list, dropped: list):
    self.stream.done(trained + dropped)
    self.counters["groups_trained"] += len(trained)
    self.counters["groups_dropped"] += len(dropped)
    line = json.dumps({"step": step, "trained": [g.columns["stream_index"] for g in trained],
                       "dropped": [g.columns["stream_index"] for g in dropped]}) + "\n"
    try:
      with open(self.prompts_log, "a", encoding="utf-8") as f:
        f.write(line)
    except OSError as e:
      raise metrics_lib.LogWriteError(f"{self.prompts_log}: prompt log write failed: {e}", e.errno) from e

  def first_eval(self) -> float:
    return self.evals[min(self.evals)] if self.evals else float("nan")

  def final_eval_done(self) -> bool:
    """True when the logs kept for this step already hold its final eval (a finished run)."""
    return self.parts.policy.version in self.evals


def run(cfg: Config, workdir: str) -> dict[str, Any]:
  """Trains (or resumes the run in `workdir`); returns a summary. See the module docstring.

  Stages: lock the workdir, build, then either warm start -> eval -> checkpoint at step 0 (a fresh
  run) or restore the newest checkpoint; then RL -> final eval -> checkpoint. SIGTERM / Ctrl-C at
  any stage finish the current piece of work, save what can be resumed, and return.
  """
  try:  # before anything touches a JAX backend (the checkpointer does)
    initialize_distributed(cfg)
  except ValueError as e:
    raise SetupError(str(e)) from e
  mine = local_dir(workdir)
  try:
    for directory in dict.fromkeys([workdir, mine] if not is_remote(workdir) else [mine]):
      workdir_lib.prepare(directory)  # process 0's logs are the workdir itself
    lock = workdir_lib.WorkdirLock(mine).acquire()  # a remote WORKDIR: its local log mirror is locked
  except workdir_lib.WorkdirError as e:
    raise SetupError(str(e)) from e
  try:
    with Preemption() as preemption:
      return _run(cfg, workdir, preemption)
  finally:
    lock.release()


def _run(cfg: Config, workdir: str, preemption: Preemption) -> dict[str, Any]:
  try:  # fails fast on bad meshes, model files or data, before any output (and before orbax's threads)
    parts = build(cfg, workdir)
  except (ValueError, OSError, models.CheckpointError) as e:
    raise SetupError(str(e)) from e
  ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.workdir_checkpoints(workdir), keep=cfg.checkpoint.keep,
                                     save_every_steps=cfg.checkpoint.every_steps,
                                     save_every_seconds=cfg.checkpoint.every_seconds,
                                     save_frozen=not (cfg.model.hf_path and cfg.lora.rank),
                                     best_metric="eval/accuracy")
  r = _Run(parts, workdir, ckpt, preemption)
  closers = [ckpt.close] + ([parts.process_scorer.close] if parts.process_scorer is not None else [])
  try:
    result = _stages(r)
  except BaseException:
    _quietly(r.close_logs, parts.tracer.close, *closers)  # the run's own error is the one to report
    raise
  for close in closers:
    close()
  return result


def _stages(r: _Run) -> dict[str, Any]:
  cfg, parts = r.cfg, r.parts
  latest = r.ckpt.latest_step()
  if latest is not None:
    _check_resumable(r, _readable_meta(r.ckpt, latest), latest)  # before the slow part of a refused restart
  if not (_start_fresh(r) if latest is None else _restore(r)):
    parts.tracer.close()
    return {"preempted": True, "step": 0}
  if parts.policy.version >= cfg.rl.num_steps and r.final_eval_done():
    parts.say(f"the run in {r.workdir} is finished (step {parts.policy.version}); nothing to do")
    return _finish(r, r.evals.get(parts.policy.version, float("nan")))
  summary = _rl(r)
  if summary.get("preempted"):
    return summary
  try:
    acc_after = r.eval()
  finally:  # with the final eval as its metric, or without it if the eval failed
    r.save(force=True)
  r.ckpt.wait()
  return {**summary, **_finish(r, acc_after)}


def _start_fresh(r: _Run) -> bool:
  """Warm start, build the learner, the first eval, and a checkpoint at step 0 that keeps both.
  Returns False when a preemption stopped the warm start (nothing worth resuming yet)."""
  cfg, parts = r.cfg, r.parts
  r.open_logs(None)
  _announce(r)
  paused = None
  if cfg.warm_start.max_steps:
    paused = checkpoint_lib.Checkpointer(os.path.join(r.workdir, WARM_START_SUBDIR), keep=1)
    try:
      optimizer = warm_start_lib.make_optimizer(parts.model, cfg.warm_start)
      start = _resume_warm_start(r, paused, optimizer)
      summary = warm_start(parts, should_stop=r.stop_requested, optimizer=optimizer, start_step=start)
      if summary["warm_start/interrupted"]:
        step = summary["warm_start/steps"]
        paused.save(step, _warm_start_state(parts.model, optimizer), {"config": dataclasses.asdict(cfg)}, force=True)
        parts.say(f"stopped during the warm start at step {step}; saved it: the next run with this --workdir "
                  "continues it")
        r.close_logs()
        return False
    finally:
      paused.close()
    r.logger.write(0, summary, advance=False)
  build_rl(parts)
  r.stream = PromptStream(parts.train_pipe)
  r.eval()
  r.save(force=True)  # the warm start and the first eval are never redone
  if paused is not None and r.pid == 0:
    r.ckpt.wait()
    epath.Path(paused.directory).rmtree(missing_ok=True)  # the step-0 checkpoint holds the finished warm start
  return True


WARM_START_SUBDIR = "warm_start"  # WORKDIR/warm_start: an interrupted warm start, until step 0 is saved


def _warm_start_state(model, optimizer) -> dict:
  return {"params": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}


def _resume_warm_start(r: _Run, paused: checkpoint_lib.Checkpointer, optimizer) -> int:
  """Restores an interrupted warm start into the model and its optimizer; returns its step (0: none)."""
  step = paused.latest_step()
  if step is None:
    return 0
  _check_resumable(r, _readable_meta(paused, step), step)
  # Arrays not yet placed (the optimizer's step count) come back replicated on the learner mesh,
  # where the jitted warm-start step can use them with the model's shards.
  replicated = NamedSharding(r.parts.meshes.learner, PartitionSpec())
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed
                                                       else replicated), _warm_start_state(r.parts.model, optimizer))
  state, _ = paused.restore(abstract_state=target)
  nnx.update(r.parts.model, state["params"])
  nnx.update(optimizer, state["optimizer"])
  r.parts.say(f"continuing the warm start from step {step} ({paused.step_dir(step)})")
  return step


def _restore(r: _Run) -> bool:
  parts = r.parts
  build_rl(parts)
  learner = parts.policy.learner
  # step=None: the newest *readable* checkpoint (a damaged newest one falls back, with a warning).
  learner.state, meta = r.ckpt.restore(abstract_state=learner.state)
  version = meta["version"]
  where = r.ckpt.step_dir(version)
  model_cfg = json.loads(json.dumps(dataclasses.asdict(learner.model(learner.state).cfg)))
  _check_resumable(r, meta, version, model_cfg)
  parts.policy.version = version
  r.open_logs(version)
  _announce(r)
  r.counters.update(meta["counters"])
  r.queue_counts = meta.get("queue")
  streams = meta.get("streams", [meta["stream"]])  # one per process (each reads its own data shard)
  if len(streams) != jax.process_count():
    raise SetupError(f"{where} was saved by {len(streams)} processes; resuming needs the same number, not "
                     f"{jax.process_count()}")
  mine = streams[r.pid]
  r.stream = PromptStream(parts.train_pipe, mine["position"], replay=mine["outstanding"])
  r.counters["groups_regenerated"] += r.stream.replayed
  for rec in metrics_lib.read_jsonl(r.logger.path):
    if "eval/accuracy" in rec:
      r.evals[rec["step"]] = rec["eval/accuracy"]
  parts.say(f"resumed from {where} at step {version}; regenerating {r.stream.replayed} prompts that were in flight")
  return True


def _quietly(*closers):
  """Runs every closer; their own failures are logged, not raised (an error is already on its way)."""
  for close in closers:
    try:
      close()
    except Exception as e:
      log.warning(f"while stopping: {type(e).__name__}: {e}")


def _readable_meta(ckpt: checkpoint_lib.Checkpointer, step: int) -> dict | None:
  try:
    return ckpt.read_meta(step)
  except checkpoint_lib.CheckpointError:
    return None  # a damaged checkpoint: the restore falls back to an older one and checks that


def _check_resumable(r: _Run, meta: dict | None, step: int, model_cfg: dict | None = None):
  """A restart whose config would change what checkpoint `step` was trained with is refused."""
  if meta is None:
    return
  try:
    resume_lib.check_compatible(meta, r.cfg, model_cfg or {}, r.ckpt.step_dir(step))
  except resume_lib.IncompatibleResume as e:
    raise SetupError(str(e)) from e


def _announce(r: _Run):
  parts = r.parts
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(parts.model, nnx.Param)))
  parts.say(f"tunixlike: task {r.cfg.data.task}, {n_params:,} params, sampler {dict(parts.meshes.sampler.shape)}, "
            f"learner {dict(parts.meshes.learner.shape)}")


def _rl(r: _Run) -> dict[str, Any]:
  """The async RL loop from the current version to rl.num_steps (checkpointed when it is stopped)."""
  cfg, parts = r.cfg, r.parts
  if r.stop_requested():  # stopped during the first eval: the step-0 checkpoint has it
    return _stopped(r, {})
  collapse = collapse_lib.CollapseDetector(collapse_lib.CollapseConfig(
      vocab_size=parts.policy.learner.model(parts.policy.learner.state).cfg.vocab_size,
      entropy_frac=cfg.rl.collapse_entropy_frac, spike_factor=cfg.rl.collapse_spike_factor))
  r.runtime = make_runtime(parts, r.stream, log=r.logger.write, on_step=r.on_step, on_batch=r.on_batch,
                           should_stop=lambda: r.preemption.requested,  # agreed on by make_runtime
                           num_steps=max(cfg.rl.num_steps - parts.policy.version, 0), collapse=collapse,
                           queue_counts=r.queue_counts)
  try:
    summary = r.runtime.run()
  except collapse_lib.PolicyCollapse:
    best = r.ckpt.best_step()
    parts.say("policy collapsed: the collapsed state is not saved; "
              + (f"the best checkpoint is {r.ckpt.step_dir(best)}" if best is not None else "no eval checkpoint yet"))
    raise
  except BaseException:
    if r.multi:  # a save needs every process, and the others may be gone: rely on periodic saves
      parts.say(f"run failed on process {r.pid}; not saving (a multi-process save needs every process)")
    else:
      parts.say("run failed: saving the last good learner state before re-raising")
      try:
        r.save(force=True)
        r.ckpt.wait()
      except Exception as e:  # e.g. the same full disk: report it, but re-raise the run's own error
        parts.say(f"the checkpoint could not be saved either ({type(e).__name__}: {e})")
    raise
  if r.runtime.preempted:
    return _stopped(r, summary)
  return summary


def _stopped(r: _Run, summary: dict) -> dict[str, Any]:
  r.save(force=True)
  r.ckpt.wait()
  r.parts.say(f"stopped at step {r.parts.policy.version}; checkpoint saved; run again with the same --workdir "
              "to resume")
  r.parts.tracer.close()
  r.close_logs()
  upload_logs(r.workdir, r.parts.say)
  return {**summary, "preempted": True, "step": r.parts.policy.version}


def _finish(r: _Run, acc_after: float) -> dict[str, Any]:
  acc_before = r.first_eval()
  say = r.parts.say
  path, elapsed_s = r.logger.path, r.logger.elapsed_s
  say(f"held-out accuracy {acc_before:.3f} -> {acc_after:.3f} ({100 * (acc_after - acc_before):+.1f} points) "
      f"in {elapsed_s:.0f} s; metrics in {path}")
  r.parts.tracer.close()
  r.close_logs()
  plot = metrics_lib.plot(path, os.path.join(r.dir, "reward.png")) if r.pid == 0 else None
  upload_logs(r.workdir, say)
  return {"eval/accuracy_before": acc_before, "eval/accuracy_after": acc_after, "plot": plot,
          "wall_s_total": elapsed_s, **r.counters}
