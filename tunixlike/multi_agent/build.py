"""The pieces of a multi-agent run from a built `Setup`: one policy per agent, their coordinator, the runtime."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Mapping

import jax
from flax import nnx

from tunixlike.multi_agent.coordinator import EpisodeCoordinator
from tunixlike.multi_agent.runtime import MultiAgentRuntime
from tunixlike.rl import build as build_lib, scoring
from tunixlike.rl.policy import Policy
from tunixlike.sampler import RolloutDriver, make_engine
from tunixlike.sampler.engine import Engine


def build_policies(setup: build_lib.Setup, group_sizes: Mapping[str, int], batch_episodes: int,
                   turns_per_episode: Mapping[str, int] | None = None,
                   sampler: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[dict[str, Policy], dict[str, Engine]]:
  """(a policy per agent, its sampler engine): each with its own copy of `setup.model` (as
  warm-started), learner state and version counter, and an engine whose groups are that agent's
  `group_sizes[name]` samples.
  A learner batch holds `batch_episodes x turns_per_episode[name] (default 1) x group size` rows, a
  row per turn completion (`optim.share_prompts` does not apply: a batch's turns have many prompts).
  `sampler[name]`: SamplerConfig fields of that policy's engine (e.g. its stop strings)."""
  policies, engines = {}, {}
  for name, g in group_sizes.items():
    rows = batch_episodes * (turns_per_episode or {}).get(name, 1) * g
    per_prompt = max(g, 2)  # rows in whole groups of at least 2, as a run's batch of algo.group_size >= 2
    model = nnx.clone(setup.model)
    s_cfg = dataclasses.replace(build_lib.sampler_config(setup.cfg, setup.tok, setup.transport.decoders),
                                group_size=g, **(sampler or {}).get(name, {}))
    # The policy's own sampler values: its learner scores at its temperature, its rows fit its lengths.
    cfg = dataclasses.replace(setup.cfg, sampler=s_cfg)
    learner = build_lib.build_learner(cfg, model, setup.meshes.learner)
    engines[name] = engine = make_engine(model, s_cfg, mesh=setup.meshes.sampler)
    policies[name] = build_lib.build_policy(cfg, learner, engine, setup.tok.pad_id, tracer=setup.tracer,
                                            rows=-(-rows // per_prompt) * per_prompt // jax.process_count(),
                                            share_prompts=False)
  return policies, engines


def build_runtime(setup: build_lib.Setup, policies: dict[str, Policy], engines: dict[str, Engine],
                  make_env: Callable[[], Any], *,
                  batch_episodes: int, max_staleness: int, max_turns: int, max_episodes_in_flight: int | None = None,
                  records=None, counts: dict[str, int] | None = None, **coordinator) -> MultiAgentRuntime:
  """The run's episodes over `policies` (their current weights and versions), sampled on `engines`; `records` feed
  `env.reset` (default: {"index": i} forever); `counts`: the buffer's counters of a resumed run
  (`EpisodeQueue.counts()`); `coordinator`: more EpisodeCoordinator options."""
  cfg, tok = setup.cfg, setup.tok

  def make_driver(policy: Policy, engine, source, sink) -> RolloutDriver:
    synced = policy.sync_weights()
    return RolloutDriver(engine, synced.params, source=source, sink=sink, version=synced.version,
                         detokenize=tok.decode, tracer=setup.tracer)

  def make_coordinator(sink, may_start_episode):
    drivers = {name: functools.partial(make_driver, policy, engines[name]) for name, policy in policies.items()}
    return EpisodeCoordinator(drivers, make_env=make_env,
                              records=records if records is not None else ({"index": i} for i in itertools.count()),
                              encode=tok.encode, detokenize=tok.decode, sink=sink, may_start_episode=may_start_episode,
                              max_turns=max_turns, max_episodes_in_flight=max_episodes_in_flight or 2 * batch_episodes,
                              step_timeout_s=cfg.rl.env_step_timeout_s, wait_timeout_s=cfg.rl.wait_timeout_s,
                              **coordinator)

  return MultiAgentRuntime(policies, make_coordinator, batch_episodes=batch_episodes, max_staleness=max_staleness,
                           advantages=scoring.advantage_config(cfg), wait_timeout_s=cfg.rl.wait_timeout_s,
                           counts=counts)
