"""Shared-prompt rows (`optim.share_prompts`): one row per group, its prompt once, then its answers.

The G samples of a GRPO group share their prompt, so the padded layout (`batch.py`, one row per
completion) runs the prompt's tokens through the learner G times, and pads every row to the
longest. Here a group is one row:

  tokens     [prompt | answer 1 | answer 2 | ... | answer G | pad]
  segments   [0 ...0 | 1 ...   1| 2 ...   2| ... | G ...  G | -1 ]
  positions  [0..P-1 | P..P+n1-1| P..P+n2-1| ... |          | 0  ]
  predictor  index of the position whose hidden state predicts the token: P - 1 for each answer's
             first token, the previous index within its answer otherwise (t - 1 in the prompt)

  prefix     the segment each token sees besides its own: its group's prompt (-1 on padding)

Packed rows (`optim.pack_tokens`, `pack`): several whole groups in a row, up to a token budget, each
[prompt | answers] with its own segments (the next group's prompt is the segment after the last
answer of the one before) and positions from 0; `prefix` points each at its own prompt.

Attention lets a token see its own segment and its prefix (`Attention`, `segments_bt`, `prefix_bt`),
so every answer sees exactly what it saw in its own row, at the same positions: the loss and its gradient
equal the padded layout's (tested), with per-token advantages (`token_advantages`) and the
aggregation's sequences counted per segment (`losses`). The main job's 256 rows of 16 tokens
become 32 rows of about 40 (docs/learner.md#shared-prompt-rows).

Keys as in `batch.assemble_batch` (tokens, loss_mask, behaviour_logprobs, versions, advantages,
token_advantages) plus positions, segments and predictor, each [B, T] aligned with `tokens`;
`advantages` [B] holds each row's mean |advantage| over its answers (a metric only: the loss
reads `token_advantages`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tunixlike.learner import batch as batch_lib
from tunixlike.rollout import RolloutGroup

LAYOUT_KEYS = ("positions", "segments", "prefix", "predictor")


def row_buckets(longest: int) -> tuple[int, ...]:
  """Row lengths (multiples of 8 up to 64, then of 16 up to 256, then powers of two) up to and
  including `longest`: a row holds a prompt and G answers, so its length varies more finely than a
  sequence's and a power-of-two bucket would pad it by up to half."""
  sizes = list(range(8, 65, 8)) + list(range(80, 257, 16))
  b = 512
  while b < longest:
    sizes.append(b)
    b *= 2
  return tuple(sorted({min(s, longest) for s in sizes} | {longest}))


def row_length(group: RolloutGroup) -> int:
  return len(group.prompt_token_ids) + sum(c.num_tokens for c in group.completions)


def pack(groups: Sequence[RolloutGroup], row_tokens: int) -> list[list[int]]:
  """Group indices per row: whole groups, at most `row_tokens` tokens a row (first fit, longest
  group first: within 11/9 of the fewest rows)."""
  rows, room = [], []
  for i in sorted(range(len(groups)), key=lambda i: -row_length(groups[i])):
    n = row_length(groups[i])
    if n > row_tokens:
      raise ValueError(f"RolloutGroup(prompt_id={groups[i].prompt_id!r}) holds {n} tokens, more than "
                       f"optim.pack_tokens={row_tokens}")
    fit = next((r for r, left in enumerate(room) if left >= n), None)
    if fit is None:
      rows.append([])
      room.append(row_tokens)
      fit = len(rows) - 1
    rows[fit].append(i)
    room[fit] -= n
  return rows


def assemble(groups: Sequence[RolloutGroup], *, num_rows: int, seq_buckets: Sequence[int],
             pad_id: int = 0, rows: Sequence[Sequence[int]] | None = None) -> dict[str, np.ndarray]:
  """`num_rows` rows of a bucketed length T of scored groups (`group.advantages` set): one group per
  row, or the groups of each entry of `rows` (indices into `groups`, from `pack`) in one row."""
  rows = [[i] for i in range(len(groups))] if rows is None else [list(r) for r in rows]
  if len(rows) > num_rows:
    raise ValueError(f"{len(rows)} rows of groups for num_rows={num_rows}")
  for g in groups:
    if g.advantages is None:
      raise ValueError(f"RolloutGroup(prompt_id={g.prompt_id!r}) has no advantages: score it first (rl/scoring.py)")
    batch_lib.check_prompt(g)
  longest = max((sum(row_length(groups[i]) for i in r) for r in rows), default=1)
  t = batch_lib.pick_bucket(longest, sorted(int(b) for b in seq_buckets))
  batch = {
      **batch_lib.empty_rows(num_rows, t, pad_id),
      "token_advantages": np.zeros((num_rows, t), np.float32),
      "positions": np.zeros((num_rows, t), np.int32),
      "segments": np.full((num_rows, t), -1, np.int32),
      "prefix": np.full((num_rows, t), -1, np.int32),
      "predictor": np.maximum(np.arange(t, dtype=np.int32) - 1, 0)[None].repeat(num_rows, axis=0),
  }
  for row, members in enumerate(rows):
    start, segment = 0, 0
    for gi in members:
      start, segment = _put_group(batch, row, start, segment, groups[gi])
    # float64: the mean of float32 advantages near float32's limits must not overflow
    batch["advantages"][row] = np.mean(np.concatenate([np.abs(groups[gi].advantages) for gi in members]),
                                       dtype=np.float64)
  return batch


def _put_group(batch, row: int, start: int, segment: int, g: RolloutGroup) -> tuple[int, int]:
  """Group g at [start, ...) of `row`, its prompt as `segment`, its answers the next G segments;
  returns (the next free index, the next free segment)."""
  p, first = len(g.prompt_token_ids), start
  end = start + p
  batch["tokens"][row, start:end] = g.prompt_token_ids
  batch["positions"][row, start:end] = np.arange(p)
  batch["segments"][row, start:end] = segment
  batch["prefix"][row, start:end] = segment
  batch["predictor"][row, start:end] = np.maximum(np.arange(start - 1, end - 1), first)
  start = end
  for ci, c in enumerate(g.completions):
    n, end = c.num_tokens, start + c.num_tokens
    batch_lib.put_completion(batch, row, start, c)
    batch["token_advantages"][row, start:end] = (g.advantages[ci] if g.token_advantages is None
                                                 else g.token_advantages[ci])
    batch["positions"][row, start:end] = p + np.arange(n)
    batch["segments"][row, start:end] = segment + ci + 1
    batch["prefix"][row, start:end] = segment
    batch["predictor"][row, start:end] = np.arange(start - 1, end - 1)
    if n:
      batch["predictor"][row, start] = first + p - 1
    start = end
  return start, segment + len(g.completions) + 1
