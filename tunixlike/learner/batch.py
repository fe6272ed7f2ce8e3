"""Batch assembly: a list of scored `RolloutGroup`s -> one padded, fixed-shape numpy batch.

Shapes come from a small set of buckets (rows fixed, sequence length rounded up to a bucket) so
the jitted train step compiles once per bucket and never again. Every per-token array is aligned
with `tokens` (index t describes token t); the train step shifts to next-token targets itself.

  tokens              int32   [B, T]  prompt + completion, right-padded with pad_id
  loss_mask           float32 [B, T]  1 on completion tokens the policy produced (the stop token
                                      included, Completion.loss_mask respected), else 0
  behaviour_logprobs  float32 [B, T]  sampler logprobs (processed distribution), 0 elsewhere
  versions            int32   [B, T]  policy version of each completion token, -1 elsewhere
  advantages          float32 [B]     per completion (`RolloutGroup.advantages`)
  rewards             float32 [B]     after shaping (`RolloutGroup.shaped_rewards`)
  group_ids           int32   [B]     index of the group in this batch, -1 for padding rows
  prompt_lengths, completion_lengths  int32 [B]
  sampling_mask       uint8   [B, T, W]  only with sampling_mask=True ("Keep Sampling Mask"): the
                                      sampler's packed kept-token set of each completion token
                                      (W = ceil(V/8)); all-zero rows (prompt, padding) keep every token
  routing             int32   [B, T, L, k]  only with routing=True ("Keep Routing", `routing.py`): the
                                      MoE experts the sampler used at each position; -1 = not recorded
Padding rows have an all-zero loss mask and so contribute nothing to the loss or the metrics.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from tunixlike.learner import group_advantages
from tunixlike.learner import routing as routing_lib
from tunixlike.learner import sampling_mask as sampling_mask_lib
from tunixlike.rollout import Completion, RolloutGroup


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket that holds `length` tokens."""
  i = bisect.bisect_left(list(buckets), length)
  if i == len(buckets):
    raise ValueError(f"a sequence of {length} tokens exceeds the largest seq_buckets entry {buckets[-1]}")
  return buckets[i]


def check_prompt(group: RolloutGroup) -> None:
  if len(group.prompt_token_ids) == 0:
    raise ValueError(f"RolloutGroup(prompt_id={group.prompt_id!r}).prompt_token_ids is empty: the first "
                     "completion token needs a prompt token to be predicted from")


def empty_rows(num_rows: int, t: int, pad_id: int) -> dict[str, np.ndarray]:
  """The columns every batch layout has (`prompt_rows` too), for `num_rows` rows of T tokens: all padding."""
  return {
      "tokens": np.full((num_rows, t), pad_id, np.int32),
      "loss_mask": np.zeros((num_rows, t), np.float32),
      "behaviour_logprobs": np.zeros((num_rows, t), np.float32),
      "versions": np.full((num_rows, t), -1, np.int32),
      "advantages": np.zeros((num_rows,), np.float32),
  }


def put_completion(batch: dict[str, np.ndarray], row: int, start: int, c: Completion) -> None:
  """Completion `c`'s tokens, loss mask, behaviour logprobs and versions at [start, start + n) of `row`."""
  end = start + c.num_tokens
  batch["tokens"][row, start:end] = c.token_ids
  batch["loss_mask"][row, start:end] = 1.0 if c.loss_mask is None else np.asarray(c.loss_mask, np.float32)
  batch["behaviour_logprobs"][row, start:end] = c.logprobs
  batch["versions"][row, start:end] = c.policy_versions


