"""optim.group_by_length: rows sorted by length, each micro-batch trimmed to a prefix length.

The trimmed step must be the padded step (same loss, gradients and step metrics), while the short
micro-batches really run at a shorter length."""

import jax
import numpy as np
import pytest

from jit_traces import count_traces
from learner_trees import flat_values
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.ppo import PPOLearner
from tunixlike.learner.train_step import Learner, prefix_lengths, row_lengths
from tunixlike.learner.value import PolicyWithValue
from tunixlike.mesh import LEARNER_RULES

# Most slow tests' models have one layer: trimming is per micro-batch, the same at any depth, and every
# branch of the grouped step compiles a forward and backward of each layer.
ONE_LAYER = dict(num_layers=1)


def _cfg(micro=4, group=0, **algo):
  return LearnerConfig(algo=AlgoConfig(**algo),
                       optim=OptimConfig(learning_rate=1e-3, micro_batches=micro, group_by_length=group),
                       logprob_chunk_size=16)


def _placed(learner, batch):
  placed = learner.put_batch(batch)
  if isinstance(learner, PPOLearner):  # critic values, GAE targets: what its step computes first
    placed, _ = learner.prepare(learner.state, placed)
  return placed


def _assert_same_step(padded, grouped, batch, metrics=("loss", "pg_loss", "grad_norm", "entropy", "is_weight",
                                                       "clip_frac", "num_tokens", "version_lag_mean",
                                                       "advantage_abs_mean")):
  """The same loss and gradients (before the optimizer: Adam's first step divides each gradient by
  its own size, which turns float reassociation in near-zero gradients into visible weight noise),
  and the same step metrics."""
  (l1, g1), (l2, g2) = (x.loss_and_grads(x.state, _placed(x, batch)) for x in (padded, grouped))
  np.testing.assert_allclose(l2, l1, rtol=2e-5)
  f1, f2 = flat_values(g1), flat_values(g2)
  assert f1.keys() == f2.keys()
  for k in f1:
    np.testing.assert_allclose(f2[k], f1[k], rtol=1e-4, atol=1e-7, err_msg=k)
  (_, m1), (_, m2) = (x.train_step(x.state, x.put_batch(batch), jax.random.key(0)) for x in (padded, grouped))
  for k in metrics:
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-5, atol=1e-7, err_msg=k)


def test_prefix_lengths_and_row_lengths():
  assert prefix_lengths(64, 4) == (16, 32, 48, 64)
  assert prefix_lengths(176, 4) == (44, 88, 132, 176)
  assert prefix_lengths(3, 4) == (1, 2, 3)  # duplicates collapse
  mask = np.array([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 1]], np.float32)
  np.testing.assert_array_equal(row_lengths(mask), [3, 0, 5])


@pytest.mark.slow
def test_grouped_step_equals_padded_step_and_trims(tiny_model, long_tailed_batch):
  batch = long_tailed_batch()
  lengths = row_lengths(batch["loss_mask"])
  assert lengths.max() > 48 and np.median(lengths) < 16  # a long tail, interleaved
  padded = Learner(tiny_model(**ONE_LAYER), _cfg(group=0))
  grouped = Learner(tiny_model(**ONE_LAYER), _cfg(group=4))
  placed = grouped.put_batch(batch)
  branch = np.asarray(placed["length_branch"])
  # rows sorted: the first micro-batches hold only short rows and run at 16 of the 64 positions
  assert branch.tolist() == sorted(branch.tolist()) and branch[0] == 0 and branch[-1] == 3, branch
  with count_traces() as traces:
    _assert_same_step(padded, grouped, batch)
  assert traces["_train_step"] == 2  # one trace per learner
  # another batch with another branch pattern reuses the one compiled step (the last step donated
  # the learner's state, so a fresh learner)
  grouped, patterns = Learner(tiny_model(**ONE_LAYER), _cfg(group=4)), []
  with count_traces() as traces:
    for seed in (0, 3):
      placed = grouped.put_batch(long_tailed_batch(seed=seed))
      patterns.append(np.asarray(placed["length_branch"]).tolist())
      grouped.state, _ = grouped.train_step(grouped.state, placed, jax.random.key(seed))
  assert patterns[0] != patterns[1], patterns
  assert traces["_train_step"] == 1


@pytest.mark.slow
def test_grouped_step_on_a_sharded_mesh_with_kl(tiny_model, long_tailed_batch, mesh4):
  batch = long_tailed_batch()
  algo = dict(kl_coef=0.1, aggregation="seq_mean_token_mean")
  # two layers here (the default): on the mesh one layer saved 2 s of 57. Two length groups, not
  # four: each is a compiled branch, and the four-branch trim is the test above's.
  padded = Learner(tiny_model(), _cfg(group=0, **algo), mesh=mesh4, rules=LEARNER_RULES)
  grouped = Learner(tiny_model(), _cfg(group=2, **algo), mesh=mesh4, rules=LEARNER_RULES)
  placed = grouped.put_batch(batch)
  assert placed["tokens"].sharding.spec[1] == "fsdp" and placed["length_branch"].sharding.is_fully_replicated
  _assert_same_step(padded, grouped, batch, metrics=("loss", "grad_norm", "kl"))


@pytest.mark.slow
def test_ppo_columns_are_sorted_with_the_rows(tiny_model, long_tailed_batch):
  batch = long_tailed_batch()
  padded = PPOLearner(PolicyWithValue.create(tiny_model(**ONE_LAYER), seed=0), _cfg(group=0))
  grouped = PPOLearner(PolicyWithValue.create(tiny_model(**ONE_LAYER), seed=0), _cfg(group=2))  # sorted all the same
  _assert_same_step(padded, grouped, batch,
                    metrics=("loss", "grad_norm", "vf_loss", "value_mean", "return_mean", "token_advantage_abs"))


def test_config_errors_name_the_key():
  with pytest.raises(ValueError, match=r"optim.group_by_length=-1: must be >= 0"):
    OptimConfig(micro_batches=2, group_by_length=-1)
  with pytest.raises(ValueError, match=r"optim.group_by_length=4: needs optim.micro_batches >= 2"):
    OptimConfig(group_by_length=4)
