"""What the agent server needs of the driver behind it: the server depends on this, not on
`driver.py` (which builds the server), so neither imports the other's module back."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol


class RequestError(Exception):
  """A request the server answers with a 4xx: `status`, OpenAI-style `code` and a message."""

  def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.code, self.message = status, code, message


@dataclasses.dataclass
class TurnResult:
  text: str  # content returned: the sampled tokens but a final EOS, special ones written out; cut before a stop
  full_text: str  # the same, not cut (include_stop_str_in_output)
  finish_reason: str  # OpenAI's: "stop" (EOS or a stop string) or "length"
  prompt_tokens: int
  token_ids: list[int]
  logprobs: list[float]


class EpisodeBackend(Protocol):
  """The server's view of `AgentDriver`: requests become turns of live episodes, rewards attach to
  them, and the counters the server keeps (`stats.unauthorized_requests`, ...) live with the run."""

  model_name: str
  tokenizer: Any
  engine: Any  # its `config` (sampling settings) and `max_prefill_length`
  stats: Any

  def submit(self, episode_id: str, text: str, *, add_special_tokens: bool, max_tokens: int,
             stops: tuple[str, ...], post: Callable[[tuple], None], stream: bool) -> Any: ...

  def cancel(self, turn: Any) -> None: ...

  def post_reward(self, episode_id: str, reward) -> None: ...

  def count_clamped(self, episode_id: str) -> None: ...
