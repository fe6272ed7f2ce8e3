"""Hands step prefixes to a process reward model while the driver keeps decoding: a driver `Recorder`.

    RolloutDriver(engine, params, ..., recorders=[ProcessRewardRecorder(scorer, detokenize=tok.decode)])

After every sampled token it checks whether that token ends a step (`rewards.process.StepConfig`);
if so it submits the prefix to the `ProcessRewardScorer` (a queue put: the sampler thread never
waits for a PRM). When a completion ends, its last token closes the final step. Just before the
group leaves the driver, its calls are attached to it; the reward stage then `collect`s them
(waiting only for calls still running).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tunixlike.rewards.process import Prefix, ProcessRewardScorer
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler.driver import PromptRequest


class ProcessRewardRecorder:
  """Submits each finished step of every completion to `scorer`; see the module docstring."""

  def __init__(self, scorer: ProcessRewardScorer, detokenize: Callable[[Sequence[int]], str] | None = None):
    if scorer.steps.delimiter and detokenize is None:
      raise ValueError(f"algo.step_delimiter={scorer.steps.delimiter!r} needs a detokenize function")
    self.scorer, self._detokenize = scorer, detokenize
    self._calls: dict[tuple[int, int], list] = {}  # (group seq, sample index) -> [(step end, call)], until emitted

  def _submit(self, key, prompt_ids, tokens, request: PromptRequest) -> None:
    prefix = Prefix(prompt_token_ids=prompt_ids, token_ids=np.asarray(tokens, np.int32),
                    text=self._detokenize(tokens) if self._detokenize else None,
                    prompt_text=request.prompt_text, columns=request.columns)
    self._calls.setdefault(key, []).append((len(tokens) - 1, self.scorer.submit(prefix)))

  def token(self, key, prompt_ids, tokens, request) -> None:
    if self.scorer.steps.is_boundary(tokens, self._detokenize):
      self._submit(key, prompt_ids, tokens, request)

  def completion(self, key, prompt_ids, tokens, request) -> None:
    calls = self._calls.get(key, [])
    if tokens and (not calls or calls[-1][0] != len(tokens) - 1):
      self._submit(key, prompt_ids, tokens, request)  # the final step ends with the completion

  def group(self, seq: int, group: RolloutGroup) -> None:
    self.scorer.attach(group, [self._calls.pop((seq, i), []) for i in range(group.group_size)])
