"""Rollouts kept across a checkpoint (checkpoint.keep_rollouts, rl/in_flight.py): the single-turn
groups a driver has in flight, as a checkpoint stores them (`snapshot`), and taken back by a resumed
driver (`take_back`), which prefills each unfinished sample's prompt and tokens so far and decodes on
with the same noise, as it resumes a sample a paged cache preempted."""

from __future__ import annotations

import numpy as np

from tunixlike.rollout import Completion
from tunixlike.sampler.driver_api import InFlightGroup
from tunixlike.sampler.samples import Group, Sample


def take_back(st, saved: InFlightGroup) -> None:
  """`st` (a `single_turn.SingleTurn`) takes a checkpoint's group back: finished samples as they
  are, the others queued to be prefilled with their tokens so far (as preempted sequences are)."""
  g = st.config.group_size
  group = Group(seq=saved.seq, request=saved.request, prompt_ids=np.asarray(saved.prompt_ids, np.int32),
                completions=[None] * g, started=g, keys=np.asarray(saved.keys, np.uint32), version=saved.version,
                resumed_at=st.driver.version)
  st.driver.admission.take_back(group)
  for i, sample in enumerate(saved.samples):
    if isinstance(sample, Completion):
      group.completions[i] = sample
      _retell(st, group, i, sample.token_ids, finished=True)
      continue
    info = Sample(group=group, index=i, max_new=st.limit(group), tokens=[int(t) for t in sample["tokens"]],
                  logprobs=[float(x) for x in sample["logprobs"]], versions=[int(v) for v in sample["versions"]],
                  masks=list(sample["masks"]) if sample.get("masks") is not None else [])
    info.kept = len(info.tokens)
    st.stats.tokens_kept += info.kept
    _retell(st, group, i, info.tokens, finished=False)
    st.preempted.append(info)
  if all(c is not None for c in group.completions):  # emitted now: no step of its own (a replay's record has none)
    st.emit(group)


def _retell(st, group: Group, index: int, tokens, finished: bool) -> None:
  """Recorders see a kept sample's tokens as they saw them before the checkpoint: one `token` call
  per token on one growing list (as decoding calls them), then `completion` if it had finished."""
  key = (group.seq, index)
  for r in st.recorders:
    so_far: list[int] = []
    for token in tokens:
      so_far.append(int(token))
      r.token(key, group.prompt_ids, so_far, group.request)
    if finished:
      r.completion(key, group.prompt_ids, so_far, group.request)


def snapshot(st) -> list[InFlightGroup]:
  """Every group admitted and not yet emitted, in start order (the driver holds its step lock)."""
  slots = {(s.group.seq, s.index): s for s in [*st.driver.slots, *st.preempted] if s is not None}
  out = []
  for group in st.driver.admission.groups():
    if group.keys is None:
      st._sample_keys_of(group, 0)  # makes them
    samples = []
    for i, done in enumerate(group.completions):
      info = slots.get((group.seq, i))
      if done is not None:
        samples.append(done)
      else:
        samples.append({"tokens": np.asarray(info.tokens if info else [], np.int32),
                        "logprobs": np.asarray(info.logprobs if info else [], np.float32),
                        "versions": np.asarray(info.versions if info else [], np.int32),
                        **({"masks": np.stack(info.masks)} if info is not None and info.masks else {})})
    out.append(InFlightGroup(seq=group.seq, request=group.request, prompt_ids=group.prompt_ids,
                             keys=group.keys.copy(), version=group.version, samples=samples))
  return out
