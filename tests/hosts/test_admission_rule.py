"""The rule a sampler host applies remotely (`hosts.rollouts`) admits exactly what the queue would."""

import numpy as np

from tunixlike.rl.queue import RolloutQueue
from tunixlike.rollout import Completion, RolloutGroup


def _group(version):
  c = Completion(token_ids=np.array([1], np.int32), logprobs=np.zeros(1, np.float32),
                 policy_versions=np.array([version], np.int32), finish_reason="eos")
  return RolloutGroup(prompt_id=version, prompt_token_ids=np.array([1], np.int32), completions=[c])


def test_remote_rule_matches_the_queues_own_admission():
  local, remote = RolloutQueue(2, 1), RolloutQueue(2, 1)
  rng = np.random.default_rng(0)
  sampler_version, learner_version, running = 0, 0, []
  for _ in range(300):
    op = rng.integers(0, 4)
    if op == 0:  # admit at the sampler's version, by each queue's rule
      admitted = local.try_admit(sampler_version)
      remote_ok = remote.admitted < (1 + sampler_version + 1) * 2 + remote.admissions_freed()
      assert admitted == remote_ok
      if admitted:
        remote.admitted_elsewhere(sampler_version)
        running.append(sampler_version)
    elif op == 1 and running:
      v = running.pop(int(rng.integers(0, len(running))))
      local.put(_group(v))
      remote.put(_group(v))
    elif op == 2 and local.depth() >= 2 and not any(v <= learner_version - 1 for v in running):
      keep = (lambda g: g.prompt_id % 3 != 0) if rng.random() < 0.3 else None  # drops free admissions
      outcome = []
      for q in (local, remote):
        try:
          outcome.append(q.get_batch(learner_version, 0.01, keep=keep))
        except TimeoutError:  # too few left after the drops: both queues must say so
          outcome.append(None)
      a, b = outcome
      if a is None or b is None:
        assert a is b
        continue
      assert [g.prompt_id for g in a] == [g.prompt_id for g in b]
      learner_version += 1
    elif op == 3:
      sampler_version = learner_version
    assert local.counts() == remote.counts() and local.in_flight == remote.in_flight
  assert learner_version > 10
