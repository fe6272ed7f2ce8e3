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
from flax import nnx

from tunixlike import distributed
from tunixlike import mesh as mesh_lib
from tunixlike import metrics as metrics_lib
from tunixlike import checkpoint as checkpoint_lib
from tunixlike import models, rewards, trace as trace_lib
from tunixlike.rewards.envs import CalculatorEnv
from tunixlike.config import Config
from tunixlike.data import char_tokenizer, pipeline, tasks, tokenizer as tokenizer_lib
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner import offload as offload_lib, ppo as ppo_lib, value as value_lib
from tunixlike.learner.train_step import Learner
from tunixlike.models import lora as lora_lib
from tunixlike.rl import distill as distill_lib, evaluate as eval_lib, warm_start as warm_start_lib
from tunixlike.rewards import process as process_lib
from tunixlike.sampler.process_driver import ProcessRewardDriver
from tunixlike.rl.policy import PolicyLearner
from tunixlike.rl.preemption import Preemption
from tunixlike.rl.prompts import PromptStream, requests_for
from tunixlike.rl.runtime import AsyncRuntime, RuntimeConfig
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
    kwargs = {"path": cfg.data.path}
  return tok, tasks.get(cfg.data.task, **kwargs)


def build_model(cfg: Config, tok, mesh) -> nnx.Module:
  m = cfg.model
  if m.hf_path:
    return models.from_pretrained(m.hf_path, mesh=mesh, rules=mesh_lib.LEARNER_RULES, dtype=m.param_dtype)
  model_cfg = models.ModelConfig(
      vocab_size=tok.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, intermediate_size=m.intermediate_size,
      rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps, qkv_bias=m.qkv_bias, qk_norm=m.qk_norm,
      tie_embeddings=m.tie_embeddings, param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat)
  return models.create_sharded(model_cfg, mesh, mesh_lib.LEARNER_RULES, seed=cfg.seed)


def learner_config(cfg: Config) -> LearnerConfig:
  a, o = cfg.algo, cfg.optim
  algo = AlgoConfig(advantage=a.advantage, loss=a.loss, aggregation=a.aggregation, eps_low=a.eps_low,
                    eps_high=a.eps_high, norm_length=a.norm_length, kl_coef=a.kl_coef,
                    kl_estimator=a.kl_estimator, decoupled=a.decoupled, is_mode=a.is_mode, is_level=a.is_level,
                    is_cap=a.is_cap, is_low=a.is_low, is_high=a.is_high, keep_sampling_mask=a.keep_sampling_mask,
                    keep_routing=a.keep_routing,
                    # The behaviour logprobs are at the sampler's temperature; the learner's must match.
                    sampling_temperature=cfg.sampler.temperature if cfg.sampler.temperature > 0 else 1.0)
  optim = OptimConfig(learning_rate=o.learning_rate, warmup_steps=o.warmup_steps, schedule=o.schedule,
                      total_steps=cfg.rl.num_steps, grad_clip=o.grad_clip, weight_decay=o.weight_decay,
                      b1=o.b1, b2=o.b2, micro_batches=o.micro_batches,
                      group_by_length=o.group_by_length)
  return LearnerConfig(algo=algo, optim=optim)


def sampler_config(cfg: Config, tok) -> SamplerConfig:
  """This process's sampler: the decode slots of sampler.max_concurrent_decodes are split over the hosts."""
  s = cfg.sampler
  slots = s.max_concurrent_decodes // jax.process_count()
  return SamplerConfig(max_concurrent_decodes=slots, max_prefill_length=s.max_prefill_length,
                       max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                       eos_ids=tuple(tok.stop_ids), stop_strings=tuple(s.stop_strings),
                       steps_per_call=s.steps_per_call, record_sampling_mask=s.record_sampling_mask,
                       record_routing=s.record_routing,
                       group_size=cfg.algo.group_size, attend_bucket=s.attend_bucket,
                       slot_groups=s.slot_groups, seed=cfg.seed)


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
  d = cfg.distributed
  return distributed.initialize(distributed.DistributedConfig(
      coordinator_address=d.coordinator_address, num_processes=d.num_processes, process_id=d.process_id,
      auto_detect=d.auto_detect, timeout_s=d.timeout_s))


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


