"""Multi-agent episodes over two real policies' rollout drivers (tiny models, real threads)."""

import threading
import time

import pytest

from relay import Relay
from tunixlike.multi_agent import EpisodeCoordinator


def coordinator(make_drivers, tokenizer, make_env, episodes, sink, **kw):
  factories, _ = make_drivers
  kw = {"max_turns": 8, "step_timeout_s": 30.0, "wait_timeout_s": 60.0, **kw}  # the test's own limits (a run's: rl.*)
  return EpisodeCoordinator(factories, make_env=make_env, records=({"i": i} for i in range(episodes)),
                            encode=tokenizer.encode, detokenize=tokenizer.decode, sink=sink, **kw)


def test_every_token_records_the_version_of_the_policy_that_wrote_it(make_drivers, tokenizer):
  out = []
  c = coordinator(make_drivers, tokenizer, Relay, 6, out.append, max_episodes_in_flight=3)
  c.update_params("b", make_drivers[1]["b"], 7)  # b's weights are at version 7, a's at 0
  stats = c.run(max_wall_s=300)
  assert stats.episodes == len(out) == 6 and stats.turns == 18 and stats.aborted == stats.truncated == 0
  assert sorted(e.seq for e in out) == list(range(6))
  for e in out:
    assert [t.agent for t in e.turns] == ["a", "b", "a"] and e.finish_reason == "done"
    assert [g.group_size for g in e.groups] == [1, 2, 1]
    for turn, group in zip(e.turns, e.groups):
      for comp in group.completions:
        assert comp.num_tokens > 0 and set(comp.policy_versions.tolist()) == {0 if turn.agent == "a" else 7}
      assert group.rewards.tolist() == [float(len(comp.text)) for comp in group.completions]
    assert e.min_version("a") == 0 and e.min_version("b") == 7
    # Each turn's prompt is the env's text for that agent, encoded (with BOS).
    assert [g.prompt_token_ids.tolist() for g in e.groups] == [tokenizer.encode(t.prompt) for t in e.turns]


def test_an_episode_spanning_a_weight_update_keeps_its_earlier_tokens_versions(make_drivers, tokenizer):
  """The first env step waits while both policies move to version 1: the episode's first turn keeps
  version 0, its later turns (of both policies) are version 1, and no slot was held meanwhile."""
  hold, out = threading.Event(), []
  c = coordinator(make_drivers, tokenizer, lambda: Relay(hold=hold), 1, out.append)
  runner = threading.Thread(target=c.run, kwargs=dict(max_wall_s=300), daemon=True)
  runner.start()
  deadline = time.monotonic() + 120
  while c.stats.turns < 1:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  assert all(d.is_idle for d in c.drivers.values())  # the waiting episode holds no decode slot
  params = make_drivers[1]
  c.update_params("a", params["a"], 1)
  c.update_params("b", params["b"], 1)
  while c.versions() != {"a": 1, "b": 1}:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  hold.set()
  runner.join(120)
  assert not runner.is_alive() and len(out) == 1
  (e,) = out
  assert e.start_versions == {"a": 0, "b": 0}
  versions = [sorted({int(v) for c_ in g.completions for v in c_.policy_versions}) for g in e.groups]
  assert versions == [[0], [1], [1]]


def test_a_failing_env_costs_its_episode_and_a_long_turn_is_counted_as_truncated(make_drivers, tokenizer):
  made = iter([Relay(fail_at=1), Relay(prompt_len=40), Relay(order=("a",) * 9)] + [Relay() for _ in range(5)])
  out = []
  c = coordinator(make_drivers, tokenizer, lambda: next(made), 4, out.append, max_turns=4, failure_reward=-1.0)
  stats = c.run(max_wall_s=300)
  by_seq = {e.seq: e for e in out}
  assert stats.episodes == 4 and stats.aborted == 1 and stats.truncated == 2
  failed = by_seq[0]  # raised at its second step: its two sampled turns get the failure reward
  assert failed.finish_reason == "aborted" and [g.rewards.tolist() for g in failed.groups] == [[-1.0], [-1.0, -1.0]]
  assert by_seq[1].finish_reason == "length" and by_seq[1].groups == []  # its first prompt is 41 tokens > 32
  assert by_seq[2].finish_reason == "length" and len(by_seq[2].groups) == 4  # max_turns=4 of 9
  assert by_seq[3].finish_reason == "done" and len(by_seq[3].groups) == 3


@pytest.mark.parametrize("env, message", [
    (lambda: Relay(order=("a", "judge")), "policy 'judge', which this run does not have"),
    (lambda: Relay(samples={"a": 1, "b": 3}), "3 samples of a 'b' turn"),
])
def test_an_env_asking_for_what_the_run_cannot_do_stops_it_with_a_clear_error(make_drivers, tokenizer, env, message):
  c = coordinator(make_drivers, tokenizer, env, 2, lambda e: None)
  with pytest.raises(ValueError, match=message):
    c.run(max_wall_s=300)
  assert not any(d.running for d in c.drivers.values())


def test_lockstep_runs_each_turn_of_every_episode_before_any_next_turn(make_drivers, tokenizer):
  log, out = [], []
  c = coordinator(make_drivers, tokenizer, lambda: Relay(log=log), 5, out.append, max_episodes_in_flight=5,
                  lockstep=True)
  c.run(max_wall_s=300)
  assert len(out) == 5
  turns = [t for _, t in sorted(log)]
  assert turns == sorted(turns) == [0] * 5 + [1] * 5 + [2] * 5


def test_episodes_leave_in_whole_groups_when_asked(make_drivers, tokenizer):
  out = []
  c = coordinator(make_drivers, tokenizer, Relay, 6, out.append, max_episodes_in_flight=6, emit_groups_of=3)
  c.run(max_wall_s=300)
  seqs = [e.seq for e in out]
  assert sorted(seqs[:3]) in ([0, 1, 2], [3, 4, 5]) and sorted(seqs) == list(range(6))
