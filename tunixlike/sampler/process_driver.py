"""A rollout driver that hands step prefixes to a process reward model while it keeps decoding.

`ProcessRewardDriver` is a `RolloutDriver` whose `_record` hook checks, after every sampled token,
whether that token ends a step (`rewards.process.StepConfig`); if so it submits the prefix to the
`ProcessRewardScorer` (a queue put: the sampler thread never waits for a PRM). When a completion
ends, its last token closes the final step. Just before the group leaves the driver, its calls are
attached to it; the reward stage then `collect`s them (waiting only for calls still running).
"""

from __future__ import annotations

import numpy as np

from tunixlike.rewards.process import Prefix, ProcessRewardScorer
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler.driver import RolloutDriver, _Slot


class ProcessRewardDriver(RolloutDriver):
  """`RolloutDriver(engine, params, ...)` plus `scorer`: the process reward model's scorer."""

  def __init__(self, engine, params, *, scorer: ProcessRewardScorer, **kwargs):
    super().__init__(engine, params, **kwargs)
    if scorer.steps.delimiter and self._detokenize is None:
      raise ValueError(f"algo.step_delimiter={scorer.steps.delimiter!r} needs a detokenize function")
    self.scorer = scorer
    self._calls: dict[int, list] = {}  # id(_Slot) -> [(step end, call)] while the slot decodes
    self._done: dict[tuple[int, int], list] = {}  # (group seq, sample index) -> calls, until emitted
    self._finishing = None  # the _Group whose completion `_finish` is ending (read by `_emit`)

  def _submit(self, info: _Slot) -> None:
    req = info.group.request
    prefix = Prefix(prompt_token_ids=info.group.prompt_ids, token_ids=np.asarray(info.tokens, np.int32),
                    text=self._detokenize(info.tokens) if self._detokenize else None,
                    prompt_text=req.prompt_text, columns=req.columns)
    self._calls.setdefault(id(info), []).append((len(info.tokens) - 1, self.scorer.submit(prefix)))

  def _record(self, info: _Slot, token: int, logprob: float, version: int, mask) -> None:
    super()._record(info, token, logprob, version, mask)
    if self.scorer.steps.is_boundary(info.tokens, self._detokenize):
      self._submit(info)

  def _finish(self, slot: int, info: _Slot, reason: str) -> None:
    calls = self._calls.get(id(info), [])
    if info.tokens and (not calls or calls[-1][0] != len(info.tokens) - 1):
      self._submit(info)  # the final step ends with the completion
    self._done[(info.group.seq, info.index)] = self._calls.pop(id(info), [])
    self._finishing = info.group
    try:
      super()._finish(slot, info, reason)
    finally:
      self._finishing = None

  def _emit(self, group: RolloutGroup) -> None:
    g = self._finishing
    if g is None:
      raise RuntimeError("ProcessRewardDriver._emit outside _finish: cannot tell which calls belong to the group")
    self.scorer.attach(group, [self._done.pop((g.seq, i)) for i in range(group.group_size)])
    super()._emit(group)
