"""What a learner host runs in place of the sampler when whole hosts sample (mesh.sampler_hosts).

`RemoteSampling` stands where `AsyncRuntime` keeps its driver: the rollouts are sampled and scored
on the sampler hosts, and it runs the `rollouts.LearnerInbox` that moves them into this host's
queue, re-raises the inbox's errors (a silent sampler host, named), and tells the sampler hosts
the run is over when the loop stops. The weights reach them through the policy's own weight sync
(`hosts.weights.Sender`), so `update_params` has nothing left to do.

`SamplerStreams` is what a checkpoint keeps of the sampler hosts' prompt streams. Sampler host i
reads shard i of S of the prompts (`PromptStream(shard=(i, S))`) and, before a prompt can start,
publishes how far it has read (`publish_position`). The learner hosts record every group trained
or dropped; at a checkpoint they pool those records, and for each shard the prompts read but
neither trained nor dropped are the outstanding ones a resume replays, exactly as one host's
`PromptStream.state()` says of its own.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Sequence

import jax

from tunixlike import distributed
from tunixlike.hosts import kv, rollouts
from tunixlike.rl.queue import RolloutQueue
from tunixlike.sampler.driver import DriverStats

PREFIX = "tunixlike/prompts"
START = "tunixlike/run/start"  # learner host 0 -> sampler hosts: where their prompt streams start
STOP_REQUEST = "tunixlike/run/stop_request"  # any host -> learner hosts: a signal asked the run to stop
OVER = "tunixlike/run/over"  # learner host 0 -> sampler hosts: the run has ended (also before its RL loop)
LEFT = "tunixlike/run/left"  # each host that exits on a fault -> learner host 0, which leaves last
LEAVE_WAIT_S = 15.0  # learner host 0's wait for the others to leave: a stuck learner host's watchdog fires in 10 s


def end_run(failure: str | None = None, host: int | None = None) -> None:
  """The run is over (`failure`: the one line that says why it stopped, `host`: the host that died
  or hangs). Learner host 0 says it at the end of every run; any learner host that stops on a fault
  says why first (the others, whose collectives with it then fail, exit with its line). The first
  word stays: a failure's cleanup does not overwrite it."""
  try:
    kv.put(OVER, json.dumps({"failure": failure, "host": host}).encode(), overwrite=False)
  except Exception:  # noqa: BLE001 - ALREADY_EXISTS: said before
    pass


def run_over() -> dict | None:
  """None while the run goes on, else `{"failure": None or why it stopped, "host": the host at fault}`."""
  over = kv.try_get(OVER)
  return None if over is None else json.loads(over)


def leave_after_fault(line: str, dead: int | None = None) -> None:
  """Called by a host about to exit because a host died or hangs, having said so (`line`). Process 0
  holds the coordination service, and when it goes every other process's JAX aborts with a fatal
  error trace of its own, burying the line that says what happened: so every other host marks that
  it leaves, and process 0 tells the sampler hosts why the run ends (unless said before) and waits
  for those hosts (all but the host `dead`) for at most `LEAVE_WAIT_S`."""
  try:
    me = jax.process_index()
    if me != 0:
      kv.put(f"{LEFT}/{me}", b"")
      return
    end_run(failure=line, host=dead)
    deadline = time.monotonic() + LEAVE_WAIT_S
    for host in range(1, jax.process_count()):
      if host != dead and kv.wait(f"{LEFT}/{host}", deadline - time.monotonic()) is None:
        return
  except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED (a host hangs) or no service: leave anyway
    pass


def _position_key(shard: int) -> str:
  return f"{PREFIX}/position/{shard}"


