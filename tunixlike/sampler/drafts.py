"""Drafts for speculative decoding from text the sampler already holds (`sampler.speculative`).

A sequence's draft is what followed its last n tokens (n = `sampler.draft_ngram` down to 2; prompt
lookup decoding, Saxena 2023) in
  * the other samples of its GRPO group, live or finished (prompt + their tokens so far), at the
    occurrence nearest its own position: the G samples of one prompt share long stretches of text,
    more so as the policy sharpens, and the last, long samples of a batch find theirs finished;
  * its prompt's earlier completions (`sampler.draft_history` per prompt, kept on the host: a
    prompt seen again, e.g. in the next epoch);
the longest continuation found (ties: in that order), or, if none is a full draft long, the
sequence's own repetition (`NgramIndex.repeat`) if that is longer. Any draft is safe: verification
keeps exactly the tokens plain decoding samples (`speculative`); a draft only decides how many come
per forward.

Adaptive, twice: a sequence whose drafts were accepted less than `sampler.draft_min_acceptance`
over its last `WINDOW` tries stops drafting for `FIRST_PAUSE` tokens, twice as long after each
further failure (up to `MAX_PAUSE`), so text that does not repeat costs a few verify calls per
sequence, not one per step (a lookup that finds no draft worth a token pauses its lookups for
`steps_per_call` tokens, twice as long after the next: a few lookups per sequence); and a decode
call verifies drafts only when the tokens they are expected to add beyond what the plain call gives
pay for the verify call's cost, measured against a plain call's at the same decode width
(`Drafter._pays`), and add at least `MIN_GAIN` of the plain call's tokens. A draft counts only the tokens it adds past the
plain call's `steps_per_call` and up to where the sequence ends anyway (its limit, or the draft's
EOS), times its sequence's recent acceptance (or all drafts' for a sequence without tries) (`extra`).
A sequence that ends within the call (a short answer, its limit near) saves no call, so it adds nothing,
and once a draft of it ended at EOS within reach it is not looked up again; a draft without EOS is
weighted by how often recent completions went on past a call at its length (`Drafter._survives`).
Neither changes a token: only how many come per call. A draft covers a whole verify call
(`speculative.draft_length`: its steps verify `draft_tokens` each from the sequence's place in it).
Lookups use an n-gram index per text, built at its first lookup and extended at later ones (O(1)
per token); a sibling no further on than the asking sequence is not a source.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import time
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from tunixlike.sampler.speculative import NO_DRAFT, draft_length, verify_steps

WINDOW = 4  # tries a sequence's acceptance is judged over
FIRST_PAUSE = 16  # tokens a sequence decodes without drafting after its drafts failed
MAX_PAUSE = 1024
MIN_NGRAM = 2  # a one-token match proposes mostly noise
HISTORY_TOKENS = 1 << 22  # tokens of earlier completions kept over all prompts (16 MiB as int32)
PRIOR_ACCEPTANCE = 0.5  # the expected acceptance of a draft before any was verified
RECENT_SMOOTHING = 0.05  # weight of one try in the recent acceptance of all drafts (a new sequence's estimate)
TIME_SMOOTHING = 0.3  # weight of the latest call in the smoothed seconds per call
RETRY_EVERY = 32  # refused verify calls (of drafts worth a token) at a width before one measures again
ENDINGS = 1024  # recent completions whose lengths tell how likely a sequence ends at EOS within a call
MIN_ENDINGS = 32  # completions alive at a length before they say anything about it
RETRY_SLOWER = 2  # only drafts that would pay were the verify call this many times faster than measured
MIN_GAIN = 0.02  # drafts expected to add less than this share of a plain call's tokens never pay


def step_rows(rows: int, steps_per_call: int, draft_tokens: int) -> list[slice]:
  """The result rows of each model forward of a decode call with `rows` rows: a verify call's first
  v steps verify (draft_tokens + 1 rows each), the others, and a plain call's, decode (a row each)."""
  t, v = draft_tokens + 1, (rows - steps_per_call) // draft_tokens
  return [slice(i * t, (i + 1) * t) for i in range(v)] + [slice(v * t + j, v * t + j + 1)
                                                            for j in range(steps_per_call - v)]


