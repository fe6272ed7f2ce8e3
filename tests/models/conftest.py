"""Fixtures for model tests: tiny random HF checkpoints (written once per session) and a 4-device mesh."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from tunixlike.models import testing

# (arch, tie_embeddings): every supported architecture, tied and untied where the family has both.
ARCH_CASES = [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False), ("qwen3", True),
              ("qwen3", False)]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
  """hf_checkpoint(arch, tie, **kw) -> directory of a random transformers checkpoint (cached)."""
  cache = {}

  def make(arch, tie_embeddings, **kw):
    key = (arch, tie_embeddings, tuple(sorted(kw.items())))
    if key not in cache:
      path = tmp_path_factory.mktemp(f"{arch}_{'tied' if tie_embeddings else 'untied'}")
      cache[key] = testing.write_random_hf_checkpoint(path, arch, tie_embeddings, **kw)
    return cache[key]

  return make


@pytest.fixture(scope="session")
def mesh4():
  """A 2x2 ('fsdp', 'tensor') mesh with Auto axes, as tunixlike.mesh builds them."""
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))


@pytest.fixture
def random_batch():
  """random_batch(vocab, lengths, total) -> right-padded int32 tokens [B, total] (pad 0), lengths [B]."""
  def make(vocab, lengths, total, seed=0):
    rng = np.random.RandomState(seed)
    toks = rng.randint(1, vocab, size=(len(lengths), total)).astype(np.int32)
    for b, n in enumerate(lengths):
      toks[b, n:] = 0
    return toks, np.asarray(lengths, np.int32)
  return make
