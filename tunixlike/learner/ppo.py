"""PPO with a critic on the learner submesh: policy and value head trained together in one step.

`PPOLearner` is the GRPO-family `Learner` (same state, sharding, micro-batching, decoupled IS
correction, no-recompile step) with two changes:

  1. `prepare(state, batch)` (jitted) runs the critic over the batch once, before the updates:
     the sequence reward goes on the last loss token, an optional per-token KL penalty is folded
     in, and GAE gives per-token advantages and value targets (`gae.py`). These are data for the
     step, like the proximal logprobs: several updates on one batch all use the same targets.
  2. the per-micro-batch loss is the token-level clip loss plus vf_coef * the clipped value loss,
     from one trunk forward pass (`value.PolicyWithValue`).

Batch (from `batch.assemble_batch`, placed with `put_batch`): the GRPO keys plus `rewards` [B];
`prepare` adds `old_values`, `returns`, `token_advantages` [B, T], aligned with `tokens` like every
per-token array (index t describes token t; 0 at t = 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tunixlike.learner import gae as gae_lib, logprobs as logprobs_lib, losses
from tunixlike.learner.config import LearnerConfig
from tunixlike.learner.state import TrainState
from tunixlike.learner.train_step import Learner, _next
from tunixlike.learner.value import PolicyWithValue

ROW_KEYS = ("rewards",)  # [B] extra host columns the PPO step needs on device
PREPARED_KEYS = ("old_values", "returns", "token_advantages")  # [B, T], written by `prepare`


KL_REWARD_ESTIMATOR = "k1"  # the per-token KL estimate folded into the rewards (k1, as in InstructGPT)


def _shift_right(x_bt):
  """Inverse of `_next`: from "index t predicts token t+1" back to "index t describes token t"."""
  return jnp.concatenate([jnp.zeros_like(x_bt[..., :1]), x_bt[..., :-1]], axis=-1)


class PPOLearner(Learner):
  """A `Learner` for `PolicyWithValue`: the policy and its value head share one optimizer and step.
  The critic's settings are the algo section's PPO keys (`cfg.algo`: gamma, gae_lambda, vf_coef,
  vf_clip, kl_reward_coef, whiten_advantages)."""

  def __init__(self, model: PolicyWithValue, cfg: LearnerConfig, mesh: jax.sharding.Mesh | None = None, rules=()):
    if not isinstance(model, PolicyWithValue):
      raise ValueError(f"PPOLearner needs a value.PolicyWithValue model, got {type(model).__name__}")
    if cfg.algo.loss not in gae_lib.TOKEN_LEVEL_LOSSES:
      raise ValueError(f"algo.loss={cfg.algo.loss!r} cannot take per-token (GAE) advantages; choose one of "
                       f"{gae_lib.TOKEN_LEVEL_LOSSES}")
    super().__init__(model, cfg, mesh, rules)
    if self.lora:  # the head's nnx.Param would sit in `frozen` and never train
      raise ValueError("PPO with a value head on the trunk does not support LoRA yet (the value head would be frozen)")
    if cfg.algo.kl_reward_coef > 0 and self.state.ref_params is None:
      # the reference for the reward's KL: a frozen copy of the initial weights, laid out like them
      ref = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.state_shardings.params)(self.state.params)
      self.state = self.state.replace(ref_params=ref)
      self.state_shardings = self.state_shardings.replace(ref_params=self.state_shardings.params)
      self._step = self._jit(self._train_step, donate_argnums=(0,), out_shardings=(self.state_shardings, None))
    self._prepare = self._jit(self._prepare_fn)

  # ------------------------------------------------------------------ batches

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """`Learner.put_batch` plus the PPO columns (`rewards`, and prepared targets if given), placed
    with the same micro-batch split and row sharding as `advantages` / `tokens`."""
    for k in ROW_KEYS:
      if k not in batch:
        raise ValueError(f"batch is missing {k!r} (has {sorted(batch)}); PPO needs the per-completion rewards")
    batch = self.sort_by_length(batch)  # before the PPO columns are read (a no-op when off)
    out = super().put_batch(batch)
    b, t = np.shape(batch["tokens"])
    m = self.cfg.optim.micro_batches
    for k in ROW_KEYS + PREPARED_KEYS:
      if k not in batch:
        continue
      like = out["advantages"] if k in ROW_KEYS else out["tokens"]
      want = (b,) if k in ROW_KEYS else (b, t)
      if tuple(np.shape(batch[k])) != want:
        raise ValueError(f"batch[{k!r}] has shape {np.shape(batch[k])}, expected {want}")
      v = np.asarray(batch[k], np.float32).reshape((m, b // m) + want[1:])
      if self.mesh is None:
        out[k] = jnp.asarray(v)
      elif like.is_fully_addressable:
        out[k] = jax.device_put(v, like.sharding)
      else:  # several processes: `v` is this process's share of the rows, as for the other keys
        out[k] = jax.make_array_from_process_local_data(like.sharding, v, like.shape)
    return out

  # ------------------------------------------------------------------ prepare: critic + GAE

  def _prepare_fn(self, state: TrainState, batch):
    p = self.cfg.algo
    model = nnx.merge(self.graphdef, state.params, state.frozen)

    def one(mb_tokens):  # [b, T] -> values [b, T] (and KL [b, T]) in "index t predicts t+1" alignment
      h_btd = model.hidden_states(mb_tokens)
      values = model.values(h_btd, mb_tokens)
      if p.kl_reward_coef > 0:
        logp, _ = logprobs_lib.chunked_token_logprobs(h_btd, _next(mb_tokens), model.unembed,
                                                      self.cfg.logprob_chunk_size, with_entropy=False)
        return values, logp, self._ref_logprobs(state, state.params, mb_tokens)
      return values, values, values  # placeholders, unused

    values, logp, ref_logp = jax.lax.map(one, batch["tokens"])  # [M, b, T]
    m, b, t = values.shape
    flat = lambda x: x.reshape(m * b, t)
    mask = flat(_next(batch["loss_mask"]).astype(jnp.float32))
    rewards = gae_lib.scores_to_token_rewards(batch["rewards"].reshape(m * b), mask)
    stats = {}
    n_tokens = jnp.maximum(mask.sum(), 1.0)
    if p.kl_reward_coef > 0:
      rewards, kl_bt = gae_lib.kl_penalized_rewards(rewards, flat(logp), flat(ref_logp), mask,
                                                    kl_coef=p.kl_reward_coef, estimator=KL_REWARD_ESTIMATOR)
      stats["kl_reward"] = kl_bt.sum() / n_tokens
    adv, returns = gae_lib.gae(rewards, flat(values), mask, gamma=p.gamma, gae_lambda=p.gae_lambda)
    stats["value_mean"] = (flat(values) * mask).sum() / n_tokens
    stats["return_mean"] = returns.sum() / n_tokens
    if p.whiten_advantages:
      adv = gae_lib.masked_whiten(adv, mask)
    out = dict(batch)
    for k, x in (("old_values", flat(values) * mask), ("returns", returns), ("token_advantages", adv)):
      out[k] = _shift_right(x).reshape(m, b, t)
      if self.mesh is not None:  # rows sharded like `tokens`, so the step sees one input layout
        out[k] = jax.lax.with_sharding_constraint(out[k], NamedSharding(self.mesh, P(None, self.cfg.batch_axis, None)))
    return out, stats

  def prepare(self, state: TrainState, batch: dict[str, jax.Array]):
    """(batch with old_values / returns / token_advantages, stats). Call once per batch, before its
    updates; the stats (value_mean, return_mean, kl_reward) stay on device."""
    return self._prepare(state, batch)

  # ------------------------------------------------------------------ the loss

  def _micro_loss(self, params, state: TrainState, mb, denom):
    a = self.cfg.algo
    mask = _next(mb["loss_mask"]).astype(jnp.float32)
    behav = _next(mb["behaviour_logprobs"]).astype(jnp.float32)
    model = nnx.merge(self.graphdef, params, state.frozen)
    h_btd = model.hidden_states(mb["tokens"])  # one trunk pass for the policy and the critic
    logp, entropy = logprobs_lib.chunked_token_logprobs(h_btd, _next(mb["tokens"]), model.unembed,
                                                        self.cfg.logprob_chunk_size, with_entropy=True)
    values = model.values(h_btd, mb["tokens"])
    old, is_w, stats = self._off_policy(logp, behav, mask, mb)
    adv = _next(mb["token_advantages"])
    pg_bt, loss_stats = gae_lib.token_policy_loss(a.loss, logp, old, adv, mask, eps_low=a.eps_low_value,
                                                  eps_high=a.eps_high_value, is_weights_bt=is_w)
    vf_bt, vf_stats = gae_lib.value_loss(values, _next(mb["old_values"]), _next(mb["returns"]), mask,
                                         clip_eps=a.vf_clip or None)  # algo.vf_clip=0: off
    stats.update(clip_frac=loss_stats["clip_frac"], entropy=entropy, vf_loss=vf_bt,
                 vf_clip_frac=vf_stats["vf_clip_frac"], token_advantage_abs=jnp.abs(adv))
    loss_bt = pg_bt + a.vf_coef * vf_bt
    tw = losses.token_weights(mask, a.resolved_aggregation, a.norm_length)
    sums = {"pg_loss": (pg_bt * tw).sum() / denom}
    if a.kl_coef > 0:
      kl_bt = self.kl_fn(logp, self._ref_logprobs(state, params, mb["tokens"]))
      loss_bt = loss_bt + a.kl_coef * kl_bt
      stats["kl"] = kl_bt
    loss = (loss_bt * tw).sum() / denom
    for k, v in stats.items():
      v = jax.lax.stop_gradient(v)
      sums[k] = jnp.where(mask > 0, v, -jnp.inf).max() if k.endswith("_max") else (v * mask).sum()
    assert set(sums) == set(self._stat_keys()), (sorted(sums), self._stat_keys())
    return loss, sums

  def _stat_keys(self) -> tuple[str, ...]:
    return super()._stat_keys() + ("vf_loss", "vf_clip_frac", "token_advantage_abs")

  # ------------------------------------------------------------------ public

  def needs_prepare(self, batch) -> bool:
    """True when `batch` has none of the prepared targets; an error when it has only some."""
    present = [k for k in PREPARED_KEYS if k in batch]
    if present and len(present) < len(PREPARED_KEYS):
      raise ValueError(f"batch has {present} but not all of {PREPARED_KEYS}: pass the whole output of "
                       "PPOLearner.prepare (or none of it)")
    return not present

  def prepare_batch(self, state: TrainState, batch: dict[str, jax.Array]):
    """The train step's batch: one without the prepared targets is prepared first from `state` (one
    update per batch, the runtime's default); for several updates on one batch, `prepare` once and
    pass the result each time. The step's metrics then add vf_loss (token mean of the clipped
    1/2 (V - R)^2), vf_clip_frac, token_advantage_abs and, when prepared here, value_mean /
    return_mean (/ kl_reward)."""
    if self.needs_prepare(batch):
      return self.prepare(state, batch)
    return batch, {}

  def policy(self, state: TrainState) -> nnx.Module:
    """The policy alone (for weight sync to the sampler, eval and export)."""
    return self.model(state).policy
