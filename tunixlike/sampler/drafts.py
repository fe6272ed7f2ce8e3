"""Drafts for speculative decoding from text the sampler already holds (`sampler.speculative`).

A sequence's draft is what followed the latest earlier occurrence of its last n tokens (n =
`sampler.draft_ngram` down to 2; prompt lookup decoding, Saxena 2023) in, all at once:
  * the other samples of its GRPO group, live or finished (prompt + their tokens so far): the G
    samples of one prompt share long stretches of text, more so as the policy sharpens, and the
    last, long samples of a batch find theirs finished;
  * its prompt's earlier completions (`sampler.draft_history` per prompt, kept on the host: a
    prompt seen again, e.g. in the next epoch);
  * its own prompt and completion (repetition).
The longest continuation found wins (ties: in that order). Any draft is safe: verification keeps
exactly the tokens plain decoding samples (`speculative`); a draft only decides how many come per
forward.

Adaptive: a sequence whose drafts were accepted less than `sampler.draft_min_acceptance` over its
last `WINDOW` tries stops drafting for `FIRST_PAUSE` tokens, twice as long after each further
failure (up to `MAX_PAUSE`), so text that does not repeat costs a few verify forwards per sequence,
not one per step. Lookups use an n-gram index per text, extended as the text grows (O(1) per token).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from tunixlike.sampler.speculative import NO_DRAFT

WINDOW = 4  # tries a sequence's acceptance is judged over
FIRST_PAUSE = 16  # tokens a sequence decodes without drafting after its drafts failed
MAX_PAUSE = 1024
MIN_NGRAM = 2  # a one-token match proposes mostly noise
HISTORY_TOKENS = 1 << 22  # tokens of earlier completions kept over all prompts (16 MiB as int32)


class NgramIndex:
  """A growing text and, per n-gram (n in [MIN_NGRAM, ngram]) followed by at least one token, where it
  last started."""

  def __init__(self, ngram: int, tokens: Iterable[int] = ()):
    self.ngram = ngram
    self.tokens: list[int] = []
    self._last: dict[tuple[int, ...], int] = {}
    self.extend(tokens)

  def extend(self, tokens: Iterable[int]) -> None:
    for token in tokens:
      i = len(self.tokens)
      for n in range(MIN_NGRAM, self.ngram + 1):
        if i >= n:  # tokens[i - n:i] is now followed by `token`
          self._last[tuple(self.tokens[i - n:i])] = i - n
      self.tokens.append(int(token))

  def follow(self, pattern: tuple[int, ...], length: int) -> list[int]:
    """Up to `length` tokens after the latest occurrence of `pattern` ([] if none)."""
    start = self._last.get(pattern)
    if start is None:
      return []
    start += len(pattern)
    return self.tokens[start:start + length]


class History:
  """Each prompt's latest `per_prompt` completions (prompt + completion, int32), `HISTORY_TOKENS` in
  all, the least recently used prompt dropped first."""

  def __init__(self, per_prompt: int, max_tokens: int = HISTORY_TOKENS):
    self.per_prompt, self.max_tokens = per_prompt, max_tokens
    self._texts: collections.OrderedDict[bytes, collections.deque] = collections.OrderedDict()
    self._tokens = 0

  @staticmethod
  def key(prompt_ids) -> bytes:
    return np.asarray(prompt_ids, np.int32).tobytes()

  def add(self, prompt_ids, completion) -> None:
    if self.per_prompt == 0:
      return
    text = np.concatenate([np.asarray(prompt_ids, np.int32), np.asarray(completion, np.int32)])
    texts = self._texts.setdefault(self.key(prompt_ids), collections.deque())
    self._texts.move_to_end(self.key(prompt_ids))
    texts.append(text)
    self._tokens += len(text)
    if len(texts) > self.per_prompt:
      self._tokens -= len(texts.popleft())
    while self._tokens > self.max_tokens and self._texts:
      self._tokens -= sum(len(t) for t in self._texts.popitem(last=False)[1])

  def texts(self, prompt_ids) -> list[np.ndarray]:
    return list(self._texts.get(self.key(prompt_ids), ()))


@dataclasses.dataclass
class _Control:
  """One sequence's adaptive switch: its last tries and until when it does not draft."""

  tries: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WINDOW))
  paused_until: int = 0  # completion length from which it drafts again
  pause: int = FIRST_PAUSE


@dataclasses.dataclass
class _Group:
  """The texts of one group's samples (prompt + tokens) and of its prompt's earlier completions."""

  samples: dict[int, NgramIndex]
  history: list[NgramIndex]


class Live(NamedTuple):
  """A live sequence the driver asks a draft for."""

  slot: int
  group: int  # the group's start order
  index: int  # sample index in the group
  prompt_ids: np.ndarray
  tokens: Sequence[int]  # its completion so far (read only)
  budget: int  # most draft tokens it can use (its remaining limit - 1)


