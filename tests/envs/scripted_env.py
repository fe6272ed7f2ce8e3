"""A scripted environment with real latency (a module with a unique name: `conftest` is ambiguous across
test folders)."""

import time

from tunixlike.rewards.envs import Env, StepResult


class ScriptedEnv(Env):
  """A scripted tool: each step sleeps `latency_s` (record column), then answers `obs<n>.` until
  `turns` policy turns are done. Step rewards are 0.25 per answered turn and 1.0 at the end.

  `probe()` (e.g. the driver's generate-call count) is read before and after the sleep, so a test
  can see what the decode loop did while this tool was busy. `fail` = "raise" / "garbage" makes
  step misbehave like a buggy environment.
  """

  def __init__(self, probe=lambda: 0):
    self.probe, self.n, self.log = probe, 0, []

  def reset(self, record):
    self.record = record
    return record.get("intro", "")

  def step(self, action):
    self.n += 1
    before = self.probe()
    time.sleep(self.record.get("latency_s", 0.0))
    during = self.probe() - before
    self.log.append(dict(action=action, during=during))
    fail = self.record.get("fail")
    if fail == "raise":
      raise RuntimeError("scripted tool crashed")
    if fail == "garbage":
      return {"observation": "not a StepResult"}
    if self.n >= self.record["turns"]:
      return StepResult(None, 1.0, True, {"calls_during_step": during})
    return StepResult(f" obs{self.n}.", 0.25, False, {"calls_during_step": during})
