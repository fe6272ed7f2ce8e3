import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunixlike import config as config_lib
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.train_step import Learner
from tunixlike.models import lora

RUN = config_lib.Config()  # the lora section at its defaults


@pytest.mark.slow
def test_lora_trains_only_adapters_with_base_as_reference(tiny_model, host_batch):
  model = lora.apply_lora(tiny_model(), lora.LoRAConfig.from_config(RUN, rank=4, alpha=8.0), seed=0)
  cfg = LearnerConfig(algo=AlgoConfig(kl_coef=0.1), optim=OptimConfig(learning_rate=1e-2), logprob_chunk_size=8)
  learner = Learner(model, cfg)
  state = learner.state
  assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(state.params))
  assert state.ref_params is None  # no second copy: the reference is the base with adapters off
  n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert n_opt <= 2 * n_adapter + 8  # Adam moments for the adapters only (plus step counters)
  base_before = jax.tree.map(np.asarray, jax.device_get(state.frozen))

  db = learner.put_batch(host_batch(8))
  state, m0 = learner.train_step(state, db, jax.random.key(0))
  assert float(m0["kl"]) == 0.0  # B = 0: the policy is exactly the reference
  for _ in range(2):
    state, m = learner.train_step(state, db, jax.random.key(0))
  assert float(m["kl"]) > 0.0
  after = jax.device_get(state.frozen)
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  # both A and B moved (A gets gradient once B is non-zero)
  adapters = nnx.to_flat_state(state.params)
  assert all(float(jnp.abs(v.get_value()).max()) > 0 for p, v in adapters if p[-1] == "lora_b")

  # adapter-only weight sync: the sampler's copy changes and then matches the learner
  sampler_model = lora.apply_lora(tiny_model(), lora.LoRAConfig.from_config(RUN, rank=4, alpha=8.0), seed=0)
  tokens = jnp.asarray(np.asarray(db["tokens"]).reshape(8, -1))
  trained = learner.model(state)
  before = sampler_model(tokens)
  lora.load_adapter_params(sampler_model, lora.adapter_params(trained))
  after = sampler_model(tokens)
  assert float(jnp.abs(after - before).max()) > 1e-5
  np.testing.assert_allclose(after, trained(tokens), rtol=1e-6, atol=1e-6)
