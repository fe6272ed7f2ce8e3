"""Keep Routing (routing replay, "R3"): the learner runs the MoE experts the sampler ran.

An MoE router is a discontinuous function: a tiny change of its logits (bf16 vs fp32 numerics,
another kernel, one optimizer step) swaps an expert in or out of a token's top-k, and the token's
log-prob then jumps. The sampler records, per token and per MoE layer, the experts it used
(`Completion.expert_routing`, `Completion.prompt_routing`); the learner forces exactly those
experts (`model.hidden_states(..., routing_btlk=)`), so the behaviour and learner policies differ
only through the gate weights, not through which experts run (Megatron-LM #4168, arXiv 2510.11370).

Which positions are replayed: every position whose forward pass feeds a trained log-prob. The
completion token t is predicted at position P-1+t, which attends the K/V of every earlier
position, so the prompt's routing (from the sampler's prefill) is replayed too. Position t of the
batch's `routing` [B, T, L, k] holds the experts used *at* position t (aligned with `tokens`, like
every batch array); unrecorded positions (the last token of each row, padding) hold -1 and fall
back to the router (`moe.route`): they feed no trained log-prob.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tunixlike.rollout import RolloutGroup


def routing_shape(groups: Sequence[RolloutGroup]) -> tuple[int, int]:
  """(L, k) shared by every completion's recorded routing; errors name the bad completion."""
  lk = None
  for g in groups:
    p = len(g.prompt_token_ids)
    for ci, c in enumerate(g.completions):
      where = f"RolloutGroup(prompt_id={g.prompt_id!r}).completions[{ci}]"
      if c.expert_routing is None or c.prompt_routing is None:
        missing = "expert_routing" if c.expert_routing is None else "prompt_routing"
        raise ValueError(f"{where}.{missing} is None, but the batch asks for routing (algo.keep_routing): the "
                         "sampler must record it (sampler.record_routing=True, an MoE model)")
      for name, arr, n in (("expert_routing", c.expert_routing, c.num_tokens),
                           ("prompt_routing", c.prompt_routing, p - 1)):
        shape = np.shape(arr)
        if len(shape) != 3 or shape[0] != n or not np.issubdtype(np.asarray(arr).dtype, np.integer):
          raise ValueError(f"{where}.{name} has shape {shape} and dtype {np.asarray(arr).dtype}, expected "
                           f"integer [{n}, L, k]")
        lk = shape[1:] if lk is None else lk
        if shape[1:] != lk:
          raise ValueError(f"{where}.{name} has [L, k] = {shape[1:]}, other completions have {lk}")
  return lk or (0, 0)


def fill_row(routing_tlk: np.ndarray, group: RolloutGroup, ci: int) -> None:
  """Writes completion `ci`'s routing into one batch row [T, L, k] (pre-filled with -1).

  Positions [0, P-1) get the prefill's routing; position P-1+t gets the routing of the forward
  that produced completion token t (the last completion token is never an input: it stays -1).
  """
  c = group.completions[ci]
  p = len(group.prompt_token_ids)
  routing_tlk[:p - 1] = c.prompt_routing
  routing_tlk[p - 1:p - 1 + c.num_tokens] = c.expert_routing


def disagreement(router_logits_btlx: jax.Array, recorded_btlk: jax.Array):
  """How often the learner's router would choose other experts than the sampler recorded.

  Returns (layer_frac_bt, any_bt), float32 [B, T]: the fraction of MoE layers at each position
  whose top-k *set* differs from the recorded one, and 1 where at least one layer differs (the
  per-token figure the field reports: 94% of tokens in Qwen3-30B-A3B, arXiv 2510.11370). Under
  replay the router logits are computed on the replayed path, so this is how often replay was
  needed; without replay it is how often the learner really ran other experts (where an earlier
  layer already differed, the later ones see other inputs). Positions with no record (-1) give 0.
  """
  k = recorded_btlk.shape[-1]
  learner_btlk = jax.lax.top_k(router_logits_btlx.astype(jnp.float32), k)[1]
  # Top-k entries are distinct, so the sets are equal iff every recorded expert is among the learner's.
  same_btl = jnp.all(jnp.any(recorded_btlk[..., :, None] == learner_btlk[..., None, :], axis=-1), axis=-1)
  recorded_bt = recorded_btlk[..., 0, 0] >= 0
  differ_btl = (~same_btl) & recorded_bt[..., None]
  return differ_btl.astype(jnp.float32).mean(-1), differ_btl.any(-1).astype(jnp.float32)
