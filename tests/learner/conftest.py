"""Fixtures for learner tests: a tiny model, a 2x2 learner mesh and batches built from real
RolloutGroups through `assemble_batch`."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from tunixlike import config as config_lib, models
from tunixlike.learner import batch as batch_lib
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.rollout import Completion, RolloutGroup

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

TINY = models.tiny_config(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8)


@pytest.fixture
def tiny_model():
  def make(seed=0, **overrides):
    return models.Transformer(TINY.replace(**overrides) if overrides else TINY, rngs=nnx.Rngs(seed))
  return make


@pytest.fixture(scope="session")
def mesh4():
  """A 2x2 ('fsdp', 'tensor') learner mesh (Auto axes, as tunixlike.mesh builds them)."""
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))


def make_groups(num_groups, group_size=4, seed=0, vocab=128, version=0, length=lambda rng: int(rng.integers(2, 9))):
  """`length(rng)` draws each completion's number of tokens."""
  rng = np.random.default_rng(seed)
  groups = []
  for gi in range(num_groups):
    prompt = rng.integers(1, vocab, size=rng.integers(2, 5)).astype(np.int32)
    comps = []
    for _ in range(group_size):
      n = length(rng)
      comps.append(Completion(rng.integers(1, vocab, size=n).astype(np.int32),
                              (-4.8 + 0.3 * rng.normal(size=n)).astype(np.float32),
                              np.full(n, version, np.int32), "eos"))
    groups.append(RolloutGroup(prompt_id=gi, prompt_token_ids=prompt, completions=comps,
                               rewards=rng.integers(0, 2, size=group_size).astype(np.float32)))
  return groups


@pytest.fixture
def long_tailed_batch():
  """Completion lengths with a long tail (most 2-9 tokens, one in eight 40-56), padded to 64."""
  def make(num_rows=16, seed=0):
    tail = lambda rng: int(rng.integers(40, 57) if rng.random() < 0.125 else rng.integers(2, 10))
    return batch_lib.assemble_batch(make_groups(num_rows // 4, seed=seed, length=tail), num_rows=num_rows,
                                    seq_buckets=(64,), sampling_mask=False, routing=False, unscored=UNSCORED)
  return make


@pytest.fixture
def host_batch():
  def make(num_rows=8, seed=0, **kw):
    groups = make_groups(num_rows // 4, seed=seed, **kw)
    return batch_lib.assemble_batch(groups, num_rows=num_rows, seq_buckets=(16,), sampling_mask=False, routing=False,
                                    unscored=UNSCORED)
  return make
