"""The transport between a run's sampler side and its learner side: the run's layout, chosen once at
the entry (`tunixlike.layouts.start`; `build.start_processes` where no entry chose one).

    sampler side --- rollout groups ---> queue -> learner side (the RL loop)
                 <--- weights + version --- policy.sync_weights
                 <--- faults, stop ------>

The build asks it where this process's work runs (its meshes, its shard of the prompts, its share
of the decode slots, whether it learns); the learner side (`build.make_runtime`, `trainer.py`) holds
it and does not know which one it has:

- `in_process.InProcess`: the sampler side runs in this process (split or colocated meshes). Its
  driver admits from and scores into the shared `RolloutQueue`; weights cross by `jax.device_put`
  (`weight_sync`); faults are this process's own exceptions, and there is no peer to tell.
- `hosts.transport.CrossHost`: whole sampler hosts (mesh.sampler_hosts). Rollouts and control travel
  through the coordination service's key-value store, weights by cross-host `jax.device_put`.

A new layout (elastic sampler hosts, a learner on another slice) is a new `Transport`, not
branches in the builder and the loop.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Protocol

from tunixlike import device_turns

if TYPE_CHECKING:
  from tunixlike.rl.runtime import Driver, RewardStage


class PeerFault(TimeoutError):
  """A process on the other end died or hangs; `host`: which, when known. The run cannot save
  without it: the line says where the run resumes from."""

  def __init__(self, message: str, host: int | None = None):
    super().__init__(message)
    self.host = host


@dataclasses.dataclass
class SamplerSide:
  """What the learner's runtime drives: the sampling side's driver (`runtime.Driver`), the reward
  stage (None: scored on the other end), the device turns of a colocated layout, and step hooks."""

  driver: Driver
  rewards: RewardStage | None
  turns: device_turns.DeviceTurns = device_turns.NO_TURNS
  hooks: tuple[Callable[[Any], None], ...] = ()


class Transport(Protocol):
  """The run's layout as the build asks it, and the learner side's view of its sampler side."""

  checkpoint_processes: Any  # the processes that write checkpoints (None: every process)
  # The processes that decode: each takes its share of sampler.max_concurrent_decodes and reads its
  # own shard of the training prompts (a checkpoint keeps a prompt stream for each).
  decoders: int
  # This process holds the learner. False: it only decodes; its model is the structure alone (the
  # weights arrive from the learner's processes) and it evaluates none of the held-out prompts.
  learns: bool
  data_shard: tuple[int, int]  # (index, count): this process's shard of the prompts it reads

  def meshes(self) -> Any:
    """This process's `mesh.Meshes` (built when the build asks: after the data's checks)."""

  def describe(self) -> list[str]:
    """This run's layout, a line per process ([]: nothing beyond the meshes line)."""

  def engine(self, make: Callable[[], Any]):
    """The rollout engine `make()` builds when the sampler side is here; None when it is elsewhere."""

  def weight_sync(self, setup, learner):
    """The policy's weight sync to the sampler side; None: the policy's own (`jax.device_put`)."""

  def eval_weights(self, setup, rl) -> tuple[Any, int]:
    """(params, version) for the held-out eval on `rl.eval_engine`."""

  def stream(self, pipe, states: list[dict] | None, kept=None):
    """The learner's record of the prompt stream(s): from the start (`states` None) or a checkpoint's
    `states` (those `own` picked); `kept`: a checkpoint's rollouts in flight it continues."""

  def own(self, states: list[dict]) -> list[dict]:
    """The checkpoint's stream states this process continues."""

  def stream_states(self, stream, own: dict) -> list[dict] | None:
    """Every reader's stream state for a checkpoint (a collective), None with one reader."""

  def start(self, stream) -> None:
    """The RL loop starts: the sampler side hears where its prompts start."""

  def sampler_side(self, setup, rl, stream, queue, **kw) -> SamplerSide:
    """The sampling side the runtime drives, its first weights delivered; `kw`: `say`, `on_fault`
    (a fault on the other end while the loop is stuck), `on_sampler_step`, `resume`."""

  def stop_asked(self) -> str | None:
    """Who on the other end asked the run to stop (a signal there), or None."""

  def end(self, failure: str | None = None, host: int | None = None) -> None:
    """The run is over (`failure`: why it stopped, `host`: the one at fault); the other end hears it."""

  def fault_elsewhere(self) -> PeerFault | None:
    """The fault another process stopped the run on, or None."""
