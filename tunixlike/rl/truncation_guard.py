"""A warning when completions are cut at `sampler.max_new_tokens` before they end.

A cut completion (finish reason "length") cannot be a whole answer: a verifier scores it 0 and the
policy learns that long answers fail. Counted in every step's metrics (`completions/truncated`) and
every evaluation's (`eval/truncated`, `warm_start/truncated`); past `rl.truncated_warn_share` the run
warns once, from the RL stage's first evaluation on (the supervised stage's result; its earlier
evaluations see a model that has not learned to stop yet), with the limit that would fit the data's
answers when the data has an answer column, or saying that they fit and the completions do not stop.
"""

from __future__ import annotations

from typing import Callable, Iterable

from tunixlike.rl.hooks import StepInfo


def fitting_limit(answer_lengths: Iterable[int]) -> int | None:
  """A `sampler.max_new_tokens` for answers of these token lengths (their end-of-sequence token
  included): the longest plus a quarter (at least 2 tokens) of room for an answer written differently."""
  longest = max(answer_lengths, default=0)
  return longest + max(2, longest // 4) if longest else None


class TruncationGuard:
  """Warns once when more than `share` of some completions hit `max_new_tokens`; a hook for the RL
  steps (`completions/truncated`), and `check` for the evaluations."""

  def __init__(self, max_new_tokens: int, share: float, say: Callable[[str], None], *,
               longest_answer: int | None = None):
    """`longest_answer`: the token length (with its end-of-sequence token) of the data's longest answer."""
    self.max_new_tokens, self.share, self.say, self.longest_answer = max_new_tokens, share, say, longest_answer
    self.warned = False

  def check(self, truncated: float, what: str) -> None:
    if self.warned or not self.share or truncated <= self.share:
      return
    self.warned = True
    if self.longest_answer is not None and self.longest_answer > self.max_new_tokens:
      fix = (f"the data's longest answer is {self.longest_answer} tokens with its end: set "
             f"sampler.max_new_tokens={fitting_limit([self.longest_answer])}")
    elif self.longest_answer is not None:
      fix = (f"the data's longest answer ({self.longest_answer} tokens with its end) fits, so these completions "
             "run on past an answer: a supervised warm start on the answers (warm_start.max_steps) teaches the end "
             "token; if right answers can be longer than the data's, raise sampler.max_new_tokens")
    else:
      fix = f"raise sampler.max_new_tokens (e.g. to {2 * self.max_new_tokens})"
    self.say(f"warning: {truncated:.0%} of {what} hit sampler.max_new_tokens={self.max_new_tokens} (finish reason "
             f"'length'): they were cut before they ended and score as wrong; {fix} "
             "(rl.truncated_warn_share=0 silences this)")

  def __call__(self, info: StepInfo) -> None:
    self.check(info.metrics.get("completions/truncated", 0.0), f"the completions of RL step {info.step}")
