"""A sampler host's whole run (mesh.sampler_hosts > 0): decode, score, send; never train.

    wait for the learner hosts' start (where this host's prompt stream starts)
    -> receive the first weights -> compile the decode programs -> start the driver
    -> per group: admitted by the learner hosts' staleness rule (`rollouts.RemoteAdmission`),
       decoded, scored here, sent to the learner host it was admitted for
    -> every weight sync: received in a thread of its own (`weights.Receiver`) and swapped in
    -> until every learner host says the run is over

The engine, driver and reward stage are the same objects as on one host; only the queue's two
ends are on different hosts. A signal here (SIGTERM, Ctrl-C) asks the learner hosts to stop: they
save and end the run, and this host follows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time

import jax
from flax import nnx

from tunixlike.hosts import kv, learner_host, rollouts, weights
from tunixlike.models import lora as lora_lib
from tunixlike.rl import build as build_lib, weight_sync
from tunixlike.rl.prompts import PromptStream
from tunixlike.rl.runtime import RewardStage
from tunixlike.sampler import make_engine


class SamplerHostStopped(kv.HostTimeout):
  """The learner hosts stopped the run because a host died or hangs; the message is their line."""


class _Outbox:
  """The reward stage's queue on a sampler host: each scored group goes to its learner host."""

  def __init__(self, admission: rollouts.RemoteAdmission):
    self.admission, self.stop_event = admission, threading.Event()

  def put(self, group) -> None:
    self.admission.send(group)


class _PublishedStream:
  """This host's prompt stream; each prompt read is published (its position) before it starts."""

  def __init__(self, stream: PromptStream, shard: int):
    self.stream, self.shard = stream, shard

  def __iter__(self):
    return self

  def __next__(self):
    request = next(self.stream)
    learner_host.publish_position(self.shard, self.stream.position)
    return request


@contextlib.contextmanager
def _beating(admission: rollouts.RemoteAdmission):
  """Heartbeats from a thread of their own while the main thread is busy in the block."""
  done = threading.Event()

  def beat():
    while not done.wait(0.5):
      admission.heartbeat()

  beating = threading.Thread(target=beat, daemon=True, name="heartbeat")
  beating.start()
  try:
    yield
  finally:
    done.set()
    beating.join()


def _wait_for_start(should_stop, poll_s: float = 0.5):
  """The learner hosts' start message (after their warm start, restore and first eval); None if stopped."""
  while not should_stop():
    start = kv.wait(learner_host.START, poll_s, once=False)  # None: the learner hosts are not there yet
    if start is not None:
      return start
  return None


def _receiver(setup: build_lib.Setup, model: nnx.Module, engine, *, dump_dir: str | None = None) -> weights.Receiver:
  """This host's end of the learner hosts' weight sync (`transport.CrossHost.weight_sync`); `dump_dir`:
  where it writes what arrives (mesh.save_synced_weights)."""
  parts = {weights.MODEL: (weights.abstract(nnx.state(model)), engine.param_shardings)}
  if setup.cfg.lora.rank:
    adapters = nnx.state(model, nnx.LoRAParam)
    parts[weights.ADAPTERS] = (weights.abstract(adapters), weight_sync.subtree_like(engine.param_shardings, adapters))
  return weights.Receiver(setup.meshes.hosts, parts, dtype=setup.cfg.rl.sync_dtype,
                          bucket_bytes=weight_sync.DEFAULT_BUCKET_BYTES, timeout_s=setup.cfg.mesh.host_timeout_s,
                          dump_dir=dump_dir)


def _policy_structure(setup: build_lib.Setup) -> nnx.Module:
  """The policy's structure: `setup.model` (abstract where a process only decodes, `build.build`), with
  abstract adapters when lora.rank > 0: they arrive with the weights."""
  cfg = setup.cfg
  if not cfg.lora.rank:
    return setup.model
  lora = lora_lib.LoRAConfig.from_config(cfg)
  return nnx.eval_shape(lambda model: lora_lib.apply_lora(model, lora, seed=cfg.seed), setup.model)


