"""A tiny model over a character tokenizer, engines, and a scripted environment with real latency."""

import time

import jax
import numpy as np
import pytest
from flax import nnx

from tunixlike import models
from tunixlike.data import char_tokenizer
from tunixlike.rewards.envs import Env, StepResult
from tunixlike.sampler import Engine, SamplerConfig

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
      cache[cfg] = Engine(tiny_model, cfg, mesh)
    return cache[cfg]

  return make


class ScriptedEnv(Env):
  """A scripted tool: each step sleeps `latency_s` (record column), then answers `obs<n>.` until
  `turns` policy turns are done. Step rewards are 0.25 per answered turn and 1.0 at the end.

  `probe()` (e.g. the driver's generate-call count) is read before and after the sleep, so a test
  can see what the decode loop did while this tool was busy. `fail` = "raise" / "garbage" makes
  step misbehave like a buggy environment.
  """

  def __init__(self, probe=lambda: 0):
    self.probe, self.n, self.log = probe, 0, []

  def reset(self, record):
    self.record = record
    return record.get("intro", "")

  def step(self, action):
    self.n += 1
    before = self.probe()
    time.sleep(self.record.get("latency_s", 0.0))
    during = self.probe() - before
    self.log.append(dict(action=action, during=during))
    fail = self.record.get("fail")
    if fail == "raise":
      raise RuntimeError("scripted tool crashed")
    if fail == "garbage":
      return {"observation": "not a StepResult"}
    if self.n >= self.record["turns"]:
      return StepResult(None, 1.0, True, {"calls_during_step": during})
    return StepResult(f" obs{self.n}.", 0.25, False, {"calls_during_step": during})