def verified(tokens_k, valid_k, draft, draft_tokens: int, verify_steps: int) -> tuple[int, int]:
  """(draft tokens verified, accepted) of one slot in a verify call: its rows tokens_k / valid_k [K]
  start with the call's `verify_steps` x (draft_tokens + 1) positions, in order (`PagedEngine.verify`);
  each step verifies the draft from the slot's position in it (the tokens emitted so far)."""
  t, drafted, accepted, at = draft_tokens + 1, 0, 0, 0
  for row in range(0, verify_steps * t, t):
    got = np.asarray(tokens_k[row:row + t])[np.asarray(valid_k[row:row + t], bool)]
    if not len(got):  # the slot stopped
      break
    want = np.asarray(draft[at:at + draft_tokens])
    want = want[want != NO_DRAFT]
    n = min(len(got), len(want))
    drafted += len(want)
    accepted += int(np.cumprod(got[:n] == want[:n]).sum())
    at += len(got)
  return drafted, accepted


class NgramIndex:
  """A growing text and, per n-gram (n in [MIN_NGRAM, ngram]) followed by at least one token, where
  it started (ascending). Indexed at lookups, up to the text's end: a text nobody looks up (most
  samples' where answers are short) costs nothing but its reference."""

  def __init__(self, ngram: int, tokens: Sequence[int] = (), *, growing: Sequence[int] | None = None):
    """`tokens`, then `growing` (a list another part appends to, read up to its end at each lookup)."""
    self.ngram = ngram
    self.tokens: list[int] = []
    self._starts: dict[tuple[int, ...], list[int]] = {}
    self._head, self._offset, self._growing = tokens, len(tokens), growing

  def __len__(self) -> int:
    """The text's length now (indexed or not)."""
    if self._growing is not None:
      return self._offset + len(self._growing)
    return len(self.tokens) if self._head is None else len(self._head)

  def sync(self) -> None:
    """Indexes what the text gained since the last lookup."""
    if self._head is not None:
      self._extend(np.asarray(self._head, np.int64).tolist())
      self._head = None
    if self._growing is not None:
      self._extend(self._growing[len(self.tokens) - self._offset:])

  def _extend(self, tokens: Iterable[int]) -> None:
    for token in tokens:
      i = len(self.tokens)
      for n in range(MIN_NGRAM, self.ngram + 1):
        if i >= n:  # tokens[i - n:i] is now followed by `token`
          self._starts.setdefault(tuple(self.tokens[i - n:i]), []).append(i - n)
      self.tokens.append(int(token))

  def freeze(self) -> None:
    """Keeps the growing list's text as it is now (it is complete) and lets go of the list."""
    if self._growing is not None:
      self._growing = list(self._growing)

  def follow(self, pattern: tuple[int, ...], length: int, near: int) -> list[int]:
    """Up to `length` tokens after the occurrence of `pattern` that starts nearest to position `near`
    ([] if none). Texts of one prompt share its tokens' positions, so a sibling's text at the asking
    sequence's own position is what that sample wrote at this point."""
    self.sync()
    starts = self._starts.get(pattern)
    if not starts:
      return []
    i = bisect.bisect_left(starts, near)
    start = min(starts[max(i - 1, 0):i + 1], key=lambda s: abs(s - near)) + len(pattern)
    return self.tokens[start:start + length]

  def repeat(self, length: int) -> list[int]:
    """The text's own continuation if it repeats its last stretch: what followed the latest earlier
    occurrence of its suffix, continued with the period that occurrence implies (a text that has
    repeated one stretch so far goes on repeating it), for the longest suffix that has occurred."""
    self.sync()
    end = len(self.tokens)
    for n in range(min(self.ngram, end - 1), MIN_NGRAM - 1, -1):
      starts = self._starts.get(tuple(self.tokens[end - n:]))
      if starts:
        period = end - n - starts[-1]
        return [self.tokens[end - period + k % period] for k in range(length)]
    return []


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
    key = self.key(prompt_ids)
    texts = self._texts.get(key)
    if texts is None:
      texts = self._texts[key] = collections.deque()
    else:
      self._texts.move_to_end(key)
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
  pause: int = FIRST_PAUSE  # the next pause after its drafts failed
  unfound: int = 0  # the last pause after lookups found no draft worth a token (0: the last one found one)

  def rate(self) -> float:
    """Its drafts' acceptance over its last tries (some tries needed)."""
    return sum(a for _, a in self.tries) / sum(d for d, _ in self.tries)

  def back_off(self, length: int) -> None:
    """Its drafts failed: no drafting until the completion is `pause` tokens longer than `length`
    (twice as long the next time)."""
    self.paused_until = length + self.pause
    self.pause = min(2 * self.pause, MAX_PAUSE)

  def found(self, length: int, worth: bool, steps_per_call: int) -> None:
    """A lookup found a draft worth a token or not: if not, no lookup until the completion is longer
    by steps_per_call tokens, twice that after the next such lookup, and so on."""
    self.unfound = 0 if worth else min(max(steps_per_call, 2 * self.unfound), MAX_PAUSE)
    self.paused_until = max(self.paused_until, length + self.unfound)


