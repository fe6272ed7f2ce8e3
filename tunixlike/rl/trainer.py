"""`run(config, workdir)`: a training run as a sequence of named stages, resumable at every one.

    lock the workdir -> build -> warm start -> eval -> checkpoint 0 -> RL loop -> eval -> checkpoint
                                 (or, when the workdir has a checkpoint: restore it instead)

The pieces come from `build.py`. The RL loop's periodic work is hooks on the runtime
(`_Run.add_hooks`): prompt accounting and metrics every step, the collapse guard, an eval every
`eval.every_steps`, a checkpoint when orbax's save policy says so (every N steps or seconds), and
the preemption check. SIGTERM / Ctrl-C at any stage finish the current piece of work, save what
can be resumed, and return.

Several processes (hosts, `tunixlike.distributed`): every process runs this same program. The
learner loop runs in lockstep on all of them (each contributes its own share of every batch,
`prompts_per_step / process_count` groups from its own sampler and data shard); each sampler decodes
on its own host; evals combine every host's shard; process 0 writes WORKDIR/metrics.jsonl and the
plot, process i > 0 writes its own logs under WORKDIR/process_i/. Decisions that lead to global
computations and depend on local state (preemption, time-based checkpoints) are agreed on first
(`_Run.agreed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any, Callable

import jax
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tunixlike import checkpoint as checkpoint_lib, distributed, metrics as metrics_lib, models
from tunixlike import workdir as workdir_lib
from tunixlike import config as config_lib
from tunixlike.config import Config
from tunixlike.data import tasks as tasks_lib
from tunixlike.rl import build as build_lib, collapse as collapse_lib, resume as resume_lib
from tunixlike.rl import completions_log, signal_guard, truncation_guard, unlearning, warm_start as warm_start_lib
from tunixlike.rl import hooks as hooks_lib, in_flight as in_flight_lib, transport as transport_lib
from tunixlike.rl.hooks import StepInfo
from tunixlike.rl.preemption import Preemption
from tunixlike.rl.prompts import PromptStream
from tunixlike.rl import lockstep as lockstep_lib, schedule as schedule_lib
from tunixlike.rl.lockstep import LockstepQueue
from tunixlike.rl import queue as queue_lib
from tunixlike.rl.queue import RolloutQueue
from tunixlike.rl.runtime import AsyncRuntime

log = logging.getLogger("tunixlike")


class SetupError(ValueError):
  """Bad input found while building the run (mesh sizes, model files, data, workdir): one clear line."""


def run(cfg: Config, workdir: str, *, transport: transport_lib.Transport | None = None, on_second_interrupt=None,
        on_host_fault=None, stages=None, **user) -> dict[str, Any]:
  """Trains (or resumes the run in `workdir`); returns a summary or raises: the library never ends the
  process, its entry point decides how to (`tunixlike.train`). See the module docstring.
  `transport`: the run's layout, chosen and started by the entry point (`tunixlike.layouts.start`;
  None: the sampler side in every process, `build.start_processes`).
  `user`: in-memory `dataset`, `eval_dataset`, `rewards`, `env`, `agent`, `hooks` (see `tunixlike.train`).
  `on_second_interrupt()`: what a second Ctrl-C does (the CLI exits at once); None raises KeyboardInterrupt.
  `on_host_fault(line, host)`: what a learner host does when a sampler host failed while its loop is
  stuck in a collective or transfer (the CLI exits at once); None says `line` and raises once the
  stuck call returns. `stages(run)`: the stages after the build, on this run's `_Run` (default: one
  policy's; `multi_agent.trainer`)."""
  try:  # before anything touches a JAX backend (the checkpointer does)
    transport = transport or build_lib.start_processes(cfg)
  except ValueError as e:
    raise SetupError(str(e)) from e
  with claimed(workdir, on_second_interrupt) as preemption:
    r = _Run(cfg, workdir, preemption, transport, on_host_fault=on_host_fault, **user)
    try:
      return (stages or _stages)(r)
    except BaseException:
      r.close(quietly=True)  # the run's own error is the one to report
      raise


@contextlib.contextmanager
def claimed(workdir: str, on_second_interrupt=None):
  """This process's part of `workdir` prepared and locked, and its signals handled (`Preemption`,
  yielded), for the block: every process of a run, whatever its role."""
  mine = workdir_lib.local_dir(workdir, jax.process_index())
  try:
    for directory in dict.fromkeys([workdir, mine] if not workdir_lib.is_remote(workdir) else [mine]):
      workdir_lib.prepare(directory)  # process 0's logs are the workdir itself
    lock = workdir_lib.WorkdirLock(mine).acquire()  # a remote WORKDIR: its local log mirror is locked
  except workdir_lib.WorkdirError as e:
    raise SetupError(str(e)) from e
  try:
    with Preemption(on_second=on_second_interrupt) as preemption:
      yield preemption
  finally:
    lock.release()


def built(cfg: Config, preemption: Preemption, trace_path: str | None = None, **kw) -> build_lib.Setup:
  """`build.build`, stopped by a signal with nothing to save (`StartupInterrupted`); bad input raises
  `SetupError` (one line), before any output."""
  try:
    with preemption.starting():
      return build_lib.build(cfg, trace_path, **kw)
  except (ValueError, OSError, models.CheckpointError) as e:
    raise SetupError(str(e)) from e


