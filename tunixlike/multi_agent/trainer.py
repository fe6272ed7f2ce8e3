"""`run(config, workdir)` for a multi-agent config (multi_agent.env): the single-policy run, several policies.

    lock the workdir -> build -> warm start -> a policy per agent -> eval -> checkpoint 0 -> RL loop -> eval -> checkpoint
                                 (or, when the workdir has a checkpoint: restore it instead)

Everything around the loop is `rl.trainer`'s, called, not copied: the workdir lock, SIGTERM / Ctrl-C
(finish the step, save, exit 0), the logs cut back on resume, the warm start (every policy starts
from it), the checkpointer and its save policy, the config and data checks of a resume, the
final summary. What differs is what a step trains (`MultiAgentRuntime`: a batch of whole
episodes, each policy one optimizer step on its own turns) and what a checkpoint holds:

    state   {policy: its learner state (params, optimizer state, step count)}, one orbax item
    meta    step (learner steps taken), versions (each policy's: a policy with no turns in a batch
            skips it), records (the episode records' position and the indices in flight, replayed on
            resume), next_seq (the next episode's start order: its sampling noise), queue (the episode
            buffer's counters), counters, config, model

Each step appends {"step", "trained", "dropped"} (the episodes' record indices) to
WORKDIR/prompts.jsonl, as a single-policy run does for its prompts; a resume replays the indices
that were in flight, so across stops every index is trained once, dropped, or still in flight.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
from etils import epath

from tunixlike import metrics as metrics_lib
from tunixlike.config import Config
from tunixlike.multi_agent import build as ma_build
from tunixlike.multi_agent.env import env_factory
from tunixlike.multi_agent.records import EpisodeRecords
from tunixlike.multi_agent.runtime import MultiAgentRuntime
from tunixlike.rewards import loader
from tunixlike.rl import build as build_lib, evaluate as eval_lib, hooks as hooks_lib, loop
from tunixlike.rl import trainer as rl_trainer, unlearning
from tunixlike.rl.hooks import StepInfo
from tunixlike.rl.policy import Policy
from tunixlike.sampler import make_engine


def run(cfg: Config, workdir: str, **kwargs) -> dict[str, Any]:
  """Trains (or resumes the run in `workdir`) as `rl.trainer.run` does, with this module's stages."""
  return rl_trainer.run(cfg, workdir, stages=_stages, **kwargs)


@dataclasses.dataclass
class _Agents:
  """The run's policies and where the run is; saved with every checkpoint."""

  policies: dict[str, Policy]
  engines: dict[str, Any]
  records: EpisodeRecords
  eval_engine: Any | None  # greedy decoding of the held-out prompts (multi_agent.eval_policy), or None
  correctness: Any | None  # the verifier the evals score with
  step: int = 0  # learner steps taken (a policy's version counts only the steps it took)
  next_seq: int = 0  # the next episode's start order, until the runtime runs
  queue_counts: dict | None = None  # the buffer's counters, until the runtime runs
  runtime: MultiAgentRuntime | None = None  # while the RL loop runs

  def state(self) -> dict[str, Any]:
    return {name: policy.state for name, policy in self.policies.items()}


def _stages(r: rl_trainer._Run) -> dict[str, Any]:
  if jax.process_count() > 1:  # every process would run the same episodes: records are not sharded yet
    raise rl_trainer.SetupError(f"multi_agent.env={r.cfg.multi_agent.env!r}: a multi-agent run takes one process, "
                                f"not {jax.process_count()}")
  try:  # a bad multi_agent.env fails now, not after the warm start
    env_factory(r.cfg)
  except loader.LoadError as e:
    raise rl_trainer.SetupError(str(e)) from e
  latest = r.ckpt.latest_step()
  if latest is not None:
    r.check_resumable(rl_trainer._readable_meta(r.ckpt, latest), latest)  # before the slow part of a refused restart
  r.counters = {"episodes_trained": 0, "episodes_dropped": 0, "episodes_regenerated": 0}
  agents = _start_fresh(r) if latest is None else _restore(r)
  if agents is None:
    r.close()
    return {"preempted": True, "step": 0}
  num_steps = r.cfg.rl.num_steps
  if agents.step >= num_steps and (agents.eval_engine is None or agents.step in r.evals):
    if latest is not None:
      r.say(f"the run in {r.workdir} is finished (step {agents.step} of rl.num_steps={num_steps}); nothing to do "
            "(raise rl.num_steps to train on)")
    return _finish(r, agents)
  summary = _rl(r, agents)
  if summary.get("preempted"):
    return summary
  try:
    _eval(r, agents)
  finally:  # with the final eval as its metric, or without it if the eval failed
    _save(r, agents, force=True)
  r.ckpt.wait()
  return {**summary, **_finish(r, agents)}


