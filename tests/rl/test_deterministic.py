"""rl.deterministic through the runtime: two runs of the same config are the same run, at any
staleness and in both layouts (real engine, learner, threads and rewards on 8 CPU devices)."""

import threading

import numpy as np
import pytest

from test_runtime import tiny_config, with_layout
from tunixlike import config as config_lib, rewards
from tunixlike.rl import build, schedule, weight_sync
from tunixlike.rl.lockstep import LockstepQueue
from tunixlike.rl.prompts import PromptStream
from tunixlike.rollout import Completion, RolloutGroup


def run(cfg, reward=None):
  """A run's per-step metrics and trained completions, and the final parameters' checksum."""
  setup = build.build(cfg, None)
  rl = build.build_rl(setup, reward=reward or rewards.CombinedReward(["stopped"], timeout_s=cfg.rl.reward_timeout_s))
  steps = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: steps.append((
      schedule.without_timing(info.metrics),
      [(g.columns["stream_index"], [c.token_ids.tolist() for c in g.completions],
        [c.policy_versions.tolist() for c in g.completions]) for g in info.trained])))
  runtime.run()
  setup.tracer.close()
  return steps, weight_sync.checksum(rl.policy.full_params())


@pytest.mark.slow
@pytest.mark.parametrize("staleness,layout", [(0, "split"), (1, "colocated"), (1, "split"), (4, "split"),
                                              (4, "colocated")])
def test_two_deterministic_runs_are_the_same_run(staleness, layout):
  cfg = with_layout(config_lib.replace(tiny_config(max_staleness=staleness, deterministic=True),
                                       rl=dict(num_steps=staleness + 3)), layout)
  first, second = run(cfg), run(cfg)
  assert first == second  # every metric but timings, every trained token and its version, the weights
  assert all(metrics["deterministic"] == 1 for metrics, _ in first[0])
  # The schedule: every batch was sampled `staleness` versions back (round v decodes batch v + s),
  # and the batches hold the prompts in stream order.
  assert [m["staleness/max"] for m, _ in first[0]] == [min(step, staleness) for step in range(staleness + 3)]
  order = [index for _, groups in first[0] for index, _, _ in groups]
  assert order == sorted(order) == list(range(len(order)))
  # Every token of a group has its round's version: no swap landed mid-sequence.
  assert all(len(set(v for vs in versions for v in vs)) == 1 for _, groups in first[0] for _, _, versions in groups)


def _group(seq, reward):
  c = Completion(token_ids=np.array([1], np.int32), logprobs=np.array([-1.0], np.float32),
                 policy_versions=np.array([0], np.int32), finish_reason="eos")
  return RolloutGroup(prompt_id=seq, prompt_token_ids=np.array([2], np.int32), completions=[c, c],
                      rewards=np.array(reward, np.float32), seq=seq)


def test_dropped_groups_are_replaced_by_the_next_in_start_order_and_extra_admissions_handed_over():
  """At staleness 0 every admission is used by the batch itself: a group the filter drops needs an
  admission handed over at the same version (no params: no swap), and the batch is the next kept
  groups in start order, whatever order they were put in."""
  q = LockstepQueue(2, 0, stream_position=lambda: 0)
  admitted = [q.try_admit(0) for _ in range(3)]
  assert admitted == [True, True, False]
  keep = lambda g: float(np.ptp(g.rewards)) > 0
  out = []
  learner = threading.Thread(target=lambda: out.append(q.get_batch(0, 30, keep=keep)))
  learner.start()
  q.put(_group(1, [0, 1]))
  q.put(_group(0, [1, 1]))  # no variance: dropped
  params, version = q.next_round(30)  # the sampler, drained: more admissions at the same version
  assert (params, version) == (None, 0)
  assert q.try_admit(0) and not q.try_admit(0)
  q.put(_group(2, [1, 0]))
  learner.join(30)
  assert [g.seq for g in out[0]] == [1, 2]
  assert q.dropped_filtered == 1 and [g.seq for g in q.take_dropped()] == [0]
  q.hand_over("weights v1", 1)
  assert q.next_round(1) == ("weights v1", 1)
  assert [q.try_admit(1) for _ in range(3)] == [True, True, False]  # (0 + 1 + 1) * 2 + 1 freed = 5 admissions
