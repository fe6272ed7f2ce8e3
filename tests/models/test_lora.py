import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from tunixlike import config as config_lib
from tunixlike import models
from tunixlike.models import lora

RUN = config_lib.Config()  # the lora section at its defaults

CFG = models.tiny_config(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 128, size=(2, 7)), jnp.int32)


def _model(seed=0, **kw):
  return models.Transformer(CFG.replace(**kw) if kw else CFG, rngs=nnx.Rngs(seed))


def _randomise_b(model, seed=1):
  """Give every B a non-zero value (a trained adapter)."""
  adapters = lora.adapter_params(model)
  keys = iter(jax.random.split(jax.random.key(seed), 100))
  nnx.update(model, jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapters))


def test_zero_b_gives_exactly_the_base_logits():
  model = _model()
  base = model(TOKENS)
  lora.apply_lora(model, lora.LoRAConfig.from_config(RUN, rank=4, alpha=8.0), seed=0)
  assert isinstance(model.layers[0].attn.q_proj, lora.LoRALinear)
  assert isinstance(model.layers[1].mlp.down_proj, nnx.Linear)  # still a Linear (HF mapping, type checks)
  np.testing.assert_array_equal(model(TOKENS), base)
  _randomise_b(model)
  assert float(jnp.abs(model(TOKENS) - base).max()) > 1e-4


def test_paths_of_base_weights_are_unchanged_and_only_adapters_are_lora_params():
  model = _model()
  before = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  lora.apply_lora(model, lora.LoRAConfig.from_config(RUN, rank=2, targets=("q_proj", "v_proj")), seed=0)
  base_paths = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))}
  assert base_paths == before
  adapter_paths = sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(lora.adapter_params(model)))
  assert len(adapter_paths) == CFG.num_layers * 2 * 2  # layers x (q, v) x (A, B)
  assert "layers/0/attn/q_proj/lora/lora_a" in adapter_paths


def test_target_matching_no_module_names_the_key():
  with pytest.raises(ValueError, match=r"lora.targets entry 'qproj' matches no projection.*'q_proj'"):
    lora.apply_lora(_model(), lora.LoRAConfig.from_config(RUN, rank=2, targets=("q_proj", "qproj")), seed=0)
  with pytest.raises(ValueError, match="lora.rank=0"):
    lora.LoRAConfig.from_config(RUN, rank=0)


def test_adapter_payload_moves_to_another_copy():
  learner_model = lora.apply_lora(_model(), lora.LoRAConfig.from_config(RUN, rank=4), seed=0)
  sampler_model = lora.apply_lora(_model(), lora.LoRAConfig.from_config(RUN, rank=4), seed=5)
  _randomise_b(learner_model)
  assert float(jnp.abs(sampler_model(TOKENS) - learner_model(TOKENS)).max()) > 1e-4
  payload = lora.adapter_params(learner_model)
  assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(payload))
  lora.load_adapter_params(sampler_model, payload)
  np.testing.assert_array_equal(sampler_model(TOKENS), learner_model(TOKENS))
  other = lora.apply_lora(_model(), lora.LoRAConfig.from_config(RUN, rank=4, targets=("q_proj",)), seed=0)
  with pytest.raises(ValueError, match="payload and model adapters differ"):
    lora.load_adapter_params(other, payload)


def test_merge_folds_adapters_into_the_base():
  model = lora.apply_lora(_model(tie_embeddings=False),
                          lora.LoRAConfig.from_config(RUN, rank=4, targets=("q_proj", "down_proj")), seed=0)
  _randomise_b(model)
  merged = lora.merge_lora(model)
  np.testing.assert_allclose(merged(TOKENS), model(TOKENS), rtol=1e-4, atol=1e-5)
  assert not lora.has_lora(merged) and lora.has_lora(model)
  assert type(merged.layers[0].attn.q_proj) is nnx.Linear
  plain_paths = {p for p, _ in nnx.to_flat_state(nnx.state(_model(tie_embeddings=False)))}
  assert {p for p, _ in nnx.to_flat_state(nnx.state(merged))} == plain_paths


def test_adapters_are_replicated_beside_sharded_kernels():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
  rules = (("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
  model = models.create_sharded(CFG, mesh, rules, seed=0)
  lora.apply_lora(model, lora.LoRAConfig.from_config(RUN, rank=4), mesh=mesh, rules=rules, seed=0)
  q = model.layers[0].attn.q_proj
  assert q.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert q.lora.lora_a.get_value().sharding.is_fully_replicated
  assert q.lora.lora_b.get_value().sharding.is_fully_replicated
  assert model(TOKENS).shape == (2, 7, 128)