def warm_start(parts: Parts) -> dict[str, float]:
  """Supervised warm start of `parts.model` (synthetic tasks: the answers are known)."""
  cfg = parts.cfg
  source = parts.task.source("train")
  records = (source[i % len(source)] for i in itertools.count(cfg.seed * 7919))
  held_out = parts.eval_records if parts.warm_start_records is None else parts.warm_start_records
  return warm_start_lib.warm_start(parts.model, records, held_out, parts.tok, cfg.warm_start,
                                   mesh=parts.meshes.learner,
                                   length=cfg.data.max_prompt_length + cfg.sampler.max_new_tokens, log=parts.say)


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
  n = out["eval/num_prompts"]
  rows = distributed.allgather(np.array([n] + [out[k] * n for k in keys], np.float32))
  total = float(rows[:, 0].sum())
  return {"eval/num_prompts": int(total), **{k: float(rows[:, 1 + i].sum() / max(total, 1.0))
                                             for i, k in enumerate(keys)}}


def make_runtime(parts: Parts, stream: PromptStream, log=lambda step, m: None,
                 on_step=lambda version: None, on_batch=lambda step, trained, dropped: None,
                 should_stop=lambda: False, num_steps: int | None = None) -> AsyncRuntime:
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
      RuntimeConfig(num_steps=r.num_steps if num_steps is None else num_steps,
                    prompts_per_step=r.prompts_per_step // n_proc, max_staleness=r.max_staleness,
                    sync_mode=r.sync_mode, reward_workers=r.reward_workers, max_nonfinite_steps=r.max_nonfinite_steps,
                    wait_timeout_s=r.wait_timeout_s, dynamic_sampling=cfg.algo.dynamic_sampling),
      driver_factory=driver_factory, learner=parts.policy, score=score, log=log, on_step=on_step,
      on_batch=on_batch, should_stop=stop)


