"""tunixlike: asynchronous RL post-training for LLMs in JAX (TPU / GPU; CPU for development).

    import tunixlike
    cfg = tunixlike.load_config("examples/countdown/config.py:size=tiny", {"rl.num_steps": 3})
    summary = tunixlike.train(cfg, "runs/countdown", dataset=rows, rewards=[my_reward])

`train` runs (or resumes) a run; `load_config` reads a config file with overrides; `Config` is the
typed config; `register_reward` names a reward function for configs; `Env` / `StepResult` are the
interface of multi-turn environments. The command line, `python -m tunixlike.train`, is a thin
layer over the same `train`.
"""

from __future__ import annotations

from typing import Any, Mapping

from tunixlike.config import Config, ConfigError, from_config_dict, load, replace
from tunixlike.rewards.envs.base import Env, StepResult
from tunixlike.rewards.registry import register as register_reward

__all__ = ["Config", "ConfigError", "Env", "StepResult", "load_config", "register_reward", "replace", "train"]


def load_config(spec: str | Mapping | Config, overrides: Mapping[str, Any] | None = None) -> Config:
  """A validated `Config` from a config file (`path.py` or `path.py:variant`), a ConfigDict or a
  Config, with `overrides` as {"section.key": value} (what `--config.section.key=value` does)."""
  if isinstance(spec, Config):
    raw = None
    cfg = spec
  else:
    raw = load(spec) if isinstance(spec, str) else spec
  if overrides:
    if raw is None:
      changes: dict[str, dict] = {}
      for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        if not section:
          cfg = replace(cfg, **{name: value})
        else:
          changes.setdefault(section, {})[name] = value
      return replace(cfg, **changes) if changes else cfg
    raw = raw.copy_and_resolve_references() if hasattr(raw, "copy_and_resolve_references") else dict(raw)
    for key, value in overrides.items():
      node = raw
      *path, name = key.split(".")
      for part in path:
        node = node[part]
      if name not in node:
        raise ConfigError(f"{key}: no such config key")
      node[name] = value
  return cfg if raw is None else from_config_dict(raw)


def train(config: str | Mapping | Config, workdir: str, *, dataset=None, eval_dataset=None, rewards=None,
          env=None, agent=None) -> dict[str, Any]:
  """Trains, or resumes the run in `workdir`; returns the summary (eval accuracy before and after,
  counters, where the outputs are).

  `config`: what `load_config` takes. In-memory objects replace the config's keys:
    dataset, eval_dataset   data.train / data.eval: a list of dicts, a grain MapDataset or a path;
    rewards                 `rewards`: callables, or {fn, weight, kwargs} with fn a callable or a name;
                            the first is the evals' 0/1 verifier;
    env                     rl.env: an `Env` class (or factory) for multi-turn episodes.
    agent                   rl.agent: your agent loop, run_episode(base_url, episode_id, row), talking
                            to the policy through the OpenAI-compatible server (docs/agents.md).
  Resume a run given in-memory objects by passing the same objects again. With `rl.num_steps: 0` the
  run is the supervised stage alone (warm_start.*, data.answer_field / data.messages_field); a later
  call with rl.num_steps > 0 and the same workdir goes on with RL.
  """
  from tunixlike.rl import trainer  # JAX starts here: set XLA_FLAGS before calling

  cfg = load_config(config)
  return trainer.run(cfg, workdir, dataset=dataset, eval_dataset=eval_dataset, rewards=rewards, env=env,
                     agent=agent)