def _stages(r: _Run) -> dict[str, Any]:
  latest = r.ckpt.latest_step()
  if latest is not None:
    r.check_resumable(_readable_meta(r.ckpt, latest), latest)  # before the slow part of a refused restart
  data = _start_fresh(r) if latest is None else _restore(r)
  if data is None:
    r.close()
    return {"preempted": True, "step": 0}
  if r.version >= r.cfg.rl.num_steps and r.version in r.evals:
    if latest is not None:
      r.say(f"the run in {r.workdir} is finished (step {r.version} of rl.num_steps={r.cfg.rl.num_steps}); nothing "
            "to do (raise rl.num_steps to train on)")
    elif not r.cfg.rl.num_steps:
      r.say("rl.num_steps=0: the supervised stage only; its result is the checkpoint at step 0 (run again with "
            "rl.num_steps > 0 and the same --workdir to go on with RL)")
    return _finish(r, r.evals[r.version])
  summary = _rl(r, data)
  if summary.get("preempted"):
    return summary
  try:
    acc_after = r.eval()
  finally:  # with the final eval as its metric, or without it if the eval failed
    r.save(data, force=True)
  r.ckpt.wait()
  return {**summary, **_finish(r, acc_after)}


# ---- the stages ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Data:
  """Where the run is in its data, saved with every checkpoint beside the policy state: the prompt
  stream (its position and the prompts in flight, replayed on resume unless kept), the rollout queue
  (its admission counters) and the rollouts in flight (`rl/in_flight.py`). Built by `_start_fresh` or
  `_restore`, then handed to the RL loop."""

  stream: PromptStream
  queue: RolloutQueue
  kept: in_flight_lib.Kept | None = None  # the resumed checkpoint's rollouts in flight, which the driver continues
  in_flight: Callable[[], in_flight_lib.Kept | None] | None = None  # the rollouts in flight now (the RL loop sets it)
  replay_point: Callable[[], None] | None = None  # saves a replay point at the current version (the RL loop sets it)


def _start_fresh(r: _Run) -> _Data | None:
  """Warm start, build the RL stack, the first eval, and a checkpoint at step 0 that keeps both.
  Returns None when a preemption stopped the warm start (nothing worth resuming yet)."""
  cfg = r.cfg
  r.open_logs(None)
  if cfg.warm_start.max_steps and not _warm_start(r):
    return None
  rl = r.build_rl()
  stream = r.transport.stream(r.setup.train_pipe)
  data = _Data(stream, build_lib.make_queue(cfg, rl.policy, stream))
  r.eval()
  r.save(data, force=True)  # the warm start and the first eval are never redone
  if cfg.warm_start.max_steps and r.pid == 0:
    r.ckpt.wait()
    epath.Path(r.workdir, checkpoint_lib.WARM_START_SUBDIR).rmtree(missing_ok=True)  # the step-0 checkpoint holds it
  return data


def _warm_start(r: _Run) -> bool:
  """The supervised stage, continued from WORKDIR/warm_start when an earlier one was stopped (or
  crashed after a periodic save there). Returns False when it was stopped again (and saved there)."""
  setup, ws = r.setup, r.cfg.warm_start
  paused = checkpoint_lib.Checkpointer(os.path.join(r.workdir, checkpoint_lib.WARM_START_SUBDIR),
                                       checkpoint_lib.CheckpointSchedule.from_config(r.cfg, keep=1))
  try:
    optimizer = warm_start_lib.make_optimizer(setup.model, ws.learning_rate, r.cfg.optim)
    start = _resume_warm_start(r, paused, optimizer)
    save = lambda step: paused.save(step, _warm_start_state(setup.model, optimizer),
                                    {"config": dataclasses.asdict(r.cfg)}, force=True)
    every = r.cfg.checkpoint.every_steps

    def on_step(step: int, metrics: dict):
      r.logger.progress_to(step)
      r.logger.show(metrics)
      if every and step % every == 0 and step < ws.max_steps:
        save(step)  # a crash loses at most checkpoint.every_steps steps

    r.logger.progress("warm start", total=ws.max_steps, initial=start)
    summary = build_lib.warm_start(setup, say=r.say, should_stop=r.stop_requested, on_step=on_step,
                                   on_eval=lambda metrics: r.logger.write(0, metrics, advance=False),
                                   optimizer=optimizer, start_step=start)
    r.logger.progress_to(summary["warm_start/steps"])
    if summary["warm_start/interrupted"]:
      step = summary["warm_start/steps"]
      save(step)
      r.say(f"stopped during the warm start at step {step}; saved it: the next run with this --workdir continues it")
      return False
  finally:
    r.logger.end_progress()  # the RL stage gets its own bar
    paused.close()
  r.logger.write(0, summary, advance=False)
  return True


def _warm_start_state(model, optimizer) -> dict:
  return {"params": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}


