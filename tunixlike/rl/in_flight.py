"""What a checkpoint keeps of the rollouts in flight, so that a resume continues them instead of
decoding them again (checkpoint.keep_rollouts).

At a save, every prompt the stream handed out that no step has trained or dropped is in one of three
places: decoding in the driver (each sample's tokens so far), in the reward stage, or scored in the
queue. `take` looks at them in that order, so a group that moves on between two looks is found twice
(the later place wins) and none is missed. A resume gives them back (`Kept`): the queue's groups are
queued again; the others go to the driver, which prefills each unfinished sample's prompt and tokens
so far and decodes on with the same noise (`fold_in(key, n)` for token n), so under the same weights a
continued sample is the one an uninterrupted run would have produced. A group the reward stage held
comes back finished and is scored again. The queue's version rejection applies to them as to any
group: one whose oldest token is too old for the step that would train it is dropped and counted.

Kept for free-running single-turn runs decoded by this process. Regenerated from their prompts as
before (`why_not`): multi-turn episodes and agents (their environment or conversation is not in
the checkpoint), whole sampler hosts (their drivers run elsewhere), sampler.record_routing (a
prefill's experts for the kept tokens are not the ones their decode used) and rl.deterministic
(which keeps its finished groups and decodes the current round again bit for bit, rl/lockstep.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tunixlike import rollout as rollout_lib
from tunixlike.rollout import RolloutGroup
from tunixlike.sampler.driver import InFlightGroup, PromptRequest


def why_not(cfg) -> str | None:
  """Why this run's rollouts in flight cannot be kept (None: they can, and are unless
  checkpoint.keep_rollouts=false; a checkpoint then records only how many tokens they held)."""
  for reason, on in (("rl.deterministic", cfg.rl.deterministic), ("rl.env", cfg.rl.env), ("rl.agent", cfg.rl.agent),
                     ("mesh.sampler_hosts", cfg.mesh.sampler_hosts),
                     ("sampler.record_routing", cfg.sampler.record_routing)):
    if on:
      return reason
  return None


@dataclasses.dataclass(frozen=True)
class Kept:
  """One process's rollouts in flight at a save: `scored` groups (the queue's) and the driver's
  (`in_flight`, with the reward stage's as finished ones), and the driver's next start order."""

  scored: list[RolloutGroup]
  in_flight: list[InFlightGroup]
  next_seq: int

  @property
  def stream_indices(self) -> list[int]:
    return sorted([g.columns["stream_index"] for g in self.scored]
                  + [g.request.columns["stream_index"] for g in self.in_flight])

  @property
  def tokens(self) -> int:
    """Decoded tokens the resume does not decode again."""
    return sum(g.num_tokens for g in self.scored) + sum(g.kept_tokens for g in self.in_flight)


def take(driver, rewards, queue, timeout_s: float) -> Kept | None:
  """The rollouts in flight now (see the module docstring): driver, reward stage, queue, in that
  order (called on the learner's thread, between two steps, so nothing is trained meanwhile).
  None when the driver did not finish its step within `timeout_s` (it hangs)."""
  held = driver.in_flight(timeout_s)
  if held is None:
    return None
  found: dict[int, Any] = {g.seq: g for g in held}
  next_seq = driver.next_seq
  found.update({g.seq: _finished(g) for g in rewards.held()})
  found.update({g.seq: g for g in queue.ready_groups()})
  groups = [found[seq] for seq in sorted(found)]
  return Kept(scored=[g for g in groups if isinstance(g, RolloutGroup)],
              in_flight=[g for g in groups if isinstance(g, InFlightGroup)], next_seq=next_seq)


def _finished(group: RolloutGroup) -> InFlightGroup:
  """A group the reward stage holds, as the driver emits it again (and the reward stage scores it)."""
  request = PromptRequest(prompt_id=group.prompt_id, token_ids=group.prompt_token_ids, columns=dict(group.columns),
                          prompt_text=group.prompt_text)
  return InFlightGroup(seq=group.seq, request=request, prompt_ids=group.prompt_token_ids,
                       keys=np.zeros((group.group_size, 2), np.uint32), version=group.admitted_version,
                       samples=list(group.completions))


def to_json(kept: Kept) -> dict:
  return {"scored": rollout_lib.groups_to_json(kept.scored), "next_seq": kept.next_seq,
          "in_flight": [rollout_lib.to_json({**_fields(g), "request": _fields(g.request)}) for g in kept.in_flight]}


def _fields(x) -> dict:  # not dataclasses.asdict: that would turn the samples' Completions into dicts
  return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


def from_json(item: dict) -> Kept:
  in_flight = []
  for x in item["in_flight"]:
    fields = rollout_lib.from_json(x)
    in_flight.append(InFlightGroup(**{**fields, "request": PromptRequest(**fields["request"])}))
  return Kept(scored=rollout_lib.groups_from_json(item["scored"]), in_flight=in_flight, next_seq=int(item["next_seq"]))
