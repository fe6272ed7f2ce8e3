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

from typing import TYPE_CHECKING, Any, Mapping

from tunixlike.lazy_exports import lazy_exports

if TYPE_CHECKING:
  from tunixlike.config import Config

# Imported on first use, so `import tunixlike.settings` (or any leaf module) imports no JAX.
__getattr__, __dir__, _lazy = lazy_exports(__name__, {
    "config": ("Config", "ConfigError", "replace"),
    "rewards.envs.base": ("Env", "StepResult"),
})
__all__ = sorted(_lazy + ["load_config", "register_reward", "train"])


def register_reward(name: str):
  """Decorator: `@tunixlike.register_reward("my_reward")` makes a reward function usable by name in configs."""
  from tunixlike.rewards.registry import register

  return register(name)


def load_config(spec: str | Mapping | Config, overrides: Mapping[str, Any] | None = None) -> Config:
  """A validated `Config` from a config file (`path.py` or `path.py:variant`), a ConfigDict or a
  Config, with `overrides` as {"section.key": value} (what `--config.section.key=value` does)."""
  from tunixlike.config import Config, ConfigError, from_config_dict, load, replace

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
          env=None, agent=None, hooks=None) -> dict[str, Any]:
  """Trains, or resumes the run in `workdir`; returns the summary (eval accuracy before and after,
  counters, where the outputs are).

  `config`: what `load_config` takes. In-memory objects replace the config's keys:
    dataset, eval_dataset   data.train / data.eval: a list of dicts, a grain MapDataset or a path;
    rewards                 `rewards`: callables, or {fn, weight, kwargs} with fn a callable or a name;
                            the first is the evals' 0/1 verifier;
    env                     rl.env: an `Env` class (or factory) for multi-turn episodes.
    agent                   rl.agent: your agent loop, run_episode(base_url, api_key, episode_id, row), talking
                            to the policy through the OpenAI-compatible server (docs/agents.md).
  Resume a run given in-memory objects by passing the same objects again. With `rl.num_steps: 0` the
  run is the supervised stage alone (warm_start.*, data.answer_field / data.messages_field); a later
  call with rl.num_steps > 0 and the same workdir goes on with RL.
  `hooks`: functions of each RL step's `StepInfo` (step, version, metrics, trained and dropped
  groups), or {"fn": function, "every": N} to run one when the new version is a multiple of N. A hook
  may add to `info.metrics` (logged with the step) or call `info.stop()` to end the run after this
  step (the final eval and checkpoint follow). docs/runtime.md#hooks has an example.
  """
  from tunixlike.rl import hooks as hooks_lib

  cfg = load_config(config)
  hooks_lib.user_hooks(hooks)  # bad hooks are refused here, before JAX starts
  from tunixlike import layouts  # JAX starts here: set XLA_FLAGS before calling
  from tunixlike.multi_agent import trainer as multi_agent_trainer

  run = layouts.run if cfg.multi_agent.env is None else multi_agent_trainer.run  # several policies: their own stages
  return run(cfg, workdir, dataset=dataset, eval_dataset=eval_dataset, rewards=rewards, env=env, agent=agent,
             hooks=hooks)