def _resume_warm_start(r: _Run, paused: checkpoint_lib.Checkpointer, optimizer) -> int:
  """Restores an interrupted warm start into the model and its optimizer; returns its step (0: none)."""
  step = paused.latest_step()
  if step is None:
    return 0
  r.check_resumable(_readable_meta(paused, step), step)
  # Arrays not yet placed (the optimizer's step count) come back replicated on the learner mesh,
  # where the jitted warm-start step can use them with the model's shards.
  replicated = NamedSharding(r.setup.meshes.learner, PartitionSpec())
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed
                                                       else replicated), _warm_start_state(r.setup.model, optimizer))
  state, _ = paused.restore(abstract_state=target)
  nnx.update(r.setup.model, state["params"])
  nnx.update(optimizer, state["optimizer"])
  r.say(f"continuing the warm start from step {step} ({paused.step_dir(step)})")
  return step


def _restore(r: _Run) -> _Data:
  """The newest readable checkpoint: policy state, logs cut back to it, counters, evals, and the
  data position it returns."""
  policy = r.build_rl().policy
  meta = policy.restore(r.ckpt)  # step=None: a damaged newest checkpoint falls back, with a warning
  where = r.ckpt.step_dir(policy.version)
  data_changed = r.check_resumable(meta, policy.version,
                                   json.loads(json.dumps(dataclasses.asdict(policy.model().cfg))))
  r.open_logs(policy.version)
  r.restore_records(meta)
  kept = None if data_changed else r.kept_rollouts(meta, policy.version)
  # The queue's counters continue; the checkpoint's rollouts in flight come first.
  with_queue = lambda stream: _Data(stream, build_lib.make_queue(r.cfg, policy, stream, meta.get("queue"), kept), kept)
  streams = meta.get("streams", [meta["stream"]])  # one per process that reads prompts (its own data shard)
  readers = r.transport.decoders
  if len(streams) != readers:
    raise SetupError(f"{where} was saved by a run whose prompts {len(streams)} processes read; resuming needs the "
                     f"same number, not {readers}")
  mine = r.transport.own(streams)
  if data_changed:  # data.allow_change: positions in the old data mean nothing in the new
    r.say(f"resumed from {where} at step {policy.version} on changed data ({'; '.join(data_changed)}); "
          f"data.allow_change: the prompt stream starts again at the start of the new data, and the "
          f"{sum(len(s['outstanding']) for s in mine)} prompts in flight in the old data are not regenerated")
    return with_queue(r.transport.stream(r.setup.train_pipe))
  stream = r.transport.stream(r.setup.train_pipe, mine, kept)
  r.counters["groups_regenerated"] += stream.replayed
  if kept is not None:
    r.counters["groups_continued"] += len(kept.scored) + len(kept.in_flight)
    r.counters["tokens_kept"] += kept.tokens
  if policy.version < r.cfg.rl.num_steps:  # a finished run says so in _stages, and regenerates nothing
    r.say(f"resumed from {where} at step {policy.version}; " + r.resume_line(meta, kept, stream.replayed))
  return with_queue(stream)


def _rl(r: _Run, data: _Data) -> dict[str, Any]:
  """The async RL loop from the current version to rl.num_steps (checkpointed when it is stopped)."""
  cfg, rl = r.cfg, r.rl
  if r.stop_requested():  # stopped during the first eval: the step-0 checkpoint has it
    return _stopped(r, data, {})
  r.transport.start(data.stream)
  recorder = r.schedule_recorder(data)
  runtime = build_lib.make_runtime(r.setup, rl, data.stream, num_steps=max(cfg.rl.num_steps - r.version, 0),
                                   collapse=build_lib.collapse_detector(cfg, rl.policy), queue=data.queue, say=r.say,
                                   on_fault=r.host_fault, on_sampler_step=recorder and recorder.sampler_step,
                                   resume=data.kept.in_flight if data.kept is not None else ())
  if in_flight_lib.why_not(cfg) is None:
    data.in_flight = lambda: in_flight_lib.take(runtime.driver, runtime.rewards, data.queue, cfg.rl.wait_timeout_s)
  if recorder is not None and r.replay_every:
    runtime.hold_at = lambda version: version % r.replay_every == 0 and version < cfg.rl.num_steps
    data.replay_point = lambda: r.save_replay_point(data, runtime, recorder)
  if recorder is not None:
    runtime.on_batch = recorder.took
    runtime.hooks.add(lambda info: recorder.step(info, rl.policy))
  r.add_hooks(runtime, data)
  r.logger.progress("rl", total=cfg.rl.num_steps, initial=r.version)
  try:
    summary = runtime.run()
  except unlearning.Unlearning:
    raise
  except collapse_lib.PolicyCollapse:
    best = r.ckpt.best_step()
    r.say("policy collapsed: the collapsed state is not saved; "
          + (f"the best checkpoint is {r.ckpt.step_dir(best)}" if best is not None else "no eval checkpoint yet"))
    raise
  except transport_lib.PeerFault as e:  # the other end died or hangs: the run cannot save without it
    raise type(e)(r.fault_line(e), e.host) from None
  except BaseException:
    fault = r.transport.fault_elsewhere()
    if fault is not None:  # another learner host stopped on a fault first, and this one's collective with it failed
      raise fault from None
    if r.multi:  # a save needs every process, and the others may be gone: rely on periodic saves
      r.say(f"run failed on process {r.pid}; not saving (a multi-process save needs every process)")
    else:
      r.say("run failed: saving the last good learner state before re-raising")
      try:
        r.save(data, force=True)
        r.ckpt.wait()
      except Exception as e:  # e.g. the same full disk: report it, but re-raise the run's own error
        r.say(f"the checkpoint could not be saved either ({type(e).__name__}: {e})")
    raise
  finally:
    r.logger.end_progress()  # the final eval and the summary print below the finished bar
  if runtime.preempted:
    return _stopped(r, data, summary)
  return summary


