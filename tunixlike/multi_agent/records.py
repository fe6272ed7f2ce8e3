"""The records episodes start from, numbered so that a resume loses none and trains none twice.

A multi-agent run's episodes start from records {"index": i}, i = 0, 1, 2, ... (the env seeds its
episode from it). As `rl.prompts.PromptStream` does for prompts, a checkpoint keeps `position` (the
next index) and `outstanding` (indices handed out but neither trained nor dropped: episodes in
flight or waiting in the buffer); a resume replays the outstanding ones first, then goes on from
`position`.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence


class EpisodeRecords:
  """An endless iterator of episode records; `done` takes trained or dropped episodes' indices."""

  def __init__(self, position: int = 0, replay: Sequence[int] = ()):
    self._lock = threading.Lock()
    self._replay = sorted(replay)
    self.replayed = len(self._replay)
    self.position = position
    self.outstanding: set[int] = set()

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, Any]:
    with self._lock:
      if self._replay:
        index = self._replay.pop(0)
      else:
        index, self.position = self.position, self.position + 1
      self.outstanding.add(index)
    return {"index": index}

  def done(self, indices: Sequence[int]) -> None:
    with self._lock:
      self.outstanding.difference_update(indices)

  def state(self) -> dict[str, Any]:
    with self._lock:
      return {"position": self.position, "outstanding": sorted(self.outstanding | set(self._replay))}