class Drafter:
  """Drafts per decode call and the adaptive switch (see the module docstring). Host-side, on the
  sampler thread. The driver calls `drafts` before a call, `observe` after a verify call, and, as a
  `driver.Recorder`, `completion` and `group` as sequences and groups end."""

  def __init__(self, draft_tokens: int, ngram: int, min_acceptance: float, history: int):
    self.draft_tokens, self.ngram, self.min_acceptance = draft_tokens, ngram, min_acceptance
    self.history = History(history)
    self._groups: dict[int, _Group] = {}
    self._control: dict[tuple[int, int], _Control] = {}

  @classmethod
  def from_config(cls, config) -> Drafter:
    """From a `SamplerConfig`."""
    return cls(config.draft_tokens, config.draft_ngram, config.draft_min_acceptance, config.draft_history)

  def drafts(self, sequences: Iterable[Live], num_slots: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(drafts int32 [num_slots, draft_tokens] with NO_DRAFT padding, lengths [num_slots]), or None
    when no sequence has one (the plain decode program runs)."""
    out, lengths = None, np.zeros((num_slots,), np.int32)
    sequences = list(sequences)
    own = [self._text(seq) for seq in sequences]  # every live text up to date first: each is the others' source
    for seq, text in zip(sequences, own):
      draft = self._draft(seq, text)
      if draft:
        if out is None:
          out = np.full((num_slots, self.draft_tokens), NO_DRAFT, np.int32)
        out[seq.slot, :len(draft)] = draft
        lengths[seq.slot] = len(draft)
    return None if out is None else (out, lengths)

  def _text(self, seq: Live) -> NgramIndex:
    """The sequence's indexed text (prompt + tokens), brought up to date."""
    group = self._group(seq)
    own = group.samples.get(seq.index)
    if own is None:
      own = group.samples[seq.index] = NgramIndex(self.ngram, seq.prompt_ids)
    own.extend(seq.tokens[len(own.tokens) - len(seq.prompt_ids):])
    return own

  def _draft(self, seq: Live, own: NgramIndex) -> list[int]:
    length = min(self.draft_tokens, seq.budget)
    control = self._control.get((seq.group, seq.index))
    if length <= 0 or (control is not None and len(seq.tokens) < control.paused_until):
      return []
    group = self._groups[seq.group]
    sources = [t for i, t in group.samples.items() if i != seq.index] + group.history + [own]
    for n in range(min(self.ngram, len(own.tokens)), MIN_NGRAM - 1, -1):
      pattern = tuple(own.tokens[-n:])
      best = max((s.follow(pattern, length) for s in sources), key=len)  # max keeps the first of equals
      if best:
        return best
    return []

  def _group(self, seq: Live) -> _Group:
    group = self._groups.get(seq.group)
    if group is None:
      history = [NgramIndex(self.ngram, t) for t in self.history.texts(seq.prompt_ids)]
      group = self._groups[seq.group] = _Group(samples={}, history=history)
    return group

  def observe(self, group: int, index: int, drafted: int, accepted: int, length: int) -> None:
    """A verify call's outcome for one sequence: `accepted` of its `drafted` tokens, its completion
    now `length` tokens long."""
    control = self._control.setdefault((group, index), _Control())
    control.tries.append((drafted, accepted))
    if len(control.tries) == WINDOW:
      rate = sum(a for _, a in control.tries) / sum(d for d, _ in control.tries)
      if rate < self.min_acceptance:
        control.paused_until = length + control.pause
        control.pause = min(2 * control.pause, MAX_PAUSE)
        control.tries.clear()

  # ------------------------------------------------------------------ driver.Recorder

  def token(self, key, prompt_ids, tokens, request) -> None:
    pass

  def completion(self, key: tuple[int, int], prompt_ids, tokens, request) -> None:
    """A sample ended: its text stays a draft source for its group and joins its prompt's history."""
    group = self._groups.get(key[0])
    if group is not None:
      index = group.samples.setdefault(key[1], NgramIndex(self.ngram, prompt_ids))
      index.extend(tokens[len(index.tokens) - len(prompt_ids):])
    else:  # ended before it ever asked for a draft: its siblings still may
      self._groups[key[0]] = _Group(samples={key[1]: NgramIndex(self.ngram, [*prompt_ids, *tokens])},
                                    history=[NgramIndex(self.ngram, t) for t in self.history.texts(prompt_ids)])
    self.history.add(prompt_ids, tokens)
    self._control.pop(key, None)

  def group(self, seq: int, group) -> None:
    """The group left the driver: its texts are no longer needed."""
    self._groups.pop(seq, None)