def _stopped(r: _Run, data: _Data, summary: dict) -> dict[str, Any]:
  r.save(data, force=True)
  r.ckpt.wait()
  r.say(f"stopped at step {r.version}; checkpoint saved; run again with the same --workdir to resume")
  step = r.version
  r.close()
  return {**summary, "preempted": True, "step": step}


def _finish(r: _Run, acc_after: float) -> dict[str, Any]:
  """The final line of accuracy, then where the run's outputs are (also in the summary, None when off)."""
  acc_before = r.evals[min(r.evals)] if r.evals else float("nan")
  logs, elapsed_s, latest = r.logger.outputs, r.logger.elapsed_s, r.ckpt.latest_step()
  best_step, best_acc = unlearning.best(r.evals) or (None, float("nan"))
  session_s = r.logger.session_s
  took = (f"in {elapsed_s:.0f} s" if elapsed_s - session_s < 1.0 else
          f"in {elapsed_s:.0f} s ({session_s:.0f} s in this session, the rest before the resume)")
  r.say(f"held-out accuracy {acc_before:.3f} -> {acc_after:.3f} ({100 * (acc_after - acc_before):+.1f} points) "
        f"{took}; the best was {best_acc:.3f} at step {best_step}")
  r.close()  # the trace and the logs are complete from here
  outputs = {"checkpoint": None if latest is None else r.ckpt.step_dir(latest),
             "best": None if best_step is None else r.ckpt.step_dir(best_step), "metrics": logs["metrics"],
             "plot": metrics_lib.plot(logs["metrics"], os.path.join(r.dir, "reward.png")) if r.pid == 0 else None,
             "tensorboard": logs.get("tensorboard"), "trace": r.trace_path, "wandb": logs.get("wandb")}
  r.say("outputs:" + "".join(f"\n  {key:<12}{path}" for key, path in outputs.items() if path is not None))
  return {"eval/accuracy_before": acc_before, "eval/accuracy_after": acc_after, "eval/best_accuracy": best_acc,
          "eval/best_step": best_step, **outputs,
          "wall_s_total": elapsed_s, **r.counters}


def _readable_meta(ckpt: checkpoint_lib.Checkpointer, step: int) -> dict | None:
  try:
    return ckpt.read_meta(step)
  except checkpoint_lib.CheckpointError:
    return None  # a damaged checkpoint: the restore falls back to an older one and checks that