def checkpoint_meta(parts: Parts, stream: PromptStream, counters: dict) -> dict[str, Any]:
  """Everything besides arrays that resuming (and export) needs, as plain JSON."""
  cfg, model_cfg = parts.cfg, parts.policy.learner.model(parts.policy.learner.state).cfg
  # Each process reads its own data shard: keep every process's stream position (in process order).
  streams = distributed.allgather_json(stream.state()) if jax.process_count() > 1 else None
  return json.loads(json.dumps({
      "version": parts.policy.version, "stream": stream.state() if streams is None else streams[0],
      **({"streams": streams} if streams is not None else {}), "counters": counters,
      "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(model_cfg),
      "lora": ({"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets)}
               if cfg.lora.rank else None),
      **({"hf_path": cfg.model.hf_path} if cfg.model.hf_path else {})}))


class SetupError(ValueError):
  """Bad input found while building the run (mesh sizes, model files, data): one clear line."""


def _truncate_jsonl(path: str, below_step: int):
  """Drops records of steps >= below_step (they were lost with the crash and will be redone)."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    keep = [l for l in f if l.strip() and json.loads(l).get("step", 0) < below_step]
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(keep)


def run(cfg: Config, workdir: str) -> dict[str, Any]:
  """Trains (or resumes the run in `workdir`); returns a summary. See the module docstring."""
  try:  # before anything touches a JAX backend (the checkpointer does)
    initialize_distributed(cfg)
  except ValueError as e:
    raise SetupError(str(e)) from e
  if not is_remote(workdir):
    os.makedirs(workdir, exist_ok=True)
  try:  # fails fast on bad meshes, model files or data, before any output (and before orbax's threads)
    parts = build(cfg, workdir)
  except (ValueError, OSError, models.CheckpointError) as e:
    raise SetupError(str(e)) from e
  ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.workdir_checkpoints(workdir), keep=cfg.checkpoint.keep,
                                     save_every_steps=cfg.checkpoint.every_steps,
                                     save_every_seconds=cfg.checkpoint.every_seconds,
                                     save_frozen=not (cfg.model.hf_path and cfg.lora.rank))
  latest = ckpt.latest_step()
  multi, pid = jax.process_count() > 1, jax.process_index()
  mine = local_dir(workdir)  # this process's logs (WORKDIR itself on process 0)
  os.makedirs(mine, exist_ok=True)
  prompts_log = os.path.join(mine, "prompts.jsonl")
  logger = metrics_lib.MetricsLogger(mine, total_steps=cfg.rl.num_steps, tensorboard=cfg.log.tensorboard and pid == 0,
                                     progress_bar=cfg.log.progress_bar and pid == 0, initial_step=latest or 0)
  say = parts.say = logger.info
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(parts.model, nnx.Param)))
  say(f"tunixlike: task {cfg.data.task}, {n_params:,} params, sampler {dict(parts.meshes.sampler.shape)}, "
      f"learner {dict(parts.meshes.learner.shape)}")
  if latest is None and cfg.warm_start.max_steps:
    logger.write(0, warm_start(parts), advance=False)
  build_rl(parts)

  def run_eval() -> float:
    out = evaluate(parts)
    logger.write(parts.policy.version, out, advance=False)
    say(f"eval at step {parts.policy.version}: accuracy {out['eval/accuracy']:.3f} on "
        f"{out['eval/num_prompts']} held-out prompts")
    return out["eval/accuracy"]

  counters = {"groups_trained": 0, "groups_dropped": 0, "groups_regenerated": 0}
  if latest is None:
    acc_before = run_eval()
    stream = PromptStream(parts.train_pipe)
  else:
    learner = parts.policy.learner
    # step=None: the newest *readable* checkpoint (a damaged newest one falls back, with a warning).
    learner.state, meta = ckpt.restore(abstract_state=learner.state)
    parts.policy.version = latest = meta["version"]
    _truncate_jsonl(prompts_log, latest)
    counters.update(meta["counters"])
    streams = meta.get("streams", [meta["stream"]])  # one per process (each reads its own data shard)
    if len(streams) != jax.process_count():
      raise SetupError(f"{ckpt.step_dir(latest)} was saved by {len(streams)} processes; resuming needs the same "
                       f"number, not {jax.process_count()}")
    mine_stream = streams[pid]
    stream = PromptStream(parts.train_pipe, mine_stream["position"], replay=mine_stream["outstanding"])
    counters["groups_regenerated"] += stream.replayed
    first_eval = [r for r in metrics_lib.read_jsonl(logger.path) if "eval/accuracy" in r][:1]
    acc_before = first_eval[0]["eval/accuracy"] if first_eval else float("nan")
    say(f"resumed from {ckpt.step_dir(latest)} at step {latest}; regenerating {stream.replayed} prompts that "
        "were in flight")

  def save(force: bool = False):
    version = parts.policy.version
    due = force or ckpt.should_save(version)
    if multi:  # a save is a collective: the time-based rule must not fire on one host only
      due = distributed.any_process(due)
    if due:
      ckpt.save(version, parts.policy.learner.state, checkpoint_meta(parts, stream, counters), force=True)

  def on_step(version: int):
    save()
    every = cfg.eval.every_steps
    if every and version % every == 0 and version < cfg.rl.num_steps:
      run_eval()  # the sampler keeps decoding meanwhile; only the learner waits

  def on_batch(step: int, trained: list, dropped: list):
    stream.done(trained + dropped)
    counters["groups_trained"] += len(trained)
    counters["groups_dropped"] += len(dropped)
    with open(prompts_log, "a", encoding="utf-8") as f:
      f.write(json.dumps({"step": step, "trained": [g.columns["stream_index"] for g in trained],
                          "dropped": [g.columns["stream_index"] for g in dropped]}) + "\n")

  try:
    with Preemption(say) as preemption:
      runtime = make_runtime(parts, stream, log=logger.write, on_step=on_step, on_batch=on_batch,
                             should_stop=lambda: preemption.requested,
                             num_steps=max(cfg.rl.num_steps - parts.policy.version, 0))
      try:
        summary = runtime.run()
      except BaseException:
        if multi:  # a save needs every process, and the others may be gone: rely on periodic saves
          say(f"run failed on process {pid}; not saving (a multi-process save needs every process)")
        else:
          say("run failed: saving the last good learner state before re-raising")
          save(force=True)
        raise
    if runtime.preempted:
      save(force=True)
      ckpt.close()
      say(f"stopped at step {parts.policy.version}; checkpoint saved; run again with the same --workdir to resume")
      logger.close()
      upload_logs(workdir, say)
      return {**summary, "preempted": True, "step": parts.policy.version}
    save(force=True)
  finally:
    ckpt.close()
    parts.tracer.close()
    if parts.process_scorer is not None:
      parts.process_scorer.close()  # idle PRM workers exit; the final eval scores no process rewards
  acc_after = run_eval()
  say(f"held-out accuracy {acc_before:.3f} -> {acc_after:.3f} ({100 * (acc_after - acc_before):+.1f} points) "
      f"in {logger.elapsed_s:.0f} s; metrics in {logger.path}")
  logger.close()
  plot = metrics_lib.plot(logger.path, os.path.join(mine, "reward.png")) if pid == 0 else None
  upload_logs(workdir, say)
  return {**summary, "eval/accuracy_before": acc_before, "eval/accuracy_after": acc_after, "plot": plot,
          "wall_s_total": logger.elapsed_s, **counters}
