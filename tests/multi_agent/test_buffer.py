"""The episode-level buffer: per-policy staleness under random interleavings, and its accounting."""

import numpy as np
from hypothesis import given, settings, strategies as st

from tunixlike.multi_agent import Episode, EpisodeQueue, Turn
from tunixlike.rl.queue import QueueTimeout
from tunixlike.rollout import Completion, RolloutGroup

POLICIES = ("proposer", "solver")


def turn_group(seq, index, version):
  comp = Completion(np.array([4, 5], np.int32), np.zeros(2, np.float32), np.full(2, version, np.int32), "eos")
  return RolloutGroup(prompt_id=(seq, index), prompt_token_ids=np.array([1], np.int32), completions=[comp],
                      rewards=np.zeros(1, np.float32))


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), staleness=st.integers(0, 2),
       schedule=st.lists(st.tuples(st.sampled_from(["admit", "turn", "finish", "train", "sync"]),
                                   st.integers(0, 1), st.integers(0, 7)), min_size=20, max_size=150))
def test_each_policy_s_tokens_stay_within_the_bound_under_any_interleaving(batch, staleness, schedule):
  """Admissions, turns of either policy (tagged with that policy's sampler version), episode ends,
  learner steps (advancing the policies with turns in the batch) and weight syncs in random order:
  every trained episode's tokens of policy p are at most `staleness` behind p's learner, none had
  to be dropped for it (admission and the last-chance wait keep them fresh), and every admitted
  episode is trained or still in flight."""
  q = EpisodeQueue(POLICIES, batch_episodes=batch, max_staleness=staleness)
  sampler = {p: 0 for p in POLICIES}
  learner = {p: 0 for p in POLICIES}
  live, seq, trained, violations = [], 0, 0, []
  for action, who, pick in schedule:
    policy = POLICIES[who]
    if action == "admit" and q.try_admit(dict(sampler)):
      live.append(Episode(seq=seq, record={}, turns=[], groups=[], finish_reason="done",
                          start_versions=dict(sampler)))
      seq += 1
    elif action == "turn" and live:
      ep = live[pick % len(live)]
      ep.turns.append(Turn(policy, "x"))
      ep.groups.append(turn_group(ep.seq, len(ep.groups), sampler[policy]))
    elif action == "finish" and live:
      q.put(live.pop(pick % len(live)))
    elif action == "train":
      try:
        episodes = q.get_batch(dict(learner), timeout_s=0.001)
      except QueueTimeout:
        continue
      trained += len(episodes)
      for ep in episodes:
        for p in POLICIES:
          m = ep.min_version(p)
          if m is not None and learner[p] - m > staleness:
            violations.append((p, learner[p], m))
      for p in POLICIES:
        if any(ep.min_version(p) is not None for ep in episodes):
          learner[p] += 1
        else:
          q.step_skipped(len(episodes), [p])
    elif action == "sync":
      sampler[policy] = learner[policy]
  assert not violations and q.dropped_stale == 0
  assert q.trained == trained
  assert q.admitted == trained + q.in_flight
  assert q.in_flight == len(live) + q.depth()


def test_admission_is_bounded_by_the_slowest_policy():
  """The solver's sampler lagging at version 0 stops admission although the proposer's is current."""
  q = EpisodeQueue(POLICIES, batch_episodes=2, max_staleness=0)
  assert [q.try_admit({"proposer": 0, "solver": 0}) for _ in range(3)] == [True, True, False]
  for i in range(2):
    ep = Episode(seq=i, record={}, turns=[Turn("solver", "x")], groups=[turn_group(i, 0, 0)],
                 finish_reason="done", start_versions={"proposer": 0, "solver": 0})
    q.put(ep)
  assert len(q.get_batch({"proposer": 0, "solver": 0}, timeout_s=1)) == 2
  assert not q.try_admit({"proposer": 1, "solver": 0})  # the solver's weights are not synced yet
  assert q.try_admit({"proposer": 1, "solver": 1})


def test_an_episode_older_than_the_bound_for_one_policy_is_dropped_and_reported():
  dropped = []
  q = EpisodeQueue(POLICIES, batch_episodes=1, max_staleness=1, on_drop=dropped.append,
                   start_versions={"proposer": 5, "solver": 5})
  assert q.try_admit({"proposer": 5, "solver": 5}) and q.try_admit({"proposer": 5, "solver": 5})
  old = Episode(seq=0, record={}, turns=[Turn("proposer", "x"), Turn("solver", "y")],
                groups=[turn_group(0, 0, 5), turn_group(0, 1, 3)], finish_reason="done",
                start_versions={"proposer": 5, "solver": 5})
  new = Episode(seq=1, record={}, turns=[Turn("solver", "y")], groups=[turn_group(1, 0, 5)],
                finish_reason="done", start_versions={"proposer": 5, "solver": 5})
  q.put(old)
  q.put(new)
  assert q.get_batch({"proposer": 5, "solver": 5}, timeout_s=1) == [new]
  assert dropped == [old] and q.dropped_stale == 1
