"""A tiny model over a character tokenizer, and engines (the scripted environment is in scripted_env.py)."""

import jax
import numpy as np
import pytest
from flax import nnx

from tunixlike import models
from tunixlike.data import char_tokenizer
from tunixlike.sampler import SamplerConfig, make_engine as build_engine

CHARS = char_tokenizer.DEFAULT_CHARS + '<>_{}"'


@pytest.fixture(scope="session")
def tokenizer():
  return char_tokenizer.build(CHARS)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
  cfg = models.tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=32, num_heads=4, num_kv_heads=2,
                           head_dim=8, intermediate_size=64, num_layers=2)
  return models.Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def make_engine(tiny_model):
  """Engines cached by config so the compiled programs are shared across tests."""
  cache = {}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "tensor"))

  def make(**kw):
    kw.setdefault("max_prefill_length", 64)
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("max_concurrent_decodes", 4)
    kw.setdefault("steps_per_call", 2)
    kw.setdefault("attend_bucket", 32)
    kw.setdefault("min_prefill_bucket", 32)
    kw.setdefault("eos_ids", (2,))
    cfg = SamplerConfig(**kw)
    if cfg not in cache:
      cache[cfg] = build_engine(tiny_model, cfg, mesh)
    return cache[cfg]

  return make
