"""What the model says: sampled completions as JSON rows, for WORKDIR/completions.jsonl.

One row per completion: its prompt, the text, the total reward and each reward term's own score,
the advantage, its length, how it ended and the policy versions that produced it. Multi-turn and
agent episodes (whose tokens mix the policy's turns with inserted environment / history tokens) also
keep the chain as recorded: `segments`, the text split where the loss mask changes, each marked
`trained` (the loss covers it) or not, and `loss_mask_spans`, the trained token ranges [start, end).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from tunixlike.rollout import Completion, RolloutGroup


def _number(x) -> float | None:
  x = float(x)
  return None if math.isnan(x) else x


def mask_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
  """[start, end) token ranges where `loss_mask` is 1."""
  m = np.concatenate([[0], np.asarray(loss_mask, np.int32) != 0, [0]]).astype(np.int8)
  edges = np.flatnonzero(np.diff(m))
  return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _segments(c: Completion, tokenizer) -> list[dict[str, Any]]:
  mask = np.asarray(c.loss_mask) != 0
  cuts = [0, *np.flatnonzero(np.diff(mask.astype(np.int8))) + 1, len(mask)]
  return [{"trained": bool(mask[a]), "text": tokenizer.decode(c.token_ids[a:b], skip_special_tokens=False)}
          for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def completion_rows(groups: Sequence[RolloutGroup], tokenizer, *, step: int) -> list[dict[str, Any]]:
  """The rows of every completion of `groups` (scored), trained at learner step `step`."""
  rows = []
  for g in groups:
    for i, c in enumerate(g.completions):
      versions = np.asarray(c.policy_versions)
      row = {"step": step, "prompt_id": str(g.prompt_id), "prompt": g.prompt_text,
             "completion": c.text if c.text is not None else tokenizer.decode(c.token_ids),
             "reward": _number(g.rewards[i]) if g.rewards is not None else None,
             "rewards": {name: _number(s[i]) for name, s in (g.term_rewards or {}).items()},
             "advantage": _number(g.advantages[i]) if g.advantages is not None else None,
             "num_tokens": c.num_tokens, "finish_reason": c.finish_reason,
             "versions": [int(versions.min()), int(versions.max())] if len(versions) else []}
      if c.loss_mask is not None and not np.all(np.asarray(c.loss_mask) != 0):  # a chain with inserted tokens
        row["segments"] = _segments(c, tokenizer)
        row["loss_mask_spans"] = mask_spans(c.loss_mask)
      rows.append(row)
  return rows


def markdown(rows: Sequence[dict[str, Any]], max_chars: int = 300) -> str:
  """The rows as a Markdown table (TensorBoard's text tab renders it)."""
  cut = lambda s: (s or "").replace("|", "\\|").replace("\n", "\\n")[:max_chars]
  lines = ["| prompt | completion | reward | rewards | tokens | finish | versions |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    terms = ", ".join(f"{k}={v:.3g}" if v is not None else f"{k}=-" for k, v in r["rewards"].items())
    lines.append(f"| {cut(r['prompt'])} | {cut(r['completion'])} | {r['reward']} | {terms} | {r['num_tokens']} | "
                 f"{r['finish_reason']} | {r['versions']} |")
  return "\n".join(lines)