def _build(r: rl_trainer._Run, records: EpisodeRecords) -> _Agents:
  """A policy per agent, each from `setup.model` (as warm-started), and the eval engine."""
  cfg, ma = r.cfg, r.cfg.multi_agent
  policies, engines = ma_build.build_policies(r.setup, ma.group_sizes(), ma.episodes_per_step,
                                              turns_per_episode=ma.turns(), sampler=ma.samplers())
  eval_engine = correctness = None
  if ma.eval_policy is not None:
    evaluated = ma.eval_policy
    eval_engine = make_engine(policies[evaluated].model(), eval_lib.eval_sampler_config(engines[evaluated].config),
                              mesh=r.setup.meshes.sampler)
    correctness = build_lib.correctness_reward(r.setup)
  sizes = ", ".join(f"{name} ({g} samples a turn)" for name, g in ma.group_sizes().items())
  r.say(f"multi-agent: {ma.env} with policies {sizes}; {ma.episodes_per_step} episodes a step, "
        f"rl.max_staleness={cfg.rl.max_staleness}")
  return _Agents(policies, engines, records, eval_engine, correctness)


def _start_fresh(r: rl_trainer._Run) -> _Agents | None:
  """Warm start (every policy starts from it), the policies, the first eval, a checkpoint at step 0.
  None when a preemption stopped the warm start (saved there)."""
  r.open_logs(None)
  if r.cfg.warm_start.max_steps and not rl_trainer._warm_start(r):
    return None
  agents = _build(r, EpisodeRecords())
  _eval(r, agents)
  _save(r, agents, force=True)  # the warm start and the first eval are never redone
  if r.cfg.warm_start.max_steps and r.pid == 0:
    r.ckpt.wait()
    epath.Path(r.workdir, rl_trainer.WARM_START_SUBDIR).rmtree(missing_ok=True)  # the step-0 checkpoint holds it
  return agents


def _restore(r: rl_trainer._Run) -> _Agents:
  """The newest readable checkpoint: every policy's state and version, the logs cut back to it, the
  counters, the evals, and the episode records with the indices that were in flight to replay."""
  agents = _build(r, EpisodeRecords())
  state, meta = r.ckpt.restore(abstract_state=agents.state())  # a damaged newest one falls back, with a warning
  for name, policy in agents.policies.items():
    policy.load(state[name], int(meta["versions"][name]))
  step = agents.step = int(meta["step"])
  r.check_resumable(meta, step, _model_cfg(agents))
  r.open_logs(step)
  r.restore_records(meta)
  agents.records = EpisodeRecords(meta["records"]["position"], replay=meta["records"]["outstanding"])
  agents.next_seq, agents.queue_counts = int(meta["next_seq"]), dict(meta["queue"])
  r.counters["episodes_regenerated"] += agents.records.replayed
  if step < r.cfg.rl.num_steps:
    r.say(f"resumed from {r.ckpt.step_dir(step)} at step {step} (versions {dict(meta['versions'])}); regenerating "
          f"{agents.records.replayed} episodes that were in flight")
  return agents


def _model_cfg(agents: _Agents) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(next(iter(agents.policies.values())).model().cfg)))


def _rl(r: rl_trainer._Run, agents: _Agents) -> dict[str, Any]:
  """The RL loop over episodes from the current step to rl.num_steps (checkpointed when it is stopped)."""
  cfg, ma = r.cfg, r.cfg.multi_agent
  if r.stop_requested():  # stopped during the first eval: the step-0 checkpoint has it
    return _stopped(r, agents, {})
  runtime = agents.runtime = ma_build.build_runtime(
      r.setup, agents.policies, agents.engines, env_factory(cfg), batch_episodes=ma.episodes_per_step,
      max_staleness=cfg.rl.max_staleness, max_turns=cfg.rl.env_max_turns, records=agents.records,
      counts=agents.queue_counts, first_seq=agents.next_seq)
  stop = [False]
  hooks = hooks_lib.Hooks()
  for fn, every in r.user_hooks:  # before the metrics hook: what they add to info.metrics is logged
    hooks.add(fn, every=every)
  hooks.add(r.log_metrics)
  if cfg.eval.every_steps and agents.eval_engine is not None:
    hooks.add(lambda info: _periodic_eval(r, agents, info), every=cfg.eval.every_steps)
  hooks.add(lambda info: _save(r, agents, force=info.version in r.evals) if info.version < cfg.rl.num_steps else None)

  def check_preemption(info: StepInfo):  # a signal ends the loop after this step
    stop[0] = stop[0] or r.stop_requested()

  hooks.add(check_preemption)

  def train(_, episodes, wait_s: float) -> dict[str, Any]:
    step = agents.step
    metrics = runtime.train_batch(episodes)
    agents.step += 1
    dropped = runtime.queue.take_dropped()
    _account(r, agents, step, episodes, dropped)
    losses = [v for k, v in metrics.items() if k.endswith("/loss")]
    stats = runtime.coordinator.stats
    metrics.update({"loss": sum(losses) / max(len(losses), 1), "learner/wait_s": wait_s, **runtime.queue.stats(),
                    "episodes/aborted": stats.aborted, "episodes/truncated": stats.truncated})
    info = StepInfo(step, agents.step, metrics, trained=[g for e in episodes for g in e.groups],
                    dropped=[g for e in dropped for g in e.groups], stop=lambda: stop.__setitem__(0, True))
    hooks.run(info)
    return metrics

  r.logger.progress("rl", total=cfg.rl.num_steps, initial=agents.step)
  try:
    summary = loop.run_steps(max(cfg.rl.num_steps - agents.step, 0), runtime, runtime.next_batch, train,
                             threaded=True, max_staleness=cfg.rl.max_staleness, should_stop=lambda: stop[0])
  except unlearning.Unlearning:
    raise
  except BaseException:
    r.say("run failed: saving the last good learner states before re-raising")
    try:
      _save(r, agents, force=True)
      r.ckpt.wait()
    except Exception as e:  # e.g. a full disk: report it, but re-raise the run's own error
      r.say(f"the checkpoint could not be saved either ({type(e).__name__}: {e})")
    raise
  finally:
    r.logger.end_progress()
  if stop[0] and agents.step < cfg.rl.num_steps:
    return _stopped(r, agents, summary)
  return summary


