"""Built-in reward functions (registered by name; batch interface, see registry.py)."""

from __future__ import annotations

from typing import Sequence

from tunixlike.rewards import math_answer
from tunixlike.rewards.registry import register


def _check_lengths(name: str, completions: Sequence, **columns: Sequence) -> None:
  for key, values in columns.items():
    if len(values) != len(completions):
      raise ValueError(f"{name}: column {key!r} has {len(values)} values for {len(completions)} completions")


@register("exact_match")
def exact_match(prompts, completions, *, answer, **_) -> list[float]:
  """1 if the completion, stripped of surrounding whitespace, equals the answer (synthetic tasks)."""
  _check_lengths("exact_match", completions, answer=answer)
  return [float(isinstance(c, str) and c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


@register("gsm8k_accuracy")
def gsm8k_accuracy(prompts, completions, *, answer, **_) -> list[float]:
  """1 if the final number of the completion equals the gold answer (see math_answer)."""
  _check_lengths("gsm8k_accuracy", completions, answer=answer)
  return [float(math_answer.is_correct(c, a)) for c, a in zip(completions, answer)]


@register("answer_format")
def answer_format(prompts, completions, **_) -> list[float]:
  """1 if the completion states a final answer explicitly (####, \\boxed{}, "the answer is", "A:")."""
  return [float(math_answer.has_answer_marker(c)) for c in completions]


@register("length_penalty")
def length_penalty(prompts, completions, *, completion_lengths, max_length: int, buffer: int | None = None,
                   **_) -> list[float]:
  """Soft overlong punishment (DAPO, arXiv 2503.14476, eq. 13), counted in tokens.

      r(L) = 0                          if L <= max_length - buffer
             (max_length - buffer - L) / buffer   if max_length - buffer < L <= max_length
             -1                         if L > max_length

  `buffer=None` means buffer = max_length: a linear penalty -L / max_length.
  """
  buffer = max_length if buffer is None else buffer
  if not 0 < buffer <= max_length:
    raise ValueError(f"length_penalty needs 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}")
  _check_lengths("length_penalty", completions, completion_lengths=completion_lengths)
  free = max_length - buffer
  scores = []
  for n in completion_lengths:
    n = int(n)
    scores.append(0.0 if n <= free else -1.0 if n > max_length else (free - n) / buffer)
  return scores


@register("stopped")
def stopped(prompts, completions, *, finish_reasons, **_) -> list[float]:
  """1 if the completion ended with a stop token rather than hitting the length limit."""
  _check_lengths("stopped", completions, finish_reasons=finish_reasons)
  return [float(r in ("eos", "stop")) for r in finish_reasons]