def checkpoint_meta(setup: build_lib.Setup, rl: build_lib.RLStack, stream: PromptStream, counters: dict,
                    queue: dict | None = None, data: dict | None = None,
                    stream_state: dict | None = None) -> dict[str, Any]:
  """Everything besides arrays that resuming (and export) needs, as plain JSON: the policy version,
  the data position with the prompts in flight (replayed on resume), the run's counters, the
  queue's admission counters, the config it was trained with and the data's fingerprints
  (`resume.data_fingerprints`; both checked on resume). `stream_state`: this process's stream
  position to resume from, where it is not `stream.state()` (a deterministic run's round start)."""
  cfg, model_cfg = setup.cfg, rl.policy.model().cfg
  own = stream.state() if stream_state is None else stream_state
  # Each reader of the prompts (a process, or a sampler host) keeps its stream position, in order.
  streams = setup.transport.stream_states(stream, own)
  return json.loads(json.dumps({
      "version": rl.policy.version, "stream": own if streams is None else streams[0],
      **({"streams": streams} if streams is not None else {}), "counters": counters,
      **({"queue": queue} if queue is not None else {}), **({"data": data} if data is not None else {}),
      "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(model_cfg),
      "lora": ({"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets)}
               if cfg.lora.rank else None),
      **({"hf_path": cfg.model.hf_path} if cfg.model.hf_path else {})}))


IN_MEMORY = "<in memory"  # how the saved config names an object given to tunixlike.train that no file holds


def _import_path(obj) -> str:
  """`module:qualname` of a function or class, or `<in memory: name>` when it cannot be imported."""
  module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", type(obj).__name__)
  if module in (None, "__main__") or "<locals>" in name or "<lambda>" in name:
    return f"{IN_MEMORY}: {name}>"
  return f"{module}:{name}"


def _rows(data) -> str:
  if isinstance(data, (str, os.PathLike)):
    return os.fspath(data)
  return f"{IN_MEMORY}: {len(data) if hasattr(data, '__len__') else 'an iterable of'} rows>"


def as_trained(cfg: Config, setup: build_lib.Setup, user: dict) -> Config:
  """`cfg` with the objects given to `tunixlike.train` in memory recorded by what they are, so the
  checkpoint's saved config says what was trained on: rows as `<in memory: N rows>` (a path as
  itself), functions and classes by import path (`<in memory: name>` when they have none)."""
  data = {key: _rows(user[arg]) for key, arg in (("train", "dataset"), ("eval", "eval_dataset"))
          if user.get(arg) is not None}
  rl = {key: user[key] if isinstance(user[key], str) else _import_path(user[key]) for key in ("env", "agent")
        if user.get(key) is not None}
  changes: dict[str, Any] = {"data": data, "rl": rl}
  if user.get("rewards") is not None:
    changes["rewards"] = tuple({"fn": spec.fn if isinstance(spec.fn, str) else _import_path(spec.fn),
                                "weight": float(spec.weight), "kwargs": dict(spec.kwargs), "name": spec.name}
                               for spec in setup.reward.specs)
  return config_lib.replace(cfg, **{k: v for k, v in changes.items() if v})


# ---- one run's state, shared by its stages, and the loop's hooks ------------------------------------
class _Run:
  """One run: its setup and RL stack, logs, checkpoints, prompt accounting, evals and hooks."""

  def __init__(self, cfg: Config, workdir: str, preemption: Preemption, transport: transport_lib.Transport, hooks=(),
               on_host_fault=None, **user):
    self.cfg, self.workdir, self.preemption, self.on_host_fault = cfg, workdir, preemption, on_host_fault
    self.user_hooks = hooks_lib.user_hooks(hooks)  # (fn, every): `tunixlike.train(hooks=...)`
    self.pid = jax.process_index()
    self.dir = workdir_lib.local_dir(workdir, self.pid)  # this process's logs (WORKDIR itself on process 0)
    self.say = print
    self.trace_path = os.path.join(self.dir, "trace.json") if cfg.log.trace else None
    # Fails fast on bad meshes, model files or data, before any output (and before orbax's threads).
    self.setup = built(cfg, preemption, self.trace_path, transport=transport, **user)
    self.data_fingerprints = resume_lib.data_fingerprints(self.setup.task)  # kept in every checkpoint
    # What the checkpoints record (and a resume compares): the config as trained, with what build resolved
    # (a sampler.max_new_tokens sized from the data).
    self.cfg = cfg = as_trained(self.setup.cfg, self.setup, user)
    self.setup = dataclasses.replace(self.setup, cfg=cfg)
    self.transport = self.setup.transport  # to the sampler side, wherever it is
    self.ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.workdir_checkpoints(workdir),
                                            checkpoint_lib.CheckpointSchedule.from_config(cfg),
                                            processes=self.transport.checkpoint_processes,
                                            save_frozen=not (cfg.model.hf_path and cfg.lora.rank),
                                            best_metric="eval/accuracy",
                                            keep_steps=self.replay_starts(), keep_every_steps=self.replay_every)
    self.rl: build_lib.RLStack | None = None
    self.logger: metrics_lib.MetricsLogger | None = None
    self.prompts_log = os.path.join(self.dir, "prompts.jsonl")
    self.counters = {"groups_trained": 0, "groups_dropped": 0, "groups_regenerated": 0, "groups_continued": 0,
                     "tokens_kept": 0}
    self.evals: dict[int, float] = {}  # version -> held-out accuracy measured at it
    self.truncation = truncation_guard.TruncationGuard(
        cfg.sampler.max_new_tokens, cfg.rl.truncated_warn_share, lambda line: self.say(line),
        longest_answer=build_lib.longest_answer(self.setup))

  @property
  def version(self) -> int:
    return self.rl.policy.version

  @property
  def records_schedule(self) -> bool:
    """log.schedule, for the runs a replay can rerun: single-turn rollouts decoded by this process."""
    return self.cfg.log.schedule and not lockstep_lib.timed_elsewhere(self.cfg)

  @property
  def replay_every(self) -> int:
    """log.replay_every where it applies: a free-running run that records its schedule."""
    return self.cfg.log.replay_every if self.records_schedule and not self.cfg.rl.deterministic else 0

  def replay_starts(self) -> tuple[int, ...]:
    """The checkpoints a replay starts from, kept beside the latest ones while log.schedule records:
    step 0 and every step the run started a segment from (the one it resumes from now included)."""
    if not self.records_schedule:
      return ()
    path = os.path.join(self.dir, schedule_lib.FILE)
    starts = {r["segment"] for r in schedule_lib.read(path) if "segment" in r} if os.path.exists(path) else set()
    # A listing, not an orbax manager: its start is a collective the processes would reach at different times.
    latest = checkpoint_lib.last_saved_step(checkpoint_lib.workdir_checkpoints(self.workdir))
    return tuple(sorted(starts | {0} | ({latest} if latest is not None else set())))

  def schedule_recorder(self, data: _Data) -> schedule_lib.Recorder | None:
    """WORKDIR/schedule.jsonl's writer, its segment starting here (`rl/schedule.py`)."""
    if not self.records_schedule:
      return None
    return schedule_lib.Recorder(os.path.join(self.dir, schedule_lib.FILE), segment=self.version,
                                 stream=data.stream.state(), queue=data.queue.counts(),
                                 first_seq=getattr(data.queue, "first_seq", 0), kept=data.kept is not None)

  @property
  def multi(self) -> bool:
    """Several processes train in lockstep (the learner hosts, with whole sampler hosts)."""
    return distributed.is_multiprocess()

  def build_rl(self) -> build_lib.RLStack:
    self.rl = build_lib.build_rl(self.setup)
    return self.rl

  def agreed(self, flag: bool) -> bool:
    """True on every process when `flag` is true on any: a decision that leads to a collective
    (a save, a stop) must not be taken on one host only."""
    return distributed.any_process(flag) if self.multi else flag

  def stop_requested(self) -> bool:
    """A preemption seen by any process (a signal reaches the hosts at different times; one on the
    other end of the transport reaches this side through it)."""
    asked = self.transport.stop_asked()
    if asked is not None and not self.preemption.requested:
      self.preemption.requested = True
      self.say(f"{asked} received a signal: finishing the current step, saving a checkpoint")
    return self.agreed(self.preemption.requested)

  def check_resumable(self, meta: dict | None, step: int, model_cfg: dict | None = None) -> list[str]:
    """A restart whose config would change what checkpoint `step` was trained with is refused; so is
    one whose data changed, unless data.allow_change. Returns what changed in the data ([]: nothing)."""
    if meta is None:
      return []
    where = self.ckpt.step_dir(step)
    try:
      resume_lib.check_compatible(meta, self.cfg, model_cfg or {}, where)
    except resume_lib.IncompatibleResume as e:
      raise SetupError(str(e)) from e
    changed = resume_lib.data_changes(meta.get("data"), self.data_fingerprints)
    if changed and not self.cfg.data.allow_change:
      raise SetupError(f"{where} was trained on other data: {'; '.join(changed)}. Resuming would continue its prompt "
                       "stream by position into other rows. Restore the data, use a new --workdir, or set "
                       "data.allow_change=true to start the stream again on the new data")
    carved = isinstance(self.setup.task, tasks_lib.DatasetTask) and self.setup.task.eval is None
    if carved and any(c.startswith("data.train") for c in changed):
      raise SetupError(f"{where}: data.train changed ({'; '.join(changed)}) and the held-out split is carved from it: "
                       "it would be carved again from the new rows, so former held-out prompts could be trained on. "
                       "Give a fixed held-out file (data.eval) to resume on changed data, or use a new --workdir")
    return changed

  # ---- logs ----
  def open_logs(self, step: int | None):
    """Logs cut back to checkpoint `step` (None: a fresh start), continued from there; then the
    run's one-line description."""
    offset = resume_lib.cut_logs(self.dir, step)
    cfg, setup = self.cfg, self.setup
    self.logger = metrics_lib.MetricsLogger(self.dir, tensorboard=cfg.log.tensorboard and self.pid == 0,
                                            progress_bar=cfg.log.progress_bar and self.pid == 0,
                                            time_offset_s=offset, wandb=cfg.log.wandb and self.pid == 0,
                                            wandb_project=cfg.log.wandb_project, config=dataclasses.asdict(cfg))
    self.say = self.preemption.say = self.logger.info
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(setup.model, nnx.Param)))
    self.say(f"tunixlike: task {cfg.data.task}, {n_params:,} params, sampler {dict(setup.meshes.sampler.shape)}, "
             f"learner {dict(setup.meshes.learner.shape)}")
    self.say(lockstep_lib.describe(cfg))
    lines = self.transport.describe()  # the layout: this process's role and devices
    for line in (lines if self.pid == 0 else lines[self.pid:self.pid + 1]):
      self.say(line)

  def close(self, quietly: bool = False):
    """Closes what the run opened (tracer, logs, checkpointer, reward threads) and uploads a remote
    workdir's logs. `quietly`: failures are logged, not raised (an error is already on its way)."""
    closers = [self.transport.end, self.setup.tracer.close, self._close_logs, self.ckpt.close]
    closers += [self.rl.close] if self.rl is not None else []
    closers += [] if quietly else [lambda: workdir_lib.upload_logs(self.workdir, self.pid, self.say)]
    for close in closers:
      try:
        close()
      except Exception as e:
        if not quietly:
          raise
        log.warning(f"while stopping: {type(e).__name__}: {e}")

  def fault_line(self, error: BaseException) -> str:
    """The one line that says a host died or hangs, and where the run resumes from; also told to the
    other hosts (the first learner host to say it is the one heard), which stop saying it too."""
    latest = self.ckpt.latest_step()
    line = (f"{error}; the last checkpoint is {self.ckpt.step_dir(latest) if latest is not None else 'none yet'}: "
            "run the same command again to resume from it")
    self.transport.end(failure=line, host=getattr(error, "host", None))
    return line

  def host_fault(self, error: BaseException) -> None:
    """A sampler host failed while this learner host's loop is stuck (`RemoteSampling`): says so and
    hands the decision to the entry point (`on_host_fault`); a library call raises when the loop returns."""
    line = self.fault_line(error)
    if self.on_host_fault is not None:
      self.on_host_fault(line, getattr(error, "host", None))
    else:
      self.say(line)

  def _close_logs(self):
    if self.logger is not None:
      logger, self.logger = self.logger, None
      logger.close()

  # ---- evals and checkpoints ----
  def eval(self) -> float:
    version = self.version
    out = build_lib.evaluate(self.setup, self.rl)
    self.logger.write(version, out, advance=False)
    self.truncation.check(out["eval/truncated"], f"the held-out answers at step {version}")
    failures = out.get("eval/reward_failures", 0)
    self.say(f"eval at step {version}: accuracy {out['eval/accuracy']:.3f} on {out['eval/num_prompts']} "
             f"held-out prompts" + (f" ({failures} completions the verifier failed on)" if failures else ""))
    self.evals[version] = out["eval/accuracy"]
    return out["eval/accuracy"]

  def save(self, data: _Data, force: bool = False, replay_point: bool = False):
    """A checkpoint when forced or when orbax's save policy says so (every N steps or seconds); a
    replay point's keeps the queue's groups whatever checkpoint.keep_rollouts says."""
    version = self.version
    if self.agreed(force or self.ckpt.should_save(version)):
      acc = self.evals.get(version)
      stream_state, kept = self.carry_over(data)
      meta = checkpoint_meta(self.setup, self.rl, data.stream, self.counters, queue=data.queue.counts(),
                             data=self.data_fingerprints, stream_state=stream_state)
      gather = lambda mine: distributed.allgather_json(mine) if self.multi else [mine]
      if data.in_flight is not None:  # what a resume decodes again unless kept (its line says)
        meta["in_flight_tokens"] = gather(kept.tokens if kept is not None else None)
      keep = kept is not None and (self.cfg.rl.deterministic or self.cfg.checkpoint.keep_rollouts or replay_point)
      extra = None
      if not self.agreed(not keep):  # every process's, or none (a sampler that failed or hung)
        extra = {"rollouts": {"processes": gather(in_flight_lib.to_json(kept))}}
        meta["carried"] = "deterministic" if self.cfg.rl.deterministic else "in_flight"
      self.ckpt.save(version, self.rl.policy.state, meta, metrics=None if acc is None else {"eval/accuracy": acc},
                     force=True, extra=extra)

  def carry_over(self, data: _Data) -> tuple[dict | None, in_flight_lib.Kept | None]:
    """What the checkpoint keeps of the rollouts in flight: rl.deterministic, the groups started before
    the sampler's current round that no step has examined and the stream position at that round's
    start (`LockstepQueue.carry_over`); a free-running run, every group in flight with its tokens so far
    (`rl/in_flight.py`). (None, None) when the run keeps none, or when the sampler stopped on an error
    or hangs (a resume then regenerates what was in flight)."""
    if isinstance(data.queue, LockstepQueue):
      carry = data.queue.carry_over(self.cfg.rl.wait_timeout_s)
      if carry is None:
        return None, None
      groups, position = carry
      return {"position": position, "outstanding": []}, in_flight_lib.Kept(scored=groups, in_flight=[], next_seq=0)
    return None, data.in_flight() if data.in_flight is not None else None

  def kept_rollouts(self, meta: dict, step: int) -> in_flight_lib.Kept | None:
    """This process's rollouts in flight that checkpoint `step` kept and this run continues (None: none)."""
    kind = meta.get("carried")
    if self.cfg.rl.deterministic and step and kind != "deterministic":
      self.say(f"{self.ckpt.step_dir(step)} was saved after an error or by a free-running run, without the sampler's "
               "finished groups: the prompts in flight are regenerated, so this run goes on deterministically but "
               "not as one never stopped would have")
    continues = in_flight_lib.why_not(self.cfg) is None and self.cfg.checkpoint.keep_rollouts
    if kind is None or kind != ("deterministic" if self.cfg.rl.deterministic else "in_flight" if continues else None):
      return None
    return in_flight_lib.from_json(self.ckpt.read_item(step, "rollouts")["processes"][self.pid])

  def resume_line(self, meta: dict, kept: in_flight_lib.Kept | None, regenerated: int) -> str:
    """What the resume does with the prompts that were in flight."""
    if self.cfg.rl.deterministic:
      return (f"regenerating {regenerated} prompts that were in flight"
              + (f", {len(kept.scored)} finished ones kept" if kept is not None and kept.scored else ""))
    if kept is not None:
      return (f"continuing {len(kept.scored) + len(kept.in_flight)} prompts that were in flight ({kept.tokens} tokens "
              f"kept, not decoded again)" + (f"; regenerating {regenerated}" if regenerated else ""))
    line = f"regenerating {regenerated} prompts that were in flight"
    tokens = (meta.get("in_flight_tokens") or [None] * (self.pid + 1))[self.pid]
    why = in_flight_lib.why_not(self.cfg)
    if tokens:
      line += f" ({tokens} tokens decoded again; checkpoint.keep_rollouts=true keeps them)"
    elif why:
      line += f" (not kept with {why})"
    return line

  def restore_records(self, meta: dict) -> None:
    """The counters of checkpoint `meta` and the held-out accuracies in the (cut back) metrics log."""
    self.counters.update(meta["counters"])
    for rec in metrics_lib.read_jsonl(self.logger.path):
      if "eval/accuracy" in rec:
        self.evals[rec["step"]] = rec["eval/accuracy"]

  # ---- the loop's hooks, in the order they run after every step ----
  def add_hooks(self, runtime: AsyncRuntime, data: _Data):
    runtime.hooks.add(lambda info: self.account_prompts(info, data.stream))
    for fn, every in self.user_hooks:  # before the metrics hook: what they add to info.metrics is logged
      runtime.hooks.add(fn, every=every)
    runtime.hooks.add(self.log_metrics)
    if self.cfg.rl.no_signal_warn_steps:
      runtime.hooks.add(signal_guard.NoSignalGuard(self.cfg.rl.no_signal_warn_steps, self.cfg.rl.no_signal_warn_share,
                                                   lambda m: self.say(m)))
    runtime.hooks.add(self.truncation)
    if self.cfg.log.completions_every and self.pid == 0:
      runtime.hooks.add(self.log_completions, every=self.cfg.log.completions_every)
    if self.cfg.rl.stop_on_collapse:
      runtime.hooks.add(collapse_lib.stop_on_collapse)  # logged, but neither evaluated nor saved
    if self.cfg.eval.every_steps:
      runtime.hooks.add(self.periodic_eval, every=self.cfg.eval.every_steps)
    runtime.hooks.add(lambda info: self.periodic_save(info, data))  # after the eval: the checkpoint keeps its accuracy

    def check_preemption(info: StepInfo):  # a signal seen by any process ends the loop after this step
      if self.stop_requested():
        runtime.request_stop()

    runtime.hooks.add(check_preemption)

  def account_prompts(self, info: StepInfo, stream: PromptStream):
    """Prompts trained or dropped leave the stream's outstanding set (what a resume replays)."""
    stream.done(info.trained + info.dropped)
    self.counters["groups_trained"] += len(info.trained)
    self.counters["groups_dropped"] += len(info.dropped)
    line = json.dumps({"step": info.step, "trained": [g.columns["stream_index"] for g in info.trained],
                       "dropped": [g.columns["stream_index"] for g in info.dropped]}) + "\n"
    try:
      with open(self.prompts_log, "a", encoding="utf-8") as f:
        f.write(line)
    except OSError as e:
      raise metrics_lib.LogWriteError(f"{self.prompts_log}: prompt log write failed: {e}", e.errno) from e

  def log_metrics(self, info: StepInfo):
    self.logger.write(info.step, info.metrics)

  def log_completions(self, info: StepInfo):
    rows = completions_log.completion_rows(info.trained[:self.cfg.log.completions_groups], self.setup.tok,
                                           step=info.step)
    self.logger.write_completions(info.step, rows, completions_log.markdown(rows))

  def periodic_eval(self, info: StepInfo):
    if info.version < self.cfg.rl.num_steps:  # the last step's eval is the final one
      self.eval()  # the sampler keeps decoding meanwhile; only the learner waits
      problem = unlearning.check(self.evals, margin=self.cfg.eval.unlearn_margin, patience=self.cfg.eval.unlearn_evals)
      if problem:  # the unlearned state is not saved: the best one is what to go on from
        step, acc = unlearning.best(self.evals)
        raise unlearning.Unlearning(
            f"{problem}: stopped. The best held-out accuracy was {acc:.3f} at step {step} "
            f"({self.ckpt.step_dir(step)}): export it with `python -m tunixlike.export --workdir {self.workdir} --best "
            f"--out DIR` and start again from it with model.hf_path=DIR and a lower optim.learning_rate than this "
            f"run's {self.cfg.optim.learning_rate:g} (the export records it and sampler.temperature, which a run "
            "from DIR otherwise keeps) (eval.unlearn_evals=0 turns this guard off)")

  def periodic_save(self, info: StepInfo, data: _Data):
    if info.version < self.cfg.rl.num_steps:  # the last step's checkpoint is saved after the final eval
      if data.replay_point is not None and info.version % self.replay_every == 0:
        data.replay_point()
      else:
        self.save(data, force=info.version in self.evals)  # every evaluated state is saved: it may be the best one

  def save_replay_point(self, data: _Data, runtime: AsyncRuntime, recorder: schedule_lib.Recorder):
    """A replay point at the current version (log.replay_every): the sampler, handed these weights to
    take drained and hold (`runtime.hold_at`), is idle with them and every finished group is in the
    queue; the checkpoint then keeps the queue, and the record says where a replay may start."""
    version, timeout = self.version, self.cfg.rl.wait_timeout_s
    try:
      if not (runtime.driver.wait_held(version, timeout) and runtime.rewards.wait_idle(timeout)):
        raise queue_lib.QueueTimeout(f"the sampler did not drain for the replay point at step {version} within "
                                     f"rl.wait_timeout_s={timeout:g}; is it stuck?")
      self.save(data, force=True, replay_point=True)
      recorder.replay_point(version, stream=data.stream.state(), queue=data.queue.counts(),
                            first_seq=runtime.driver.next_seq)
    finally:
      runtime.driver.release()
