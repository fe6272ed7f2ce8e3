"""Mixture-of-experts MLP (Qwen3-MoE / Mixtral): top-k router, SwiGLU experts, load-balancing loss.

Routing can be *returned* (the experts each token chose, per MoE layer) and *forced* (use given
experts instead of the router's top-k: "Keep Routing" / routing replay, so the learner runs the
exact experts the sampler ran). Under forcing the gate weights are still the router's softmax at
the forced experts, so the router keeps receiving gradients.

Gate weights are computed from the k chosen logits alone when `norm_topk_prob` (softmax over
the chosen logits equals HF's `p_i / sum_chosen p_j` exactly in real arithmetic); so a router change
that only moves unchosen logits leaves a forced layer bit-for-bit unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tunixlike.models.config import ModelConfig


def _param(cfg: ModelConfig, shape, axes, rngs: nnx.Rngs) -> nnx.Param:
  init = nnx.with_partitioning(nnx.initializers.normal(cfg.init_std), axes, eager_sharding=False)
  return nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoeAux:
  """What the MoE layers did in one forward pass (L = number of MoE layers; 0 for dense models).

  routing_btlk: int32 [B, T, L, k], experts each token used (the router's top-k, or the forced ones).
  router_logits_btlx: float32 [B, T, L, X], the router logits (for the load-balancing loss, metrics).
  """

  routing_btlk: jax.Array
  router_logits_btlx: jax.Array


def route(logits_nx: jax.Array, top_k: int, norm_topk_prob: bool, forced_nk: jax.Array | None = None):
  """(experts [N, k] int32, gate weights [N, k] float32) from router logits [N, X] (fp32).

  forced_nk: experts to use instead of the top-k (distinct, in [0, X)); a row whose first entry is
  negative falls back to the router's own top-k (e.g. positions the sampler did not record).
  """
  logits_nx = logits_nx.astype(jnp.float32)
  experts_nk = jax.lax.top_k(logits_nx, top_k)[1].astype(jnp.int32)  # softmax is monotone: same order
  if forced_nk is not None:
    forced_nk = jnp.asarray(forced_nk, jnp.int32)
    experts_nk = jnp.where(forced_nk[:, :1] >= 0, forced_nk, experts_nk)
  chosen_nk = jnp.take_along_axis(logits_nx, experts_nk, axis=-1)
  if norm_topk_prob:
    gates_nk = jax.nn.softmax(chosen_nk, axis=-1)
  else:
    gates_nk = jnp.exp(chosen_nk - jax.nn.logsumexp(logits_nx, axis=-1, keepdims=True))
  return experts_nk, gates_nk


class Router(nnx.Module):
  """Linear router [E] -> [X]; logits in fp32 (routing decisions should not depend on bf16 rounding)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.kernel = _param(cfg, (cfg.hidden_size, cfg.num_experts), ("embed", "expert"), rngs)

  def __call__(self, x_ne):
    return jnp.einsum("ne,ex->nx", x_ne.astype(jnp.float32), self.kernel[...].astype(jnp.float32))


class Experts(nnx.Module):
  """X SwiGLU MLPs stacked on a leading 'expert' axis; kernels are [in, out] per expert."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    x, e, m = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    self.gate_proj = _param(cfg, (x, e, m), ("expert", "embed", "mlp"), rngs)  # [X, E, M]
    self.up_proj = _param(cfg, (x, e, m), ("expert", "embed", "mlp"), rngs)  # [X, E, M]
    self.down_proj = _param(cfg, (x, m, e), ("expert", "mlp", "embed"), rngs)  # [X, M, E]

  def __call__(self, x_ne, combine_nx):
    """sum_x combine[n, x] * expert_x(x[n]) -> [N, E].

    Dense dispatch: every expert runs on every token and the combine weights (zero outside each
    token's k experts) pick the result. That is X/k times the needed FLOPs, fine for tiny models
    and simple to shard (the 'expert' axis of the weights and of the [N, X, M] activations maps to
    a mesh axis and GSPMD inserts the reduction). Large models want token dispatch instead
    (sort by expert + `jax.lax.ragged_dot`, or capacity-based all-to-all) behind this signature.
    """
    dt = x_ne.dtype
    g = jnp.einsum("ne,xem->nxm", x_ne, self.gate_proj[...].astype(dt))
    u = jnp.einsum("ne,xem->nxm", x_ne, self.up_proj[...].astype(dt))
    y_nxe = jnp.einsum("nxm,xme->nxe", jax.nn.silu(g) * u, self.down_proj[...].astype(dt))
    return jnp.einsum("nx,nxe->ne", combine_nx.astype(dt), y_nxe)


class MoeMLP(nnx.Module):
  """Drop-in for the dense MLP; `mlp.gate` and `mlp.experts` match HF Qwen3-MoE module names."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.gate = Router(cfg, rngs)
    self.experts = Experts(cfg, rngs)

  def __call__(self, x, forced=None):
    """x [..., E]; forced [..., k] or None -> (out [..., E], experts [..., k] int32, logits [..., X] fp32)."""
    cfg = self.cfg
    lead = x.shape[:-1]
    x_ne = x.reshape(-1, cfg.hidden_size)
    logits_nx = self.gate(x_ne)
    forced_nk = None if forced is None else forced.reshape(-1, cfg.num_experts_per_tok)
    experts_nk, gates_nk = route(logits_nx, cfg.num_experts_per_tok, cfg.norm_topk_prob, forced_nk)
    # One-hot scatter of the k gates into [N, X]; adding exact zeros keeps it order-independent.
    combine_nx = jnp.einsum("nkx,nk->nx", jax.nn.one_hot(experts_nk, cfg.num_experts, dtype=jnp.float32),
                            gates_nk)
    out = self.experts(x_ne, combine_nx).reshape(x.shape)
    return out, experts_nk.reshape(*lead, -1), logits_nx.reshape(*lead, -1)


def check_routing(routing, cfg: ModelConfig, lead_shape: tuple, what: str):
  """Validates the static shape of a forced routing array: lead_shape + [L, k]."""
  if not cfg.is_moe:
    raise ValueError(f"{what}: forced routing given but the model is dense (num_experts=0)")
  want = tuple(lead_shape) + (cfg.num_layers, cfg.num_experts_per_tok)
  if tuple(routing.shape) != want:
    raise ValueError(f"{what}: routing has shape {tuple(routing.shape)}, expected {want} "
                     "([batch..., num_layers, num_experts_per_tok])")
  if not jnp.issubdtype(routing.dtype, jnp.integer):
    raise ValueError(f"{what}: routing has dtype {routing.dtype}, expected an integer dtype")


def load_balancing_loss(aux: MoeAux, num_experts: int, mask_bt=None) -> jax.Array:
  """Switch-Transformer / Mixtral load-balancing loss over all MoE layers (as transformers computes it).

    loss = X * sum_x f_x * P_x,
    f_x = share of (token, layer, slot) assignments that went to expert x (sums to k),
    P_x = mean router probability of expert x over (token, layer),
  averaged over real tokens (mask_bt [B, T], 1 = real; None = all). Multiply by
  `cfg.router_aux_loss_coef` and add to the training loss. Uses the experts actually run (the
  forced ones under Keep Routing). Zero for dense models. Switch Transformer, arXiv 2101.03961, eq. 4-6.
  """
  b, t, n_layers, _ = aux.routing_btlk.shape
  if n_layers == 0:
    return jnp.zeros((), jnp.float32)
  w_bt = jnp.ones((b, t), jnp.float32) if mask_bt is None else jnp.asarray(mask_bt, jnp.float32)
  rows = jnp.maximum(w_bt.sum() * n_layers, 1.0)
  counts_x = jnp.einsum("btlkx,bt->x", jax.nn.one_hot(aux.routing_btlk, num_experts, dtype=jnp.float32), w_bt)
  probs_x = jnp.einsum("btlx,bt->x", jax.nn.softmax(aux.router_logits_btlx.astype(jnp.float32), axis=-1), w_bt)
  return num_experts * jnp.sum((counts_x / rows) * (probs_x / rows))
