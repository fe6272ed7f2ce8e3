"""Score RolloutGroups: build the batch columns from the groups and fill `rewards` in place."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tunixlike.rollout import RolloutGroup
from tunixlike.rewards.combine import CombinedReward


def score_groups(reward: CombinedReward, groups: Sequence[RolloutGroup], tokenizer=None) -> dict[str, float]:
  """Scores every completion of `groups` in one batch; sets each group's `rewards` and `reward_metrics`.

  Columns passed to the reward functions (one value per completion): every key of `group.columns`
  (e.g. `answer`), `completion_lengths` (tokens), `finish_reasons` and `prompt_ids`. Completion
  text is `Completion.text`, or the token ids decoded by `tokenizer` (special tokens skipped).
  Returns the metrics over the whole batch.
  """
  prompts, completions, lengths, finish, prompt_ids = [], [], [], [], []
  keys = sorted({k for g in groups for k in g.columns})
  columns: dict[str, list] = {k: [] for k in keys}
  for g in groups:
    for c in g.completions:
      if c.text is None and tokenizer is None:
        raise ValueError(f"group {g.prompt_id!r}: a completion has no text and no tokenizer was given")
      completions.append(c.text if c.text is not None else tokenizer.decode(c.token_ids))
      prompts.append(g.prompt_text or "")
      lengths.append(c.num_tokens)
      finish.append(c.finish_reason)
      prompt_ids.append(g.prompt_id)
      for k in keys:
        if k not in g.columns:
          raise ValueError(f"group {g.prompt_id!r} lacks column {k!r} that other groups in the batch have")
        columns[k].append(g.columns[k])
  rewards_n, terms, metrics = reward.score(prompts, completions, **columns, completion_lengths=lengths,
                                           finish_reasons=finish, prompt_ids=prompt_ids)
  start = 0
  for g in groups:
    g.rewards = np.asarray(rewards_n[start : start + g.group_size], np.float32)
    g.term_rewards = {name: scores[start : start + g.group_size] for name, scores in terms.items()}
    g.reward_metrics = dict(metrics)
    start += g.group_size
  return metrics
