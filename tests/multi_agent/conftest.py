"""Two policies for multi-agent tests: the envs tests' tiny model, and a second one with other weights."""

import jax
import numpy as np
import pytest
from flax import nnx

from tunixlike import models
from tunixlike.data import char_tokenizer
from tunixlike.sampler import RolloutDriver, SamplerConfig, make_engine


@pytest.fixture(scope="session")
def tokenizer():
  return char_tokenizer.build()


@pytest.fixture(scope="session")
def policy_engines(tokenizer):
  """{"a": engine, "b": engine}: two models of one shape with different weights (seeds 0 and 1)."""
  cfg = models.tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=32, num_heads=4, num_kv_heads=2,
                           head_dim=8, intermediate_size=64, num_layers=2)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "tensor"))
  sampler = dict(max_prefill_length=32, max_new_tokens=6, max_concurrent_decodes=4, steps_per_call=2,
                 attend_bucket=32, min_prefill_bucket=16, eos_ids=(2,), temperature=1.0)
  return {"a": make_engine(models.Transformer(cfg, rngs=nnx.Rngs(0)), SamplerConfig(group_size=1, **sampler), mesh),
          "b": make_engine(models.Transformer(cfg, rngs=nnx.Rngs(1)), SamplerConfig(group_size=2, **sampler), mesh)}


@pytest.fixture
def make_drivers(policy_engines, tokenizer):
  """Driver factories for EpisodeCoordinator, each policy at version 0 with its own weights."""
  params = {p: e.load_params() for p, e in policy_engines.items()}

  def factory(policy):
    return lambda source, sink: RolloutDriver(policy_engines[policy], params[policy], source=source, sink=sink,
                                              detokenize=tokenizer.decode)

  return {p: factory(p) for p in policy_engines}, params
