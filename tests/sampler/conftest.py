"""Tiny model and engine fixtures for the sampler tests."""

import jax
import numpy as np
import pytest
from flax import nnx

from tunixlike import models
from tunixlike.sampler import SamplerConfig, make_engine as build_engine

from sampler_prompts import VOCAB


@pytest.fixture(scope="session")
def tiny_model():
  cfg = models.tiny_config(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, num_layers=2)
  return models.Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def mesh_1x1():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "tensor"))


@pytest.fixture(scope="session")
def mesh_2x2():
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replica", "tensor"))


@pytest.fixture(scope="session")
def make_engine(tiny_model, mesh_1x1):
  """Engines are cached by config so compiled programs are shared across tests."""
  cache = {}

  def make(mesh=None, **kw):
    kw.setdefault("max_prefill_length", 16)
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("max_concurrent_decodes", 4)
    kw.setdefault("steps_per_call", 3)
    kw.setdefault("attend_bucket", 16)
    cfg = SamplerConfig(**kw)
    mesh = mesh or mesh_1x1
    key = (cfg, id(mesh))
    if key not in cache:
      cache[key] = build_engine(tiny_model, cfg, mesh)
    return cache[key]

  return make
