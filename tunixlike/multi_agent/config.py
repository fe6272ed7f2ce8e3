"""The `multi_agent` section of the config: several policies taking turns in one episode.

    multi_agent.env = "self_play"        # or a MultiAgentEnv class 'package.module:MyEnv'; None: one policy
    multi_agent.policies = ({"name": "proposer", "group_size": 1},
                            {"name": "solver", "group_size": 4, "sampler": {"temperature": 1.0}})
    multi_agent.episodes_per_step = 8    # whole episodes per learner step
    multi_agent.eval_policy = "solver"   # whose held-out accuracy the evals measure

A leaf module (settings only), so the config imports it without the runtime that uses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tunixlike.settings import ConfigError, check_fields, keys, optional, positive_int, require, setting

BUILT_IN = {"self_play": "tunixlike.multi_agent.self_play:ProposeSolveEnv"}  # multi_agent.env names
POLICY_KEYS = ("name", "group_size", "turns", "sampler")  # a policy's dict; name and group_size required


def _env_name(v) -> str | None:
  ok = isinstance(v, str) and (v in BUILT_IN or ":" in v)
  return None if ok else "must be 'self_play' or an import path 'package.module:MyEnv' / 'file.py:MyEnv'"


def _int_at_least_1(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _policies(v) -> str | None:
  if not isinstance(v, (tuple, list)) or not v:
    return "must be one dict per policy: {name, group_size, turns (default 1), sampler (default {})}"
  names = []
  for i, p in enumerate(v):
    where = f"[{i}]"
    if not isinstance(p, dict) or "name" not in p or "group_size" not in p:
      return f"{where}={p!r}: must be a dict with at least 'name' and 'group_size'"
    unknown = set(p) - set(POLICY_KEYS)
    if unknown:
      return f"{where}: unknown keys {sorted(unknown)} (known: {list(POLICY_KEYS)})"
    if not isinstance(p["name"], str) or not p["name"] or "/" in p["name"]:
      return f"{where}.name={p['name']!r}: must be a non-empty name without '/' (it prefixes the policy's metrics)"
    for key in ("group_size", "turns"):
      if key in p and not _int_at_least_1(p[key]):
        return f"{where}.{key}={p[key]!r}: must be an int >= 1"
    if not isinstance(p.get("sampler", {}), dict):
      return f"{where}.sampler={p['sampler']!r}: must be a dict of sampler.* keys"
    names.append(p["name"])
  if len(set(names)) != len(names):
    return f"names {names}: each policy needs its own name"
  return None


@dataclasses.dataclass(frozen=True)
class MultiAgentSection:
  """Several policies in one run, each with its own weights, optimizer, sampler and version."""

  SECTION: ClassVar[str] = "multi_agent"

  env: str | None = setting(None, "episodes in which several policies take turns: 'self_play' (built in: a proposer "
                            "writes an addition problem of data.digits digits, a solver answers it) or a "
                            "MultiAgentEnv class 'package.module:MyEnv' / 'file.py:MyEnv'; None = one policy "
                            "(docs/multi_agent.md)", check=optional(_env_name))
  policies: tuple = setting(({"name": "proposer", "group_size": 1}, {"name": "solver", "group_size": 4}),
                            "one dict per policy: name, group_size (samples per turn: a GRPO group), turns (its "
                            "turns per episode, default 1: sizes its learner batch), sampler (its own sampler.* "
                            "values, e.g. {'temperature': 1.0}; its learner scores at that temperature too)",
                            check=_policies)
  episodes_per_step: int = setting(8, "whole episodes per learner step; each policy takes one optimizer step on its "
                                   "own turns in them (rl.max_staleness bounds every policy's staleness)",
                                   check=positive_int)
  eval_policy: str | None = setting(None, "the policy whose held-out accuracy on data.task the evals measure "
                                    "(eval.every_steps, at the start and the end); None = no held-out eval")

  def __post_init__(self):
    check_fields(self)
    require(self.eval_policy is None or self.eval_policy in self.names, "multi_agent.eval_policy", self.eval_policy,
            f"must name one of multi_agent.policies {list(self.names)}")

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(p["name"] for p in self.policies)

  def group_sizes(self) -> dict[str, int]:
    return {p["name"]: p["group_size"] for p in self.policies}

  def turns(self) -> dict[str, int]:
    return {p["name"]: p.get("turns", 1) for p in self.policies}

  def samplers(self) -> dict[str, dict[str, Any]]:
    return {p["name"]: dict(p.get("sampler", {})) for p in self.policies}

  def learner_rows(self, name: str) -> int:
    """Rows of policy `name`'s learner batch: a row per turn completion, in whole groups of at least 2."""
    g = self.group_sizes()[name]
    per_prompt = max(g, 2)
    return -(-self.episodes_per_step * self.turns()[name] * g // per_prompt) * per_prompt

  def check_with(self, cfg) -> None:
    """Checks across sections (`Config.__post_init__`): what a multi-agent run does not combine with,
    each policy's sampler values by the sampler's own rules, and its learner batch on the mesh."""
    if self.env is None:
      return
    refused = [("rl.env", cfg.rl.env is not None, "a single policy's episodes"),
               ("rl.agent", cfg.rl.agent is not None, "a single policy's agent loop"),
               ("rl.deterministic", cfg.rl.deterministic, "single-turn rounds"),
               ("lora.rank", cfg.lora.rank > 0, "each policy trains a full copy of the model"),
               ("algo.estimator", cfg.algo.estimator == "ppo", "PPO's critic"),
               ("model.teacher_path", cfg.model.teacher_path is not None, "on-policy distillation"),
               ("algo.process_reward", cfg.algo.process_reward is not None, "process rewards"),
               ("mesh.sampler_hosts", cfg.mesh.sampler_hosts > 0, "whole sampler hosts")]
    for key, bad, what in refused:
      section, name = key.split(".")
      require(not bad, key, getattr(getattr(cfg, section), name),
              f"is not supported with multi_agent.env={self.env!r} ({what})")
    if self.env == "self_play":
      require(set(self.names) == {"proposer", "solver"}, "multi_agent.policies", list(self.names),
              "multi_agent.env='self_play' takes the policies 'proposer' and 'solver'")
      require(self.group_sizes()["proposer"] == 1, "multi_agent.policies", self.group_sizes(),
              "the self-play proposer writes one problem per episode: its group_size must be 1")
    m = cfg.mesh
    fsdp = m.learner_size // m.learner_tensor
    row_devices = 1 if cfg.optim.context_parallel else fsdp
    sampler_keys = {k for k, _ in keys(type(cfg.sampler))}
    for i, name in enumerate(self.names):
      unknown = set(self.samplers()[name]) - sampler_keys
      require(not unknown, f"multi_agent.policies[{i}].sampler", self.samplers()[name],
              f"unknown sampler keys {sorted(unknown)}")
      try:  # the sampler's own checks, with this policy's values
        dataclasses.replace(cfg.sampler, group_size=self.group_sizes()[name], **self.samplers()[name])
      except ConfigError as e:
        raise ConfigError(f"multi_agent.policies[{i}].{e}") from None
      rows = self.learner_rows(name)
      require(rows % (cfg.optim.micro_batches * row_devices) == 0, "multi_agent.episodes_per_step",
              self.episodes_per_step, f"policy {name!r} trains {rows} rows a step (episodes x turns x group_size, in "
              f"groups of >= 2), which must be divisible by optim.micro_batches * learner fsdp devices = "
              f"{cfg.optim.micro_batches} * {row_devices}")
