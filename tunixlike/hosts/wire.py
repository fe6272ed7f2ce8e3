"""A scored `RolloutGroup` as bytes and back, for the key-value store between hosts.

The data contract does not change on the way: every array of the group and of its completions
(tokens, logprobs, per-token versions, loss and sampling masks, routing, step and teacher rewards,
rewards, advantages) crosses exactly, in an `.npz` read with allow_pickle=False, and the rest
(ids, dataset columns, finish reasons, texts, reward metrics) as JSON: nothing a peer sends can run
code on the learner.
"""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np

from tunixlike.rollout import Completion, RolloutGroup

_GROUP_ARRAYS = ("prompt_token_ids", "rewards", "shaped_rewards", "advantages")
_COMPLETION_ARRAYS = tuple(f.name for f in dataclasses.fields(Completion)
                           if f.name not in ("finish_reason", "text"))
_HEADER = "header"


def encode(group: RolloutGroup) -> bytes:
  arrays: dict[str, np.ndarray] = {}
  for name in _GROUP_ARRAYS:
    if getattr(group, name) is not None:
      arrays[name] = np.asarray(getattr(group, name))
  for name, value in (group.term_rewards or {}).items():
    arrays[f"term/{name}"] = np.asarray(value)
  for i, adv in enumerate(group.token_advantages or []):
    arrays[f"token_advantages/{i}"] = np.asarray(adv)
  for i, c in enumerate(group.completions):
    for name in _COMPLETION_ARRAYS:
      if getattr(c, name) is not None:
        arrays[f"c{i}/{name}"] = np.asarray(getattr(c, name))
  header = {"prompt_id": group.prompt_id, "columns": group.columns, "prompt_text": group.prompt_text,
            "reward_metrics": group.reward_metrics, "start_version": group.start_version,
            "term_rewards": list(group.term_rewards) if group.term_rewards is not None else None,
            "token_advantages": None if group.token_advantages is None else len(group.token_advantages),
            "completions": [{"finish_reason": c.finish_reason, "text": c.text} for c in group.completions]}
  arrays[_HEADER] = np.frombuffer(json.dumps(header, default=_plain).encode("utf-8"), np.uint8)
  out = io.BytesIO()
  np.savez(out, **arrays)
  return out.getvalue()


def _plain(value):
  """numpy scalars in the columns (a dataset's ints, the pipeline's `epoch`) as Python's own."""
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"a rollout column of type {type(value).__name__} cannot cross to another host: {value!r}")


def decode(data: bytes) -> RolloutGroup:
  with np.load(io.BytesIO(data), allow_pickle=False) as z:
    arrays = {k: z[k] for k in z.files}
  header = json.loads(bytes(arrays.pop(_HEADER)).decode("utf-8"))
  completions = []
  for i, meta in enumerate(header["completions"]):
    fields = {name: arrays.get(f"c{i}/{name}") for name in _COMPLETION_ARRAYS}
    completions.append(Completion(**fields, finish_reason=meta["finish_reason"], text=meta["text"]))
  terms = header["term_rewards"]
  n_adv = header["token_advantages"]
  return RolloutGroup(
      prompt_id=header["prompt_id"], prompt_token_ids=arrays["prompt_token_ids"], completions=completions,
      columns=header["columns"], prompt_text=header["prompt_text"],
      rewards=arrays.get("rewards"), shaped_rewards=arrays.get("shaped_rewards"), advantages=arrays.get("advantages"),
      term_rewards=None if terms is None else {t: arrays[f"term/{t}"] for t in terms},
      token_advantages=None if n_adv is None else [arrays[f"token_advantages/{i}"] for i in range(n_adv)],
      reward_metrics=header["reward_metrics"], start_version=header["start_version"])