def run(setup: build_lib.Setup, preemption, say=print) -> dict:
  """Samples for the learner hosts until they end the run; returns this host's counts and `busy_frac`
  (its driver's decode time over its wall clock since the driver started, at the last weight sync).
  Every weight sync that arrives is written to `CrossHost.synced_weights_dir` (mesh.save_synced_weights)."""
  cfg, layout, me = setup.cfg, setup.meshes.hosts, jax.process_index()
  index, count = layout.sampler_hosts.index(me), len(layout.sampler_hosts)
  model = _policy_structure(setup)
  engine = make_engine(model, build_lib.sampler_config(cfg, setup.tok, setup.transport.decoders),
                       mesh=setup.meshes.sampler)
  receiver = _receiver(setup, model, engine, dump_dir=setup.transport.synced_weights_dir)
  del model  # abstract (`build_lib.build_model`): the weights are the learner's, from the first sync on
  scorer = build_lib.build_scorer(setup)
  stopping = lambda: preemption.requested or learner_host.run_over() is not None

  def ask_learners_to_stop():
    kv.put(learner_host.STOP_REQUEST, str(me).encode())

  start = _wait_for_start(stopping)
  if start is None:
    ask_learners_to_stop()
    return {"preempted": True}
  mine = json.loads(start)["streams"][index]
  stream = PromptStream(setup.train_pipe, mine["position"], replay=mine["outstanding"], shard=(index, count))
  admission = rollouts.RemoteAdmission(index, count, layout.learner_hosts,
                                       batch_groups=cfg.rl.prompts_per_step // len(layout.learner_hosts),
                                       max_staleness=cfg.rl.max_staleness, host=me, timeout_s=cfg.mesh.host_timeout_s)
  with _beating(admission):  # the first weights (their programs compile here) take a while: keep the learners told
    got = receiver.receive(stopping)
  if got is None:
    ask_learners_to_stop()
    return {"preempted": True}
  params, version = got

  def arrived(version):  # `receive` compared the checksums: it raises when they differ
    _, part, total = receiver.checked[-1]
    say(f"sampler host {me}: weights v{version} ({part}) arrived, checksum {total} equal to the learner's")

  arrived(version)
  say(f"sampler host {me}: prompt shard {index} of {count} from position {stream.position}, {stream.replayed} "
      "prompts to regenerate")
  if cfg.sampler.warmup:  # compiling takes a while: the learner hosts hear from this host meanwhile
    with _beating(admission):
      engine.warmup(params)
  outbox = _Outbox(admission)
  rewards = RewardStage(scorer, outbox, cfg.rl.reward_workers)
  driver = build_lib.make_driver(setup, engine, scorer, _PublishedStream(stream, index), admission, rewards,
                                 weight_sync.Synced(params, version, 0.0), say=say)
  errors: list[BaseException] = []
  busy = {"busy_frac": 0.0}  # at the last weight sync: the runtime's sampler/busy_frac on one host

  def receive_weights():  # in the order the learner hosts send them, until the run ends
    try:
      while True:
        got = receiver.receive(lambda: admission.stopped or learner_host.run_over() is not None)
        if got is None:
          return
        driver.update_params(*got, drain=cfg.rl.sync_mode == "drain")
        busy["busy_frac"] = driver.stats.busy_time_s / (time.monotonic() - started)
        arrived(got[1])
    except BaseException as e:  # noqa: BLE001 - re-raised by the main loop
      errors.append(e)

  receiving = threading.Thread(target=receive_weights, daemon=True, name="weights-receiver")
  started = time.monotonic()
  driver.start()
  receiving.start()
  asked = False
  try:
    while not admission.poll_stopped():
      over = learner_host.run_over()
      if over is not None:
        if over["failure"]:  # the learner hosts stopped on a fault (another host died): say why, exit now
          raise SamplerHostStopped(over["failure"])
        break
      driver.check()
      rewards.check()
      if errors:
        raise errors[0]
      admission.heartbeat()
      if preemption.requested and not asked:
        ask_learners_to_stop()  # they save, end the run and tell every sampler host
        asked = True
      time.sleep(0.05)
    over = learner_host.run_over()
    if over is not None and over["failure"]:  # the learner hosts ended the run because a host failed
      raise SamplerHostStopped(over["failure"])
    receiving.join(timeout=cfg.mesh.host_timeout_s)
    if errors:
      raise errors[0]
  finally:
    outbox.stop_event.set()
    driver.stop(timeout_s=cfg.rl.wait_timeout_s)
    rewards.close()
    scorer.close()
  say(f"sampler host {me}: the learner hosts ended the run; {driver.stats.groups_emitted} groups sent, "
      f"{receiver.received} weight syncs received")
  return {"preempted": asked, **dataclasses.asdict(driver.stats), **busy}