@dataclasses.dataclass
class _Group:
  """The texts of one group's samples (prompt + tokens) and of its prompt's earlier completions."""

  samples: dict[int, NgramIndex]
  history: list[NgramIndex]
  ends: dict[int, int] = dataclasses.field(default_factory=dict)  # sample -> completion length its last draft's EOS gives


def extra(steps_per_call: int, length: int, acceptance: float, cap: int) -> float:
  """Tokens a verify call is expected to add to one sequence beyond a plain call's, for a draft of
  `length` tokens accepted at `acceptance`: the plain call gives min(steps_per_call, cap), a fully
  accepted draft min(steps_per_call + length, cap) (`cap`: the tokens the sequence has left, to its
  limit or its draft's EOS). Expected: `acceptance` times the difference, the lower bound of a gain
  that is concave in the tokens accepted (a draft is mostly taken whole or not at all), so a
  sequence that ends within the plain call, or soon after it, adds nothing or little."""
  return acceptance * max(0, min(steps_per_call + length, cap) - min(steps_per_call, cap))


class Live(NamedTuple):
  """A live sequence the driver asks a draft for."""

  slot: int
  group: int  # the group's start order
  index: int  # sample index in the group
  prompt_ids: np.ndarray
  tokens: Sequence[int]  # its completion so far (read only)
  budget: int  # most draft tokens it can use (its remaining limit - 1)


def _host_work(method):
  """Counts the method's time in `Drafter.host_s`."""
  @functools.wraps(method)
  def counted(self, *args, **kwargs):
    t0 = time.perf_counter()
    try:
      return method(self, *args, **kwargs)
    finally:
      self.host_s += time.perf_counter() - t0
  return counted


