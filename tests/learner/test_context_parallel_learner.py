"""optim.context_parallel: each row split along its tokens over 4 CPU devices gives the single-device
learner's loss, gradients and metrics (padded rows and packed shared-prompt rows, the default ring
attention in the zigzag layout; the other schemes and layouts: tests/models/test_context_parallel.py)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import tunixlike
from tunixlike import config as config_lib, mesh as mesh_lib, models
from tunixlike.learner import AlgoConfig, Learner, LearnerConfig, OptimConfig, prompt_rows
from tunixlike.learner.batch import assemble_batch
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.settings import ConfigError

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

# One layer: the row enters the zigzag layout before the layers and leaves it after them whatever their number,
# and each (unrolled) layer's ring attention on the mesh is most of the compilation, forward and backward.
CFG = models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=256)
ALGO = AlgoConfig(loss="ppo_clip", aggregation="seq_mean_token_mean", is_mode="tis", kl_coef=0.1)


def _groups(n, g=3, seed=1):
  """n scored groups of g completions of 10-40 tokens, one of them partly environment tokens."""
  rng = np.random.default_rng(seed)
  groups = []
  for i in range(n):
    comps = []
    for ci in range(g):
      k = int(rng.integers(10, 40))
      mask = (rng.random(k) > 0.3).astype(np.int32) if ci == 1 else None
      comps.append(Completion(rng.integers(1, CFG.vocab_size, size=k).astype(np.int32),
                              (rng.normal(size=k) - 3).astype(np.float32), rng.integers(3, 6, size=k).astype(np.int32),
                              finish_reason="eos", loss_mask=mask))
    group = RolloutGroup(prompt_id=i, prompt_token_ids=rng.integers(1, CFG.vocab_size, size=5).astype(np.int32),
                         completions=comps)
    group.advantages = rng.normal(size=g).astype(np.float32)
    group.shaped_rewards = group.advantages
    groups.append(group)
  return groups


def _step(batch, mesh=None, **optim):
  """(loss, grads, metrics) of one learner step on `batch`, one device (mesh None) or split over `mesh`."""
  if mesh is None:
    model = models.Transformer(CFG, rngs=nnx.Rngs(0))
  else:
    model = models.create_sharded(CFG, mesh, mesh_lib.LEARNER_RULES, seed=0)
  learner = Learner(model, LearnerConfig(algo=ALGO, optim=OptimConfig(**{"learning_rate": 1e-3, **optim})), mesh,
                    mesh_lib.LEARNER_RULES)
  placed = learner.put_batch(batch)
  if mesh is not None:
    assert placed["tokens"].sharding.spec == P(None, None, "fsdp")  # [M, b, T]: T over the 4 devices
  loss, grads = learner.loss_and_grads(learner.state, placed)
  _, metrics = learner.train_step(learner.state, placed, jax.random.key(0))
  return float(loss), jax.device_get(grads), jax.device_get(metrics)


# The learner's own code is the row kind (padded rows; packed shared-prompt rows with their segments and
# prefixes) and the transformer reordering a row into the zigzag layout around its layers; which scheme
# attends and the contiguous layout (no reordering) are the attention's, checked for every mask, scheme
# and layout, output and gradients, in tests/models/test_context_parallel.py.
@pytest.mark.parametrize("row_kind", ["padded", "packed"])
def test_rows_split_along_tokens_train_as_on_one_device(row_kind):
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), mesh_lib.LEARNER_AXES)
  # 9 or 2 rows (not a multiple of the 4 devices), rows of 48 or 200 tokens padded to whole blocks per device
  groups = _groups(3)
  optim = {}
  if row_kind == "padded":
    batch = assemble_batch(groups, num_rows=9, seq_buckets=(48,), sampling_mask=False, routing=False, unscored=UNSCORED)
  else:
    optim = dict(share_prompts=True, pack_tokens=200)
    rows = prompt_rows.pack(groups, 200)
    assert max(map(len, rows)) > 1  # several groups in a row
    batch = prompt_rows.assemble(groups, num_rows=len(rows), seq_buckets=(200,), rows=rows)
  loss_1, grads_1, metrics_1 = _step(batch, **optim)
  loss_n, grads_n, metrics_n = _step(batch, mesh, context_parallel=True, **optim)
  assert loss_n == pytest.approx(loss_1, rel=1e-5, abs=1e-7)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_1), jax.tree.leaves(grads_n)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  for k in metrics_1:
    assert float(metrics_n[k]) == pytest.approx(float(metrics_1[k]), rel=1e-4, abs=1e-6), k


def test_rows_need_not_divide_over_the_devices_when_their_tokens_are_split():
  """configs/long_context_grpo.py: one row (one group) per step on 4 learner devices."""
  cfg = tunixlike.load_config("configs/long_context_grpo.py")
  assert cfg.optim.context_parallel and cfg.rl.prompts_per_step == 1 and cfg.mesh.learner_devices == 4
  with pytest.raises(ConfigError, match="rl.prompts_per_step=1: .* must be divisible by optim.micro_batches"):
    tunixlike.load_config("configs/long_context_grpo.py", {"optim.context_parallel": False})
