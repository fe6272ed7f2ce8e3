"""Activations pinned by logical names: the learner's forward keeps its batch sharded.

On a 4-device FSDP mesh the embedding table is sharded on 'embed' over the batch's own mesh axis;
left to itself the SPMD partitioner shards the looked-up activations on 'embed' for some shapes
(the main job's 16-token batches) and runs every row on every device.
"""

import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunixlike import mesh as mesh_lib, models
from tunixlike.models import sharding as sharding_lib

# The main job's model and batch: 83-symbol vocabulary, hidden 64, 256 rows of 16 tokens.
CFG = models.ModelConfig(vocab_size=83, hidden_size=64, intermediate_size=256, num_heads=4, num_kv_heads=2,
                         head_dim=16, num_layers=2)
ROWS, T = 256, 16


def _forward_hlo(constrained: bool):
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), mesh_lib.LEARNER_AXES)
  model = models.create_sharded(CFG, mesh, mesh_lib.LEARNER_RULES, seed=0)
  graphdef, state = nnx.split(model)

  def hidden(state, tokens):
    return nnx.merge(graphdef, state).hidden_states(tokens)

  if constrained:
    hidden = sharding_lib.traced_under_rules(hidden, mesh, mesh_lib.LEARNER_RULES)
  tokens = jax.device_put(np.ones((ROWS, T), np.int32), NamedSharding(mesh, P("fsdp")))
  fn = jax.jit(hidden)
  return fn.lower(state, tokens).compile().as_text(), fn(state, tokens)


def _whole_batch_collectives(hlo: str) -> list[str]:
  """Collectives whose result holds every row of the batch (each device computing all rows)."""
  return re.findall(rf"= \(?f32\[{ROWS},{T},\d+\].*? (?:all-reduce|all-gather)\(", hlo)


def test_learner_forward_keeps_the_batch_sharded():
  unpinned, h_unpinned = _forward_hlo(constrained=False)
  pinned, h_pinned = _forward_hlo(constrained=True)
  assert not _whole_batch_collectives(pinned)  # (`unpinned` has them with jax 0.10 / XLA of 2026-11)
  np.testing.assert_allclose(np.asarray(h_pinned), np.asarray(h_unpinned), rtol=1e-5, atol=1e-5)


def test_constrain_is_the_identity_outside_activation_rules():
  x = jax.numpy.ones((4, 3))
  assert sharding_lib.constrain(x, ("batch", None)) is x
