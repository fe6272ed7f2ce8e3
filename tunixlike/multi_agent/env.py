"""The interface of a multi-agent episode: turns of several policies, each on its own context.

    env = make_env()                   # one per episode
    turn = env.reset(record)           # Turn(agent="proposer", prompt="...", samples=1)
    turn = env.step(texts)             # the last turn's samples, decoded -> the next Turn, or None: done
    rewards = env.rewards()            # at the end: one list per turn taken, a reward per sample

An agent sees only what the env shows it (`Turn.prompt` is its whole context), so every turn is a
prompt and `samples` completions of one policy: a GRPO group of that policy. Rewards come at the
end, because in self-play a turn's worth depends on later turns (a proposer is rewarded by how
often the solver then solves its problem). `reset`, `step` and `rewards` run on worker threads
with a timeout (`EnvRunner`), never on a decode loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

from tunixlike.multi_agent.config import BUILT_IN
from tunixlike.rewards.loader import LoadError, load


@dataclasses.dataclass(frozen=True)
class Turn:
  """One agent's turn: `samples` independent completions of `prompt` by policy `agent`."""

  agent: str
  prompt: str
  samples: int = 1
  max_new_tokens: int | None = None  # this turn's token limit, capped by the policy's sampler.max_new_tokens

  def __post_init__(self):
    if not isinstance(self.agent, str) or not self.agent:
      raise TypeError(f"Turn.agent={self.agent!r}: must be a policy name")
    if not isinstance(self.prompt, str):
      raise TypeError(f"Turn.prompt must be str, got {type(self.prompt).__name__}")
    if not isinstance(self.samples, int) or isinstance(self.samples, bool) or self.samples < 1:
      raise ValueError(f"Turn.samples={self.samples!r}: must be an int >= 1")
    if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
      raise ValueError(f"Turn.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1 or None")


class MultiAgentEnv:
  """Base class (subclass it, or duck-type the three methods). One instance serves one episode."""

  def reset(self, record: dict[str, Any]) -> Turn:
    raise NotImplementedError

  def step(self, texts: Sequence[str]) -> Turn | None:
    """The last turn's samples (decoded, in sample order); returns the next turn or None (done)."""
    raise NotImplementedError

  def rewards(self) -> list[list[float]]:
    """After the last step: for each turn taken, in order, one reward per sample."""
    raise NotImplementedError


def check_turn(turn: Any, agents: Sequence[str], samples: dict[str, int]) -> Turn:
  """`turn` as the env returned it, checked against the run's policies and their group sizes."""
  if not isinstance(turn, Turn):
    raise TypeError(f"the env returned {type(turn).__name__}, expected a multi_agent.Turn or None")
  if turn.agent not in agents:
    raise ValueError(f"the env asked for a turn of policy {turn.agent!r}, which this run does not have "
                     f"(multi_agent.policies={tuple(agents)})")
  if turn.samples != samples[turn.agent]:
    raise ValueError(f"the env asked for {turn.samples} samples of a {turn.agent!r} turn; that policy's "
                     f"sampler makes groups of {samples[turn.agent]} (multi_agent.group_sizes)")
  return turn


def check_rewards(rewards: Any, turns: Sequence[Turn]) -> list[list[float]]:
  """The env's rewards as floats: one list per turn taken with one finite number per sample. Lists
  beyond the turns taken (a turn the run refused: too long, or past max_turns) are left out."""
  if isinstance(rewards, (list, tuple)) and len(rewards) > len(turns):
    rewards = rewards[:len(turns)]
  if not isinstance(rewards, (list, tuple)) or len(rewards) != len(turns):
    raise ValueError(f"Env.rewards() gave {type(rewards).__name__} of length "
                     f"{len(rewards) if isinstance(rewards, (list, tuple)) else '?'}; expected one list per "
                     f"turn taken ({len(turns)})")
  out = []
  for i, (r, turn) in enumerate(zip(rewards, turns)):
    values = [float(x) for x in r] if isinstance(r, (list, tuple)) else None
    if values is None or len(values) != turn.samples or not all(math.isfinite(x) for x in values):
      raise ValueError(f"Env.rewards()[{i}]={r!r}: expected {turn.samples} finite numbers (turn of {turn.agent!r})")
    out.append(values)
  return out


def env_factory(cfg) -> Callable[[], MultiAgentEnv]:
  """What builds one episode's env for the run's `cfg`: the built-in self-play (data.digits, the solver's
  group size as its attempts) or the class multi_agent.env names, called with no arguments."""
  ma = cfg.multi_agent
  cls = load(BUILT_IN.get(ma.env, ma.env), key="multi_agent.env")
  if not callable(cls):
    raise LoadError(f"multi_agent.env={ma.env!r}: {cls!r} is not a MultiAgentEnv class")
  if ma.env == "self_play":
    return functools.partial(cls, digits=cfg.data.digits, attempts=ma.group_sizes()["solver"])
  return cls
