"""The `rl` section of the config: the async loop, rewards, multi-turn episodes, stop conditions.

A leaf module (settings only), so the config imports it without the loop that uses it (rl/runtime.py).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tunixlike.settings import (DTYPES, check_fields, in_range, non_negative, one_of, optional, positive,
                                positive_int, run_value, setting)


BUILT_IN_ENVS = {"calculator": "tunixlike.rewards.envs:CalculatorEnv"}  # rl.env names -> the class's import path


def _env_name(v) -> str | None:
  ok = isinstance(v, str) and (v in BUILT_IN_ENVS or ":" in v)
  names = " or ".join(repr(n) for n in BUILT_IN_ENVS)
  return None if ok else f"must be {names} or an import path 'package.module:MyEnv' / 'file.py:MyEnv'"


def _import_path(v) -> str | None:
  return None if isinstance(v, str) and ":" in v else "must be an import path 'package.module:fn' or 'file.py:fn'"


def _host(v) -> str | None:
  return None if isinstance(v, str) and v else "must be an address to listen on, e.g. '127.0.0.1'"


AGENT_API_KEY_ENV = "TUNIXLIKE_AGENT_API_KEY"  # a key of your own for the agent server (else a random one)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
  """The `rl` section of the config: the async loop, rewards, multi-turn episodes, stop conditions."""

  SECTION: ClassVar[str] = "rl"

  num_steps: int = setting(60, "learner steps (= policy versions) of RL: 60 keeps a first run short; the configs "
                           "set their own (300 learns the built-in tasks); 0 = the supervised stage only",
                           check=non_negative, resumable=True)
  prompts_per_step: int = setting(32, "groups per learner step (the run splits them over the hosts)", check=positive)
  max_staleness: int = setting(1, "0 = synchronous (the baseline every comparison uses)", check=non_negative)
  deterministic: bool = setting(False, "a logical schedule instead of thread timing: the sampler works in rounds, one "
                                "per policy version (round v decodes batch v + max_staleness with version v's "
                                "weights), batches are taken by prompt order; the same seed and config give the "
                                "same run, and a resume ends where an uninterrupted run does (docs/runtime.md"
                                "#reproducibility)")
  sync_mode: str = setting("soft_pause", "soft_pause (swap weights between decode steps) | drain (finish in-flight "
                           "first)", check=one_of("soft_pause", "drain"))
  sync_dtype: str | None = setting(None, "e.g. 'bfloat16' for a bf16 sampler; None = the learner's dtype",
                                   check=optional(one_of(*DTYPES)))
  reward_workers: int = setting(4, "threads scoring groups, so slow verifiers never stall decoding", check=positive, resumable=True)
  reward_timeout_s: float = setting(10.0, "a reward call slower than this scores 0 and is counted", check=positive, resumable=True)
  max_nonfinite_steps: int = setting(3, "stop after this many non-finite losses in a row", check=positive, resumable=True)
  wait_timeout_s: float = setting(300.0, "no wait without a timeout", check=positive, resumable=True)
  stop_on_collapse: bool = setting(True, "stop at a collapsed step (the best checkpoint survives) rather than "
                                   "train on; else it is only logged", resumable=True)
  collapse_entropy_frac: float = setting(0.01, "collapsed: token entropy within this fraction of ln V (uniform "
                                         "policy)", check=in_range(0, 1, low_open=True, high_open=True), resumable=True)
  collapse_spike_factor: float = setting(1000.0, "also collapsed: grad norm this many times its recent median "
                                         "(0 = off)", check=non_negative, resumable=True)
  env: str | None = setting(None, "multi-turn episodes that interleave decoding with tool calls: "
                            + " | ".join(f"'{n}'" for n in BUILT_IN_ENVS) + " (built in), an Env class "
                            "'package.module:MyEnv' or 'file.py:MyEnv'; None = single-turn",
                            check=optional(_env_name))
  env_max_turns: int = setting(4, "policy turns per episode (rl.env steps, or rl.agent requests)", check=positive)
  env_step_timeout_s: float = setting(30.0, "a tool slower than this costs its episode, not the run", check=positive)
  agent: str | None = setting(None, "your own agent loop, any framework: a function 'package.module:run_episode' or "
                              "'file.py:run_episode' (base_url, api_key, episode_id, row) that talks to the policy "
                              "through the OpenAI-compatible server (docs/agents.md); None = no agent",
                              check=optional(_import_path))
  agent_workers: int = setting(64, "agent episodes running at once (one thread each)", check=positive)
  agent_port: int = setting(0, "port of the agent server (0 = any free port)", check=in_range(0, 65535))
  agent_host: str = setting("127.0.0.1", "address the agent server listens on; another one than loopback lets "
                            "other hosts reach it over plain HTTP (warned about; docs/agents.md)", check=_host)
  agent_max_body_bytes: int = setting(4 << 20, "a request body over this is refused (413) unread",
                                      check=positive)
  agent_max_connections: int = setting(256, "connections the agent server holds open at once; over it a new one "
                                       "closes the oldest that never sent the key, else the oldest idle one, else "
                                       "is refused. With the listen backlog it must fit in half the process's file "
                                       "descriptors (ulimit -n): the other half is kept for training",
                                       check=positive_int)
  agent_header_timeout_s: float = setting(10.0, "a connection that has not sent a request with the key this long "
                                          "after it opened is closed", check=positive)
  agent_idle_timeout_s: float = setting(5.0, "a kept-alive connection idle this long between requests is closed "
                                        "(uvicorn's timeout_keep_alive)", check=positive)
  episode_timeout_s: float = setting(300.0, "an agent episode longer than this is aborted (and counted)",
                                     check=positive)
  no_signal_warn_steps: int = setting(10, "the window of steps the no-signal warning looks at (groups whose rewards "
                                      "are all equal give no gradient); 0 = never warn", check=non_negative,
                                      resumable=True)
  no_signal_warn_share: float = setting(0.6, "warn when at least this share of the window's groups had no reward "
                                        "variance (the warning says whether they all failed, were all solved or "
                                        "scored alike)", check=in_range(0.0, 1.0), resumable=True)
  truncated_warn_share: float = setting(0.05, "warn once when more than this share of an evaluation's or a step's "
                                        "completions hit sampler.max_new_tokens; 0 = never", check=in_range(0.0, 1.0),
                                        resumable=True)
  dynamic_sampling: bool = run_value(False, "algo.dynamic_sampling: drop groups whose rewards have no variance, "
                                     "refill")

  def __post_init__(self):
    check_fields(self)
