"""optim.group_by_length: rows sorted by length, each micro-batch trimmed to a prefix length.

The trimmed step must be the padded step (same loss, metrics and updated weights), while the short
micro-batches really run at a shorter length."""

import jax
import numpy as np
import pytest
from flax import nnx

from tunixlike.learner import batch as batch_lib
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.ppo import PPOLearner
from tunixlike.learner.train_step import Learner, prefix_lengths, row_lengths
from tunixlike.learner.value import PolicyWithValue
from tunixlike.mesh import LEARNER_RULES
from tunixlike.rollout import Completion, RolloutGroup

T = 64


def _cfg(micro=4, group=0, **algo):
  return LearnerConfig(algo=AlgoConfig(**algo),
                       optim=OptimConfig(learning_rate=1e-3, micro_batches=micro, group_by_length=group),
                       logprob_chunk_size=16)


def long_tailed_batch(num_groups=4, group_size=4, seed=0, vocab=128):
  """Completion lengths with a long tail (most 2-9 tokens, one in eight 40-56), padded to T."""
  rng = np.random.default_rng(seed)
  groups = []
  for gi in range(num_groups):
    prompt = rng.integers(1, vocab, size=rng.integers(2, 6)).astype(np.int32)
    comps = []
    for _ in range(group_size):
      n = int(rng.integers(40, 57) if rng.random() < 0.125 else rng.integers(2, 10))
      comps.append(Completion(rng.integers(1, vocab, size=n).astype(np.int32),
                              (-4.8 + 0.3 * rng.normal(size=n)).astype(np.float32),
                              np.full(n, 0, np.int32), "eos"))
    groups.append(RolloutGroup(prompt_id=gi, prompt_token_ids=prompt, completions=comps,
                               rewards=rng.integers(0, 2, size=group_size).astype(np.float32)))
  # interleave long and short rows, so sorting has work to do
  return batch_lib.assemble_batch(groups, num_rows=num_groups * group_size, seq_buckets=(T,), advantage="grpo")


def _flat(tree):
  return {"/".join(map(str, p)): np.asarray(jax.device_get(v.get_value() if hasattr(v, "get_value") else v))
          for p, v in nnx.to_flat_state(tree)}


def _assert_same_step(a, b, metrics=("loss", "pg_loss", "grad_norm", "entropy", "is_weight", "clip_frac",
                                     "num_tokens", "version_lag_mean", "advantage_abs_mean")):
  (s1, m1), (s2, m2) = a, b
  for k in metrics:
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-5, atol=1e-7, err_msg=k)
  p1, p2 = _flat(s1.params), _flat(s2.params)
  assert p1.keys() == p2.keys()
  for k in p1:
    np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=2e-6, err_msg=k)


def test_prefix_lengths_and_row_lengths():
  assert prefix_lengths(64, 4) == (16, 32, 48, 64)
  assert prefix_lengths(176, 4) == (44, 88, 132, 176)
  assert prefix_lengths(3, 4) == (1, 2, 3)  # duplicates collapse
  mask = np.array([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 1]], np.float32)
  np.testing.assert_array_equal(row_lengths(mask), [3, 0, 5])


@pytest.mark.slow
def test_grouped_step_equals_padded_step_and_trims(tiny_model):
  batch = long_tailed_batch()
  lengths = row_lengths(batch["loss_mask"])
  assert lengths.max() > 48 and np.median(lengths) < 16  # a long tail, interleaved
  padded = Learner(tiny_model(), _cfg(group=0))
  grouped = Learner(tiny_model(), _cfg(group=4))
  placed = grouped.put_batch(batch)
  branch = np.asarray(placed["length_branch"])
  # rows sorted: the first micro-batches hold only short rows and run at 16 of the 64 positions
  assert branch.tolist() == sorted(branch.tolist()) and branch[0] == 0 and branch[-1] == 3, branch
  stepped = grouped.train_step(grouped.state, placed, jax.random.key(0))
  _assert_same_step(padded.train_step(padded.state, padded.put_batch(batch), jax.random.key(0)), stepped)
  grouped.state = stepped[0]
  assert grouped.num_traces == 1
  # another batch with another branch pattern reuses the one compiled step
  grouped.state, _ = grouped.train_step(grouped.state, grouped.put_batch(long_tailed_batch(seed=3)), jax.random.key(1))
  assert grouped.num_traces == 1


@pytest.mark.slow
def test_grouped_step_on_a_sharded_mesh_with_kl(tiny_model, mesh4):
  batch = long_tailed_batch()
  algo = dict(kl_coef=0.1, aggregation="seq_mean_token_mean")
  padded = Learner(tiny_model(), _cfg(group=0, **algo), mesh=mesh4, rules=LEARNER_RULES)
  grouped = Learner(tiny_model(), _cfg(group=4, **algo), mesh=mesh4, rules=LEARNER_RULES)
  placed = grouped.put_batch(batch)
  assert placed["tokens"].sharding.spec[1] == "fsdp" and placed["length_branch"].sharding.is_fully_replicated
  _assert_same_step(padded.train_step(padded.state, padded.put_batch(batch), jax.random.key(0)),
                    grouped.train_step(grouped.state, placed, jax.random.key(0)), metrics=("loss", "grad_norm", "kl"))


@pytest.mark.slow
def test_ppo_columns_are_sorted_with_the_rows(tiny_model):
  batch = long_tailed_batch()
  padded = PPOLearner(PolicyWithValue.create(tiny_model()), _cfg(group=0))
  grouped = PPOLearner(PolicyWithValue.create(tiny_model()), _cfg(group=4))
  _assert_same_step(padded.train_step(padded.state, padded.put_batch(batch), jax.random.key(0)),
                    grouped.train_step(grouped.state, grouped.put_batch(batch), jax.random.key(0)),
                    metrics=("loss", "grad_norm", "vf_loss", "value_mean", "return_mean", "token_advantage_abs"))


def test_config_errors_name_the_key():
  with pytest.raises(ValueError, match=r"optim.group_by_length=-1: must be an int >= 0"):
    OptimConfig(micro_batches=2, group_by_length=-1)
  with pytest.raises(ValueError, match=r"optim.group_by_length=4: needs optim.micro_batches >= 2"):
    OptimConfig(group_by_length=4)
