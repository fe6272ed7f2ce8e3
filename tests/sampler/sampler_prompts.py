"""Prompts for the sampler tests (a module with a unique name: `conftest` is ambiguous across test folders)."""

import numpy as np

VOCAB = 128


def random_prompts(n, lengths=(1, 3, 7, 12, 5, 16, 9, 2), seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, size=lengths[i % len(lengths)]).astype(np.int32) for i in range(n)]
