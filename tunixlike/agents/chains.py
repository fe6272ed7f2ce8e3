"""Token-exact records of agent conversations served over HTTP.

An agent sends its whole conversation with every request and the server renders it to text (the
chat template). A `Chain` holds what the model has read and written so far, both as token ids and
as that text. A request whose rendered text starts with the chain's text extends it: only the new
text is tokenized (loss_mask 0), so earlier tokens, the sampled ones above all, are never
re-tokenized and what the learner trains on is exactly what the sampler saw. A request that does
not extend it (the agent edited or dropped part of its history) cannot be recorded in the same
chain: the episode is split there and a new chain starts (`Recording.extend` says so).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

# For tokenizers without a chat template: each message's text in order, a model turn closed by EOS
# (as chat templates close it with their end-of-turn token), after BOS if the tokenizer has one.
PLAIN_CHAT_TEMPLATE = ("{% if bos_token %}{{ bos_token }}{% endif %}"
                       "{% for m in messages %}{{ m['content'] }}"
                       "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")


@dataclasses.dataclass
class Chain:
  """One token-exact conversation: the first request's rendering, then sampled and inserted tokens."""

  prompt_ids: list[int]
  text: str  # the rendered text of everything so far (sampled tokens decoded with special tokens)
  version: int  # sampler version when the chain started (stamped on its prompt tokens)
  tokens: list[int] = dataclasses.field(default_factory=list)  # after the prompt
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1 = sampled by the policy

  @property
  def ids(self) -> list[int]:
    return self.prompt_ids + self.tokens

  @property
  def sampled_tokens(self) -> int:
    return sum(self.loss_mask)

  def insert(self, ids: Sequence[int], text: str, version: int) -> None:
    """Tokens the model did not write (tool results, user turns, the template's markup)."""
    self.tokens += [int(i) for i in ids]
    self.logprobs += [0.0] * len(ids)
    self.versions += [int(version)] * len(ids)
    self.loss_mask += [0] * len(ids)
    self.text += text

  def sample(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], text: str) -> None:
    """Tokens the policy sampled, with their logprobs and per-token versions."""
    self.tokens += [int(i) for i in ids]
    self.logprobs += [float(x) for x in logprobs]
    self.versions += [int(v) for v in versions]
    self.loss_mask += [1] * len(ids)
    self.text += text


@dataclasses.dataclass(frozen=True)
class Extension:
  """What a request adds: the ids to insert and, for a split, the new chain instead."""

  ids: list[int]  # the whole prompt of this request (chain ids after the extension)
  new_ids: list[int]  # tokens inserted by this request
  new_text: str
  split: bool  # the request does not extend the current chain: a new chain starts


class Recording:
  """The chains of one episode (more than one only if the agent edited its history)."""

  def __init__(self, encode: Callable[[str, bool], list[int]]):
    """`encode(text, add_special_tokens)` tokenizes; the first rendering of a chain may add special
    tokens (a plain completion prompt gets BOS), an extension never does."""
    self._encode = encode
    self.chains: list[Chain] = []

  @property
  def current(self) -> Chain | None:
    return self.chains[-1] if self.chains else None

  @property
  def splits(self) -> int:
    return max(len(self.chains) - 1, 0)

  def extend(self, text: str, *, add_special_tokens: bool) -> Extension:
    """The prompt for a request rendering to `text` (not committed: see `commit`)."""
    chain = self.current
    if chain is not None and text.startswith(chain.text):
      rest = text[len(chain.text):]
      new = self._encode(rest, False) if rest else []
      return Extension(chain.ids + new, new, rest, split=False)
    ids = self._encode(text, add_special_tokens)
    return Extension(ids, ids, text, split=chain is not None)

  def commit(self, ext: Extension, version: int) -> Chain:
    if ext.split or self.current is None:
      self.chains.append(Chain(prompt_ids=list(ext.new_ids), text=ext.new_text, version=version))
    elif ext.new_ids or ext.new_text:
      self.current.insert(ext.new_ids, ext.new_text, version)
    return self.current