class RemoteSampling:
  """The runtime's sampling side on a learner host (`runtime.Driver`): the sampler hosts' groups,
  through the inbox, into `queue`.

  The loop re-raises the inbox's error at its next wait. But the main thread may be stuck instead,
  in a collective with a learner host that has already stopped on the same fault, or in a weight
  transfer: if the loop has not stopped `grace_s` after the inbox failed, `on_fault(error)` runs
  (the trainer says why and calls its entry point's `on_host_fault`: the CLI exits), so that every
  learner host stops within a bounded time.
  """

  def __init__(self, queue: RolloutQueue, me: int, sampler_hosts: Sequence[int], *, silence_timeout_s: float,
               on_fault: Callable[[BaseException], None] | None = None, grace_s: float = 10.0):
    self.inbox = rollouts.LearnerInbox(queue, me, sampler_hosts=sampler_hosts, silence_timeout_s=silence_timeout_s)
    self.stats = DriverStats()  # nothing decodes here: the sampler hosts keep their own
    self._on_fault, self._grace_s = on_fault, grace_s
    self._stopped = threading.Event()

  def start(self) -> None:
    self.inbox.start()
    if self._on_fault is not None:
      threading.Thread(target=self._watch, daemon=True, name="inbox-watchdog").start()

  def _watch(self) -> None:
    while not self._stopped.wait(0.5):
      if self.inbox.error is not None:
        if not self._stopped.wait(self._grace_s):
          self._on_fault(self.inbox.error)
        return

  def step(self) -> bool:
    return False

  def check(self) -> None:
    self.inbox.check()

  def stop(self, timeout_s: float) -> None:
    self._stopped.set()
    self.inbox.close()

  def update_params(self, params, version: int, *, drain: bool = False) -> None:
    """Nothing to do: the weight sync has already delivered `version` to the sampler hosts."""

  @staticmethod
  def count_refused(info) -> None:
    """A step hook: the key-value entries this host refused so far (`hosts.seal`), a metric."""
    info.metrics["hosts/refused_entries"] = kv.refused()


def publish_position(shard: int, position: int) -> None:
  """A sampler host: it has read its shard up to `position` (before the prompt read last starts)."""
  kv.put(_position_key(shard), str(position).encode())


def _position(shard: int) -> int | None:
  position = kv.try_get(_position_key(shard))  # None: that host has read nothing yet
  return None if position is None else int(position)


class SamplerStreams:
  """The learner hosts' record of the sampler hosts' prompt streams; `state()` is a checkpoint's
  `streams` (one `{"position", "outstanding"}` per sampler host, as `PromptStream.state()`)."""

  def __init__(self, num_samplers: int, states: list[dict[str, Any]] | None = None):
    states = states or [{"position": 0, "outstanding": []} for _ in range(num_samplers)]
    if len(states) != num_samplers:
      raise ValueError(f"{len(states)} prompt streams for {num_samplers} sampler hosts")
    self.num_samplers = num_samplers
    self.base = [(set(s["outstanding"]), int(s["position"])) for s in states]
    self.done_ids: set[int] = set()
    self.replayed = sum(len(s["outstanding"]) for s in states)

  def states(self) -> list[dict[str, Any]]:
    """Where each sampler host starts (a fresh run, or the checkpoint restored)."""
    return [{"position": position, "outstanding": sorted(outstanding)} for outstanding, position in self.base]

  def done(self, groups) -> None:
    self.done_ids.update(g.columns["stream_index"] for g in groups)

  def state(self) -> list[dict[str, Any]]:
    """Every sampler host's stream at this step. A collective of the learner hosts: they pool what
    each trained or dropped, and take learner host 0's reading of the positions."""
    done = set().union(*(set(ids) for ids in distributed.allgather_json(sorted(self.done_ids))))
    positions = distributed.allgather_json([_position(s) for s in range(self.num_samplers)])[0]
    base = []
    for shard, ((outstanding, start), position) in enumerate(zip(self.base, positions)):
      position = start if position is None else max(start, position)
      read = outstanding | {k * self.num_samplers + shard for k in range(start, position)}
      base.append((read - done, position))
    self.base, self.done_ids = base, set()  # every record so far is in the new base
    return self.states()
