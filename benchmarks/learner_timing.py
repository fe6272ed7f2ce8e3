"""One synthetic RL batch and the learner's timed steps: what learner_step.py, scale.py and
long_context.py all measure. Rows of random tokens whose first `prompt_len` are the prompt (out of
the loss), uniform behaviour log-probs, version 0, random advantages (all ones for one row)."""

from __future__ import annotations

import time

import numpy as np


def synthetic_batch(rng: np.random.Generator, vocab: int, batch: int, seq: int, prompt_len: int) -> dict:
  host = {"tokens": rng.integers(1, vocab, size=(batch, seq)).astype(np.int32),
          "loss_mask": np.zeros((batch, seq), np.float32),
          "behaviour_logprobs": np.full((batch, seq), -np.log(vocab), np.float32),
          "versions": np.zeros((batch, seq), np.int32),
          "advantages": (rng.normal(size=batch) if batch > 1 else np.ones(1)).astype(np.float32)}
  host["loss_mask"][:, prompt_len:] = 1.0
  return host


def timed_steps(learner, batch, steps: int):
  """(state, first_s, times, metrics): one step that compiles, then `steps` timed ones, each waited
  for. The learner's own state is left as it was; the caller keeps the returned one if it wants."""
  import jax
  state = learner.state
  t0 = time.perf_counter()
  state, metrics = learner.train_step(state, batch, jax.random.key(0))
  jax.block_until_ready(metrics)
  first = time.perf_counter() - t0
  times = []
  for i in range(steps):
    t0 = time.perf_counter()
    state, metrics = learner.train_step(state, batch, jax.random.key(i + 1))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  return state, first, times, metrics
