"""Episode strategies: what a driver's groups are and what a finished turn does.

The driver shell (`driver.RolloutDriver`) runs one loop for every kind of rollout: swap weights,
`prepare`, reserve blocks (preempted occupants go back to the strategy: `requeue`), `refill` the
free slots, generate, and collect each slot's tokens (`record`, `stop_reason`, `finish`). The
strategy decides the rest:
  * `single_turn.SingleTurn`: G samples per prompt; a finished turn finishes the sample and the
    group leaves when its G samples have;
  * `episodes.EnvEpisodes`: G environment episodes per prompt; a finished turn feeds the environment
    and the episode waits for a slot again with the observation appended;
  * `agents.driver.AgentEpisodes`: G agent episodes per prompt, each turn a request of the user's
    agent code; a finished turn answers the request.
Every strategy starts its groups through the one `admission.Admission` and decodes in the driver's
`slots.Slots` over an `engine_api.EngineAPI`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from tunixlike.sampler.driver_api import DriverStats


class Episodes(Protocol):
  """What the driver shell asks of its episode strategy, all on the driver thread."""

  # Whether a checkpoint can continue its groups in flight; such a strategy also has `in_flight()`
  # (its groups as `InFlightGroup`s) and `resume(groups)` (`SingleTurn`). Strategies whose episodes
  # hold state outside the driver (an environment, a conversation) start them again on resume.
  continues_in_flight: bool
  # Noise keys per sample: one per policy turn (multi-turn), or 0 for one per sample (`noise.NoiseKeys`).
  key_turns: int

  def bind(self, driver) -> DriverStats:
    """Called once by the driver it runs in, which it keeps (`driver.engine`, `params`, `version`,
    `slots`, `admission`, `keys`, `tracer`, `emit`); returns the driver's stats object (a
    `DriverStats`, or a subclass with the strategy's counters)."""

  @property
  def is_idle(self) -> bool:
    """Nothing admitted is left to decode or wait for (the driver's slots aside)."""

  def prepare(self) -> None:
    """Before slots are refilled: bring in outside work (environment results, requests) and start
    groups through the driver's admission."""

  def requeue(self, info: Any) -> None:
    """A slot's occupant preempted by the cache (a paged pool ran dry): resume it later."""

  def refill(self, free: list[int]) -> None:
    """Fills the free slots (ascending) with waiting work."""

  def record(self, info: Any, token: int, logprob: float, version: int, mask: np.ndarray | None) -> None:
    """One token the slot of `info` sampled."""

  def stop_reason(self, info: Any, token: int, eos: set[int]) -> str | None:
    """Why the turn ends at `token` (eos / stop / length), or None to go on."""

  def finish(self, slot: int, info: Any, reason: str) -> None:
    """The turn of `info` ended (its slot is already free in the driver's table; the engine still
    holds its KV until the driver releases it)."""

  def collected(self) -> None:
    """After each generate call's tokens are all collected."""

  def close(self) -> None:
    """The driver stopped: end outside work (worker threads, servers)."""