def _account(r: rl_trainer._Run, agents: _Agents, step: int, trained, dropped) -> None:
  """Episodes trained or dropped leave the records' outstanding set (what a resume replays); logged."""
  trained_ids, dropped_ids = [e.record["index"] for e in trained], [e.record["index"] for e in dropped]
  agents.records.done(trained_ids + dropped_ids)
  r.counters["episodes_trained"] += len(trained_ids)
  r.counters["episodes_dropped"] += len(dropped_ids)
  line = json.dumps({"step": step, "trained": trained_ids, "dropped": dropped_ids}) + "\n"
  try:
    with open(r.prompts_log, "a", encoding="utf-8") as f:
      f.write(line)
  except OSError as e:
    raise metrics_lib.LogWriteError(f"{r.prompts_log}: episode log write failed: {e}", e.errno) from e


def _periodic_eval(r: rl_trainer._Run, agents: _Agents, info: StepInfo) -> None:
  if info.version < r.cfg.rl.num_steps:  # the last step's eval is the final one
    _eval(r, agents)  # the samplers keep decoding meanwhile; only the learners wait


def _eval(r: rl_trainer._Run, agents: _Agents) -> float | None:
  """Held-out accuracy of multi_agent.eval_policy on data.task (greedy), logged at the current step."""
  name = r.cfg.multi_agent.eval_policy
  if name is None:
    return None
  policy, step = agents.policies[name], agents.step
  synced = policy.sync_weights()
  out = build_lib.evaluate_params(r.setup, agents.eval_engine, synced.params, agents.correctness,
                                  version=policy.version)
  r.logger.write(step, out, advance=False)
  r.say(f"eval at step {step}: {name}'s accuracy {out['eval/accuracy']:.3f} on {out['eval/num_prompts']} held-out "
        "prompts")
  r.evals[step] = out["eval/accuracy"]
  return out["eval/accuracy"]


def _save(r: rl_trainer._Run, agents: _Agents, force: bool = False) -> None:
  """A checkpoint of every policy and the run's position when forced or due (checkpoint.every_steps)."""
  step, runtime = agents.step, agents.runtime
  if not (force or r.ckpt.should_save(step)):
    return
  acc = r.evals.get(step)
  meta = {"step": step, "versions": {name: p.version for name, p in agents.policies.items()},
          "records": agents.records.state(),
          "next_seq": runtime.coordinator.next_seq if runtime is not None else agents.next_seq,
          "queue": runtime.queue.counts() if runtime is not None else (agents.queue_counts or {}),
          "counters": r.counters, "data": r.data_fingerprints, "config": dataclasses.asdict(r.cfg),
          "model": _model_cfg(agents)}
  r.ckpt.save(step, agents.state(), json.loads(json.dumps(meta)),
              metrics=None if acc is None else {"eval/accuracy": acc}, force=True)


def _stopped(r: rl_trainer._Run, agents: _Agents, summary: dict) -> dict[str, Any]:
  _save(r, agents, force=True)
  r.ckpt.wait()
  r.say(f"stopped at step {agents.step}; checkpoint saved; run again with the same --workdir to resume")
  r.close()
  return {**summary, "preempted": True, "step": agents.step}


def _finish(r: rl_trainer._Run, agents: _Agents) -> dict[str, Any]:
  """The single-policy run's final lines (held-out accuracy, outputs) when there are evals, else the outputs."""
  if r.evals:
    return {"step": agents.step, **rl_trainer._finish(r, r.evals[max(r.evals)])}
  latest, metrics = r.ckpt.latest_step(), r.logger.outputs["metrics"]
  r.say(f"trained {agents.step} steps in {r.logger.elapsed_s:.0f} s; outputs:\n  checkpoint  "
        f"{r.ckpt.step_dir(latest)}\n  metrics     {metrics}")
  r.close()
  return {"step": agents.step, "checkpoint": r.ckpt.step_dir(latest), "metrics": metrics, **r.counters}
