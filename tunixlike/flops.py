"""Model FLOPs per trained token and a measured matmul peak: the two halves of an MFU figure.

model FLOPs per token = 6 * N_matmul + 12 * L * (H * D_head) * T (PaLM, arXiv 2204.02311, app. B):
N_matmul counts every weight used in a matmul (a tied embedding once, as the unembedding); the
attention term counts QK^T and AV over the full T (the causal half is not subtracted). Work a step
does beyond that (softmax / entropy over V, norms, recomputed log-probs, the optimizer) is not
counted, so an MFU from it is a lower bound of hardware utilisation.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunixlike.models.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
  """Weights used in a matmul per token (dense models: every expert counts only if it is routed to)."""
  d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size
  return cfg.num_layers * per_layer + cfg.vocab_size * d


def train_flops_per_token(cfg: ModelConfig, seq: int) -> float:
  """Forward + backward model FLOPs per token of a `seq`-token row."""
  return 6.0 * matmul_params(cfg) + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq


def _best_time(fn, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def peak_matmul_flops(devices, n: int = 4096, dtype=jnp.float32, repeats: int = 5) -> dict:
  """FLOP/s of an [n, n] @ [n, n] matmul of `dtype`: on one device, and one per device at once
  (batched over a mesh of `devices`); 'peak' is the larger. Random data (zeros run faster on GPUs)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), dtype)
  mm = jax.jit(lambda x, y: x @ y)
  a = jax.device_put(a, devices[0])
  jax.block_until_ready(mm(a, a))
  out = {"single_device": 2 * n**3 / _best_time(lambda: mm(a, a), repeats), "n": n, "dtype": jnp.dtype(dtype).name}
  if len(devices) > 1:
    mesh = Mesh(np.array(devices), ("d",))
    ab = jax.device_put(jnp.broadcast_to(a, (len(devices), n, n)), NamedSharding(mesh, P("d")))
    bmm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x))
    jax.block_until_ready(bmm(ab))
    out["all_devices"] = len(devices) * 2 * n**3 / _best_time(lambda: bmm(ab), repeats)
  out["peak"] = max(out.get("all_devices", 0.0), out["single_device"])
  return out