def assemble_batch(groups: Sequence[RolloutGroup], *, num_rows: int, seq_buckets: Sequence[int],
                   sampling_mask: bool, routing: bool, unscored: group_advantages.AdvantageConfig | None = None,
                   pad_id: int = 0) -> dict[str, np.ndarray]:
  """Pad `groups` into one batch of exactly `num_rows` rows and a bucketed length T.

  Each group's advantages come from the reward stage (`group_advantages.set_advantages`); a group
  without them gets them here from `unscored` (`AdvantageConfig.from_config(cfg)`: tests and
  benchmarks; a run's groups are scored by `rl/scoring.py` from its config), which it then needs.
  With sampling_mask=True (a run's algo.keep_sampling_mask) every completion must carry
  `Completion.sampling_mask` (the sampler's `record_sampling_mask`), and each token the policy produced
  must be in its own kept set. With routing=True (sampler.record_routing) every completion must carry
  `expert_routing` and `prompt_routing` (the sampler's `record_routing`).
  With per-token advantages (process rewards, distillation: `token_advantages.py`) the batch also holds
  `token_advantages` float32 [B, T] (0 off the completion), which the loss uses instead of `advantages`.
  """
  buckets = sorted(int(b) for b in seq_buckets)
  if not buckets or buckets[0] <= 0:
    raise ValueError(f"seq_buckets={tuple(seq_buckets)!r} must be non-empty positive lengths")
  if unscored is None and any(g.advantages is None for g in groups):
    raise ValueError("a group without advantages (not scored: group_advantages.set_advantages) needs "
                     "assemble_batch(..., unscored=AdvantageConfig.from_config(cfg))")
  n_rows = sum(g.group_size for g in groups)
  if n_rows > num_rows:
    raise ValueError(f"{len(groups)} groups hold {n_rows} completions, more than num_rows={num_rows}")
  lengths, scores = [], []
  for g in groups:  # an unscored group's advantages are computed here, not written back into it
    scores.append((g.shaped_rewards, g.advantages, g.token_advantages) if g.advantages is not None
                  else group_advantages.compute(g, unscored))
    check_prompt(g)
    lengths += [len(g.prompt_token_ids) + c.num_tokens for c in g.completions]
  t = pick_bucket(max(lengths, default=1), buckets)
  width = _check_sampling_masks(groups) if sampling_mask else 0
  layers_k = routing_lib.routing_shape(groups) if routing else None

  batch = {
      **empty_rows(num_rows, t, pad_id),
      "rewards": np.zeros((num_rows,), np.float32),
      "group_ids": np.full((num_rows,), -1, np.int32),
      "prompt_lengths": np.zeros((num_rows,), np.int32),
      "completion_lengths": np.zeros((num_rows,), np.int32),
  }
  if sampling_mask:  # [B, T, W] bytes: the largest array of the batch (V / 8 bytes per token)
    batch["sampling_mask"] = np.zeros((num_rows, t, width), np.uint8)
  if routing:
    batch["routing"] = np.full((num_rows, t) + tuple(layers_k), -1, np.int32)
  per_token = [tok_adv_g is not None for _, _, tok_adv_g in scores]
  if any(per_token) and not all(per_token):
    raise ValueError("some groups of the batch carry token_advantages and others do not")
  if any(per_token):
    batch["token_advantages"] = np.zeros((num_rows, t), np.float32)
  row = 0
  for gi, (g, (rewards_g, adv_g, tok_adv_g)) in enumerate(zip(groups, scores)):
    p = len(g.prompt_token_ids)
    for ci, c in enumerate(g.completions):
      n = c.num_tokens
      batch["tokens"][row, :p] = g.prompt_token_ids
      put_completion(batch, row, p, c)
      if sampling_mask:
        batch["sampling_mask"][row, p:p + n] = c.sampling_mask
      if routing:
        routing_lib.fill_row(batch["routing"][row], g, ci)
      batch["advantages"][row] = adv_g[ci]
      if tok_adv_g is not None:
        batch["token_advantages"][row, p:p + n] = tok_adv_g[ci]
      batch["rewards"][row] = rewards_g[ci]
      batch["group_ids"][row] = gi
      batch["prompt_lengths"][row] = p
      batch["completion_lengths"][row] = n
      row += 1
  return batch


def _check_sampling_masks(groups: Sequence[RolloutGroup]) -> int:
  """The packed width W shared by every completion's sampling mask; errors name the bad completion."""
  width = None
  for g in groups:
    for ci, c in enumerate(g.completions):
      where = f"RolloutGroup(prompt_id={g.prompt_id!r}).completions[{ci}].sampling_mask"
      m = c.sampling_mask
      if m is None:
        raise ValueError(f"{where} is None, but the batch asks for sampling masks (algo.keep_sampling_mask): "
                         "the sampler must record them (sampler.record_sampling_mask=True)")
      m = np.asarray(m)
      if m.dtype != np.uint8 or m.ndim != 2:
        raise ValueError(f"{where} has dtype {m.dtype} and shape {m.shape}, expected uint8 [T, ceil(V/8)]")
      width = m.shape[1] if width is None else width
      if m.shape[1] != width:
        raise ValueError(f"{where} has {m.shape[1]} bytes per token, other completions have {width}")
      if c.num_tokens and int(np.max(c.token_ids)) >= 8 * width:
        raise ValueError(f"{where} covers {8 * width} token ids, but the completion holds id {int(np.max(c.token_ids))}")
      produced = np.ones(c.num_tokens, bool) if c.loss_mask is None else np.asarray(c.loss_mask) > 0
      outside = produced & ~sampling_mask_lib.tokens_in_mask(m, c.token_ids)
      if outside.any():
        t = int(np.argmax(outside))
        raise ValueError(f"{where}: token {t} (id {int(c.token_ids[t])}) is not in its own kept set; the mask "
                         "does not belong to this completion")
  return width or 0
