"""A scripted two-policy env for the multi-agent tests."""

import time

from tunixlike.multi_agent import MultiAgentEnv, Turn


class Relay(MultiAgentEnv):
  """a writes, b answers twice (its group of 2), a writes again; rewards: text lengths.
  `hold` (an Event) blocks the first step until set, `fail_at` raises at that step."""

  def __init__(self, order=("a", "b", "a"), hold=None, fail_at=None, prompt_len=3, samples=None, log=None):
    self.order, self.hold, self.fail_at, self.prompt_len = order, hold, fail_at, prompt_len
    self.samples = samples or {"a": 1, "b": 2}
    self.texts = []
    self.log = log  # a list: (time, turn index) appended at each step

  def _turn(self):
    agent = self.order[len(self.texts)]
    last = self.texts[-1][0] if self.texts else ""
    return Turn(agent, ("q" * self.prompt_len + last)[-40:], samples=self.samples.get(agent, 1))

  def reset(self, record):
    return self._turn()

  def step(self, texts):
    if self.log is not None:
      self.log.append((time.monotonic(), len(self.texts)))
    if self.hold is not None and not self.texts:
      assert self.hold.wait(30)
    if self.fail_at == len(self.texts):
      raise RuntimeError("the env broke")
    self.texts.append(list(texts))
    return self._turn() if len(self.texts) < len(self.order) else None

  def rewards(self):
    return [[float(len(t)) for t in texts] for texts in self.texts]