class Drafter:
  """Drafts per decode call and the adaptive switch (see the module docstring). Host-side, on the
  sampler thread. The driver calls `drafts` before a call, `observe` after a verify call, and, as a
  `driver.Recorder`, `completion` and `group` as sequences and groups end."""

  def __init__(self, draft_tokens: int, ngram: int, min_acceptance: float, history: int, steps_per_call: int,
               call_seconds: dict[tuple[int, int], float | None] | None = None, eos_ids: Sequence[int] = ()):
    """`eos_ids`: the tokens that end a completion (a draft is worth nothing past one).
    `call_seconds`: (verify steps (0: a plain call), decode width) -> seconds per call (None: its
    first call was seen, not timed), as another drafter measured them (taken as measured; updated in
    place). `recent_acceptance` (an attribute) may be set too."""
    self.draft_tokens, self.ngram, self.min_acceptance = draft_tokens, ngram, min_acceptance
    self.steps_per_call, self.eos_ids = steps_per_call, frozenset(int(t) for t in eos_ids)
    self.length = draft_length(steps_per_call, draft_tokens)  # a verify call's draft per sequence
    self.history = History(history)
    self._groups: dict[int, _Group] = {}
    self._control: dict[tuple[int, int], _Control] = {}
    self.call_seconds = {} if call_seconds is None else call_seconds  # (steps, width) -> seconds (smoothed) | None
    self.recent_acceptance = PRIOR_ACCEPTANCE  # acceptance of the latest tries of every sequence (EMA)
    self._refused: dict[int, int] = {}  # decode width -> verify calls refused since the last one there
    self.last_steps = steps_per_call  # verify steps of the call the drafts last returned are for
    self._endings: collections.deque = collections.deque(maxlen=ENDINGS)  # (length, ended at EOS)
    self._ending_counts = ([0], [0])  # (all, at EOS) of _endings by completion length
    self._survival: np.ndarray | None = None  # by completion length, from the counts (None: recompute)
    self.host_s = 0.0  # seconds in the methods the driver calls: what drafting costs the sampler thread

  @classmethod
  def from_config(cls, config, call_seconds: dict[tuple[int, int], float | None] | None = None) -> Drafter:
    """From a `SamplerConfig`."""
    return cls(config.draft_tokens, config.draft_ngram, config.draft_min_acceptance, config.draft_history,
               config.steps_per_call, call_seconds, config.eos_ids)

  @_host_work
  def drafts(self, sequences: Iterable[Live], num_slots: int,
             width: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(drafts int32 [num_slots, `length`] with NO_DRAFT padding, lengths [num_slots]), or None
    when no sequence has one, or (given the call's decode `width`) when the tokens the drafts are
    expected to add do not pay for a verify call (`_pays`): the plain decode program runs."""
    sequences, k = list(sequences), self.steps_per_call
    asking, bound, plain = [], 0.0, 0  # sequences that may gain by drafting now, the most they add, a plain call's tokens
    for seq in sequences:  # (cheap: most calls end after this loop)
      control = self._control.get((seq.group, seq.index))
      done = len(seq.tokens)
      cap = seq.budget + 1  # tokens it has left; fewer where its last draft's EOS lies within them
      group = self._groups.get(seq.group)
      end = group.ends.get(seq.index) if group is not None else None
      cap = min(cap, end - done) if end is not None and end > done else cap
      plain += min(k, cap)
      length = min(self.length, seq.budget)
      if cap > k and length > 0 and (control is None or done >= control.paused_until):
        acceptance = self._acceptance(control) * self._survives(done)
        most = extra(k, length, acceptance, cap)
        if most > 0:  # else it ends within the call anyway: no lookup
          asking.append((seq, length, acceptance))
          bound += most
    if not asking or (width is not None and not self._pays(bound, plain, width, 1, stage="bound")):
      return None  # (no lookups: most steps of text that does not repeat end here)
    groups = {seq.group for seq, _, _ in asking}
    for seq in sequences:  # the texts of the asking groups' live samples, indexed as they grow at lookups
      if seq.group in groups:
        samples = self._group(seq.group, seq.prompt_ids).samples
        if seq.index not in samples:
          samples[seq.index] = NgramIndex(self.ngram, seq.prompt_ids, growing=seq.tokens)
    out = np.full((num_slots, self.length), NO_DRAFT, np.int32)
    lengths, gain = np.zeros((num_slots,), np.int32), 0.0
    for seq, length, acceptance in asking:
      draft = self._draft(seq, length)
      out[seq.slot, :len(draft)] = draft
      lengths[seq.slot] = len(draft)
      cap = seq.budget + 1
      stop = next((i + 1 for i, t in enumerate(draft) if t in self.eos_ids), None)
      if stop is not None:  # the draft ends the sequence: worth nothing past its EOS
        self._groups[seq.group].ends[seq.index] = len(seq.tokens) + stop
        cap = min(cap, stop)
      worth, key = extra(k, len(draft), acceptance, cap), (seq.group, seq.index)
      if worth < 1 or key in self._control:  # text that does not repeat is looked up less and less often
        self._control.setdefault(key, _Control()).found(len(seq.tokens), worth >= 1, k)
      gain += worth
    steps = verify_steps(int(lengths.max()), self.steps_per_call, self.draft_tokens)
    if not lengths.any() or (width is not None and not self._pays(gain, plain, width, steps)):
      return None
    self.last_steps = steps
    return out, lengths

  @_host_work
  def may_pay(self, live: int, width: int) -> bool:
    """Whether drafts for `live` sequences could pay for a verify call at this width, judged by the
    recent acceptance of all drafts: when not, the driver skips the lookups (and builds no requests),
    so a workload where speculation does not pay costs a dict lookup per call."""
    return self._pays(live * self.length * self.recent_acceptance, live * self.steps_per_call, width, 1, stage="look")

  def _acceptance(self, control: _Control | None) -> float:
    """A sequence's acceptance over its last tries; before any, the recent acceptance of all drafts."""
    return control.rate() if control is not None and control.tries else self.recent_acceptance

  def _survives(self, done: int) -> float:
    """How likely a sequence `done` tokens long goes on past a plain call without sampling EOS, from
    the recent completions alive at that length (1 before MIN_ENDINGS of them): where answers are short
    (the main job's 4 tokens) a sequence's draft without EOS, e.g. its own repetition, would still end
    within the call, and saves nothing. Limits are not EOS: a completion they ended counts as going on."""
    if not self.eos_ids or len(self._endings) < MIN_ENDINGS:
      return 1.0
    if self._survival is None:
      alive = len(self._endings) - np.cumsum(self._ending_counts[0])  # [n]: completions longer than n tokens
      ended = np.cumsum(self._ending_counts[1])  # [n]: EOS-ended completions of at most n tokens
      n = np.arange(len(alive))
      stopped = ended[np.minimum(n + self.steps_per_call, len(ended) - 1)] - ended  # EOS within the call
      self._survival = np.where(alive >= MIN_ENDINGS, 1 - stopped / np.maximum(alive, 1), 1.0)
    return float(self._survival[done]) if done < len(self._survival) else 1.0

  def _pays(self, gain: float, tokens: int, width: int, steps: int, *, stage: str = "final") -> bool:
    """Whether a verify call of `steps` verify steps is expected to give more tokens per second than a
    plain one: the plain call's `tokens` (steps_per_call per live sequence, fewer for one that ends
    sooner) plus the drafts' expected `gain` beyond them (`extra`), over
    the measured seconds of each kind of call at this decode width (a verify forward costs more where
    compute, not memory, bounds a step: several times a decode step's on CPU, about one on an
    accelerator at small widths). Each kind is run once at a width before the measurements decide.
    Before the lookups (`stage` "look": `may_pay`, once per call; "bound": the drafts' most) it asks
    of the cheapest verify call (1 step)."""
    # Not a token's worth, or a share of the call too small to pay for a verify call on any hardware
    # (its forwards compute draft_tokens + 1 positions per slot): not worth measuring one either.
    if gain < max(1.0, MIN_GAIN * tokens):
      return False
    plain, verify = self.call_seconds.get((0, width)), self.call_seconds.get((steps, width))
    if plain is None or verify is None:
      return plain is not None  # measure a plain call first, then a verify call
    if (tokens + gain) / verify > tokens / plain:
      return True
    # A measurement can be an unlucky one (a shared machine): after RETRY_EVERY decode calls at a width
    # whose drafts would have paid were the verify call RETRY_SLOWER times faster than measured, one
    # verify call measures again. Drafts that would not pay even then (text that does not repeat) never
    # cause one. (Counted once per call, by `may_pay`: until one is due, no lookups either.)
    if (tokens + gain) * RETRY_SLOWER / verify <= tokens / plain:
      return False
    refused = self._refused.get(width, 0)
    if stage == "look" and refused < RETRY_EVERY:
      refused = self._refused[width] = refused + 1
    if refused >= RETRY_EVERY and stage == "final":
      self._refused[width] = 0
    return refused >= RETRY_EVERY

  @_host_work
  def timed(self, verified: bool, width: int, seconds: float) -> None:
    """A decode call's duration (the driver reports each), smoothed per kind (verify steps: 0 for a
    plain call, else those of the drafts last returned) and width. The first of each is left out (it
    may have compiled its program); a faster call is believed at once (a shared machine makes calls
    slower, never faster)."""
    key = (self.last_steps if verified else 0, width)
    if key not in self.call_seconds:
      self.call_seconds[key] = None
      return
    old = self.call_seconds[key]
    self.call_seconds[key] = seconds if old is None or seconds < old else old + TIME_SMOOTHING * (seconds - old)

  def _draft(self, seq: Live, length: int) -> list[int]:
    group = self._groups[seq.group]
    own = group.samples[seq.index]
    # A sibling no further on than this sequence rarely holds text past its own (samples of a group
    # start together): not indexed for it.
    sources = [t for i, t in group.samples.items() if i != seq.index and len(t) > len(own)] + group.history
    if not sources and len(seq.tokens) < self.ngram:  # its own repetition would be the prompt's
      return []
    own.sync()
    best = []
    for n in range(min(self.ngram, len(own.tokens)), MIN_NGRAM - 1, -1):
      pattern, near = tuple(own.tokens[-n:]), len(own.tokens) - n
      best = max((s.follow(pattern, length, near) for s in sources), key=len, default=[])  # max keeps the first
      if len(best) == length:
        return best
      if best:
        break
    return max((best, own.repeat(length)), key=len)

  def _group(self, seq: int, prompt_ids) -> _Group:
    """The texts of the group started `seq`-th (its prompt's history as it is when first asked)."""
    group = self._groups.get(seq)
    if group is None:
      history = [NgramIndex(self.ngram, t) for t in self.history.texts(prompt_ids)]
      group = self._groups[seq] = _Group(samples={}, history=history)
    return group

  @_host_work
  def observe(self, group: int, index: int, drafted: int, accepted: int, length: int) -> None:
    """A verify call's outcome for one sequence: `accepted` of its `drafted` tokens, its completion
    now `length` tokens long."""
    if not drafted:  # no token of its draft was verified
      return
    control = self._control.setdefault((group, index), _Control())
    control.tries.append((drafted, accepted))
    self.recent_acceptance += RECENT_SMOOTHING * (accepted / drafted - self.recent_acceptance)
    if len(control.tries) == WINDOW:
      if control.rate() < self.min_acceptance:
        control.back_off(length)
        control.tries.clear()

  # ------------------------------------------------------------------ driver.Recorder

  def token(self, key, prompt_ids, tokens, request) -> None:
    pass

  @_host_work
  def completion(self, key: tuple[int, int], prompt_ids, tokens, request) -> None:
    """A sample ended: its text stays a draft source for its group and joins its prompt's history."""
    group = self._group(key[0], prompt_ids)  # (it may end before its group asked for a draft)
    index = group.samples.get(key[1])
    if index is None:  # indexed at its first lookup (most finished samples are never looked up)
      group.samples[key[1]] = NgramIndex(self.ngram, prompt_ids, growing=list(tokens))
    else:
      index.freeze()
    self.history.add(prompt_ids, tokens)
    self._control.pop(key, None)
    if self.eos_ids:
      self._ended(len(tokens), bool(len(tokens)) and int(tokens[-1]) in self.eos_ids)
    group.ends.pop(key[1], None)

  def _ended(self, length: int, eos: bool) -> None:
    """Counts a completion among the recent ones (`_survives`), the oldest one dropping out."""
    every, at_eos = self._ending_counts
    if len(self._endings) == ENDINGS:
      old, old_eos = self._endings[0]
      every[old] -= 1
      at_eos[old] -= old_eos
    self._endings.append((length, eos))
    if length >= len(every):
      every.extend([0] * (length + 1 - len(every)))
      at_eos.extend([0] * (length + 1 - len(at_eos)))
    every[length] += 1
    at_eos[length] += eos
    self._survival = None

  @_host_work
  def group(self, seq: int, group) -> None:
    """The group left the driver: its texts are no longer needed."""
    self._groups.pop(seq, None)
