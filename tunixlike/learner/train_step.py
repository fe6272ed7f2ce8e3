"""The sharded train step: `(state, batch, rng) -> (state, metrics)`, one pure jitted function.

A batch from `batch.assemble_batch` (a row per completion) or `prompt_rows.assemble` (a row per
group: `optim.share_prompts`) is split into `optim.micro_batches` micro-batches on the host
(`Learner.put_batch`: leaves become [M, B/M, ...], rows sharded over the learner mesh's batch
axis). The step scans over them, summing gradients that are each already divided by the *whole*
batch's normaliser (token count or row count), so accumulation is exact, not a mean of means.

With `optim.group_by_length=N` the host sorts the rows by length first, and each micro-batch runs at
the shortest of N prefix lengths (`prefix_lengths`) that holds its rows (`lax.switch` over N branches
of the one compiled step). Attention is causal and positions past a row's last loss token carry no
loss, so the trimmed step is the padded one; a long tail then pads one micro-batch, not all of them
(verl's dynamic batch size and TRL's padding-free training save the same work).

Per-token log-probs come from `model.hidden_states` + a chunked `model.unembed`
(`logprobs.chunked_token_logprobs`): the [B, T, V] logits never exist at once.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tunixlike import distributed
from tunixlike.learner import is_correction, kl as kl_lib, logprobs as logprobs_lib, losses, optimizer
from tunixlike.learner import gae as gae_lib
from tunixlike.learner import prompt_rows
from tunixlike.learner import routing as routing_lib
from tunixlike.learner.config import LearnerConfig
from tunixlike.learner.state import TrainState
from tunixlike.models import context_parallel
from tunixlike.models import lora as lora_lib
from tunixlike.models import sharding as sharding_lib

BATCH_KEYS = ("tokens", "loss_mask", "behaviour_logprobs", "versions", "advantages")
# token_advantages (optional, process rewards / distillation): the loss then takes A_t per token.
TOKEN_KEYS = ("tokens", "loss_mask", "behaviour_logprobs", "versions", "proximal_logprobs", "token_advantages",
              *prompt_rows.LAYOUT_KEYS)
# Per-token rows [B, T, ...]: packed bits [B, T, W] ("Keep Sampling Mask"), experts [B, T, L, k] ("Keep Routing").
PACKED_TOKEN_KEYS = ("sampling_mask", "routing")
# Reported whenever the batch carries the sampler's routing (replayed or not), see routing.disagreement.
ROUTING_STAT_KEYS = ("routing_disagreement", "routing_token_disagreement")


def prefix_lengths(t: int, n: int) -> tuple[int, ...]:
  """The N lengths ceil(T * k / N), k = 1..N, that `optim.group_by_length` trims micro-batches to."""
  return tuple(sorted({-(-t * k // n) for k in range(1, n + 1)}))


def row_lengths(loss_mask_bt: np.ndarray) -> np.ndarray:
  """Per row, one past its last loss token (0 for a row without any): the prefix its loss needs."""
  mask = np.asarray(loss_mask_bt) > 0
  return np.where(mask.any(axis=1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1), 0)


def _next(x_bt, fill=0):
  """Shift a per-token array so index t describes token t+1 (the one position t predicts)."""
  pad = jnp.full(x_bt.shape[:-1] + (1,), fill, x_bt.dtype)
  return jnp.concatenate([x_bt[..., 1:], pad], axis=-1)


def _layout(mb):
  """A shared-prompt batch's (`prompt_rows`) positions, segments and predictor; None for padded rows."""
  return {k: mb[k] for k in prompt_rows.LAYOUT_KEYS} if "segments" in mb else None


def _next_segments(batch):
  """The segment of the token each position predicts (shared-prompt rows), or None."""
  return _next(batch["segments"], -1) if "segments" in batch else None


def _next_rows(x_btw):
  """`_next` for per-token rows [B, T, W]: the last position gets an all-zero row."""
  return jnp.concatenate([x_btw[:, 1:], jnp.zeros_like(x_btw[:, :1])], axis=1)


class Learner:
  """Owns the GraphDef, optimizer and compiled step for one model on the learner mesh.

  `model` should already be placed (e.g. `models.create_sharded(cfg, mesh, LEARNER_RULES)`,
  `models.lora.apply_lora(...)` for LoRA). With mesh=None everything lives on one device.
  """

  def __init__(self, model: nnx.Module, cfg: LearnerConfig, mesh: jax.sharding.Mesh | None = None, rules=()):
    self.cfg = cfg
    self.mesh = mesh
    self.rules = tuple(rules)
    # optim.context_parallel: each row's tokens split over the batch axis (activation rule 'length')
    self.context_parallel = cfg.optim.context_parallel and mesh is not None
    if self.context_parallel:
      self.rules = context_parallel.sequence_rules(self.rules, cfg.batch_axis)
    self.lora = lora_lib.has_lora(model)
    self.trainable = nnx.LoRAParam if self.lora else nnx.Param
    self.graphdef, params, frozen = nnx.split(model, self.trainable, ...)
    self.tx = optimizer.make_optimizer(cfg.optim)
    self.schedule = optimizer.make_schedule(cfg.optim)
    self.loss = losses.get_policy_loss(cfg.algo.loss)
    self.kl_fn = kl_lib.get_kl_fn(cfg.algo.kl_estimator)
    if mesh is not None and cfg.batch_axis not in mesh.shape:
      raise ValueError(f"LearnerConfig.batch_axis={cfg.batch_axis!r} is not an axis of the learner mesh {dict(mesh.shape)}")
    # The initial TrainState. `train_step` donates its input: carry on with the state it returns.
    self.state = self._init_state(params, frozen)
    self._step = self._jit(self._train_step, donate_argnums=(0,), out_shardings=(self.state_shardings, None))
    self._logprobs = self._jit(self._token_logprobs)
    self._grads = self._jit(lambda state, batch: self._accumulate(state, batch)[:2])

  def _jit(self, fn, **kwargs):
    """jax.jit of `fn` traced with the model's activations pinned to the learner mesh's rules."""
    return jax.jit(sharding_lib.traced_under_rules(fn, self.mesh, self.rules), **kwargs)

  # ------------------------------------------------------------------ state

  def _init_state(self, params, frozen) -> TrainState:
    need_ref_copy = self.cfg.algo.kl_coef > 0 and not self.lora
    if self.mesh is not None:  # place by the logical-axis rules (a no-op for a model born sharded)
      p_shard = sharding_lib.state_shardings(params, self.mesh, self.rules)
      params = jax.device_put(params, p_shard)
      frozen = jax.device_put(frozen, sharding_lib.state_shardings(frozen, self.mesh, self.rules))
    else:
      p_shard = jax.tree.map(lambda x: x.sharding, params)

    def init(params):
      ref = jax.tree.map(jnp.copy, params) if need_ref_copy else None
      return params, self.tx.init(params), ref

    # Params stay where they were born; optimizer moments (and the reference copy) are created in
    # place with their parameter's layout; scalars (step counts) are replicated.
    replicated = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if self.mesh is None
                  else NamedSharding(self.mesh, P()))
    opt_shard = optax.tree_map_params(self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, params), p_shard,
                                      transform_non_params=lambda _: replicated)
    out_shardings = (p_shard, opt_shard, p_shard if need_ref_copy else None)
    params, opt_state, ref = jax.jit(init, out_shardings=out_shardings)(params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, frozen=frozen,
                       ref_params=ref)
    # Commit every leaf (uncommitted ones replicated) so the step's inputs and outputs have the
    # same shardings and the second call hits the compilation cache.
    shardings = jax.tree.map(lambda x: x.sharding if getattr(x, "committed", False) else replicated, state)
    self.state_shardings = shardings
    return jax.device_put(state, shardings)

  def model(self, state: TrainState) -> nnx.Module:
    """The policy as an nnx Module (shares the state's arrays: for weight sync, eval, export)."""
    return nnx.merge(self.graphdef, state.params, state.frozen)

  # ------------------------------------------------------------------ batches

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Checks a host batch, splits it into [M, B/M, ...] micro-batches and places it on the mesh.

    When the learner mesh spans several processes, `batch` is this process's share of the rows
    (every process passes the same number of rows and the same T): the global batch is assembled
    from every process's share with `jax.make_array_from_process_local_data`, so each micro-batch
    holds rows of every process and the rows are sharded over the batch axis.
    """
    for k in BATCH_KEYS:
      if k not in batch:
        raise ValueError(f"batch is missing {k!r} (has {sorted(batch)})")
    batch = self.sort_by_length(batch)
    b, t = np.shape(batch["tokens"])
    for k, v in batch.items():
      want = (b, t) if k in TOKEN_KEYS else (b,)
      if k in PACKED_TOKEN_KEYS:
        want = (b, t) + (tuple(np.shape(v)[2:]) if np.ndim(v) >= 3 else ("...",))
      if k in TOKEN_KEYS or k in BATCH_KEYS or k in PACKED_TOKEN_KEYS:
        if tuple(np.shape(v)) != want:
          raise ValueError(f"batch[{k!r}] has shape {np.shape(v)}, expected {want}")
    m = self.cfg.optim.micro_batches
    if b % m:
      raise ValueError(f"batch of {b} rows does not divide into optim.micro_batches={m}")
    n_proc = 1 if self.mesh is None else len({d.process_index for d in self.mesh.devices.flat})
    if self.context_parallel and n_proc > 1:
      raise ValueError("optim.context_parallel runs on a learner mesh within one process (this one spans "
                       f"{n_proc}): each process would hold part of every row")
    n_dev = 1 if self.mesh is None or self.context_parallel else self.mesh.shape[self.cfg.batch_axis] // n_proc
    if (b // m) % n_dev:
      where = f"the {n_dev} devices of learner mesh axis {self.cfg.batch_axis!r}" + (
          " on this process" if n_proc > 1 else "")
      raise ValueError(f"micro-batch of {b // m} rows (batch {b} / optim.micro_batches={m}) does not divide "
                       f"over {where}")
    out = {}
    for k, v in batch.items():
      if k not in BATCH_KEYS and k not in TOKEN_KEYS and k not in PACKED_TOKEN_KEYS:
        continue  # host-only columns (rewards, group ids, ...) stay on the host
      v = np.asarray(v).reshape((m, b // m) + np.shape(v)[1:])
      if self.mesh is None:
        out[k] = jnp.asarray(v)
      else:
        sharding = NamedSharding(self.mesh, self._batch_spec(k, v.shape))
        if n_proc > 1:
          global_shape = (m, v.shape[1] * n_proc) + v.shape[2:]
          out[k] = jax.make_array_from_process_local_data(sharding, v, global_shape)
        else:
          out[k] = jax.device_put(v, sharding)
    if self.cfg.optim.group_by_length:
      out["length_branch"] = self._length_branches(batch["loss_mask"], m, n_proc)
    return out

  def _batch_spec(self, key: str, shape) -> P:
    """Where a [M, b, ...] batch leaf lives: rows split over the batch axis, or with
    optim.context_parallel the tokens of per-token leaves (whole blocks of them) and the rest replicated."""
    axis = self.cfg.batch_axis
    if not self.context_parallel:
      return P(None, axis, *([None] * (len(shape) - 2)))
    per_token = key in TOKEN_KEYS or key in PACKED_TOKEN_KEYS
    if per_token and shape[2] % self.mesh.shape[axis] == 0:
      return P(None, None, axis, *([None] * (len(shape) - 3)))
    return P()

  def sort_by_length(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """With optim.group_by_length, `batch` with its rows sorted by length (every per-row column
    permuted alike, so the loss is unchanged); otherwise `batch` itself."""
    if not self.cfg.optim.group_by_length:
      return batch
    order = np.argsort(row_lengths(batch["loss_mask"]), kind="stable")
    b = len(order)
    return {k: np.asarray(v)[order] if np.ndim(v) >= 1 and np.shape(v)[0] == b else v for k, v in batch.items()}

  def _length_branches(self, loss_mask_bt, m: int, n_proc: int) -> jax.Array:
    """[M] int32, replicated: per micro-batch, the index in `prefix_lengths` of the shortest prefix
    that holds its longest row (on several processes, its longest row on any process)."""
    lengths = prefix_lengths(np.shape(loss_mask_bt)[1], self.cfg.optim.group_by_length)
    longest = row_lengths(loss_mask_bt).reshape(m, -1).max(axis=1)
    branch = distributed.allgather(np.searchsorted(lengths, longest).astype(np.int32)).max(axis=0)
    if self.mesh is None:
      return jnp.asarray(branch)
    replicated = NamedSharding(self.mesh, P())
    if n_proc > 1:  # every process holds the same (global) values
      return jax.make_array_from_process_local_data(replicated, branch, branch.shape)
    return jax.device_put(branch, replicated)

  # ------------------------------------------------------------------ the math

  def _policy_logprobs(self, params, frozen, tokens_bt, with_entropy: bool, mask_btw=None, routing_btlk=None,
                       return_aux: bool = False, layout=None):
    """Next-token logprobs at the sampling temperature; with `mask_btw` (packed, aligned with
    tokens) renormalised over the sampler's kept set of each token (`sampling_mask`); with
    `routing_btlk` (aligned with tokens) through the sampler's MoE experts (`routing`); with
    `layout` (shared-prompt rows, `prompt_rows`) each token predicted from its `predictor`.
    return_aux=True adds the forward's `MoeAux` (router logits) as a third output."""
    model = nnx.merge(self.graphdef, params, frozen)
    if layout is None:
      h_btd, aux = model.hidden_states(tokens_bt, routing_btlk=routing_btlk, return_aux=True)
    else:
      h_btd, aux = model.hidden_states(tokens_bt, layout["positions"], segments_bt=layout["segments"],
                                       prefix_bt=layout["prefix"], routing_btlk=routing_btlk, return_aux=True)
      h_btd = jnp.take_along_axis(h_btd, _next(layout["predictor"])[..., None], axis=1)
    next_mask = None if mask_btw is None else _next_rows(mask_btw)
    logp, ent = logprobs_lib.chunked_token_logprobs(h_btd, _next(tokens_bt), model.unembed,
                                                    self.cfg.logprob_chunk_size, with_entropy=with_entropy,
                                                    temperature=self.cfg.algo.sampling_temperature,
                                                    mask_btw=next_mask)
    return (logp, ent, aux) if return_aux else (logp, ent)

  def _sampling_mask(self, mb):
    """The batch's packed sampling masks when algo.keep_sampling_mask is on, else None."""
    if not self.cfg.algo.keep_sampling_mask:
      return None
    if "sampling_mask" not in mb:
      raise ValueError("algo.keep_sampling_mask=True but the batch has no 'sampling_mask': record it in the "
                       "sampler (sampler.record_sampling_mask=True) and pass assemble_batch(..., sampling_mask=True)")
    return mb["sampling_mask"]

  def _routing(self, mb):
    """The sampler's experts [b, T, L, k] to force when algo.keep_routing is on, else None."""
    if not self.cfg.algo.keep_routing:
      return None
    if "routing" not in mb:
      raise ValueError("algo.keep_routing=True but the batch has no 'routing': record it in the sampler "
                       "(sampler.record_routing=True, an MoE model) and pass assemble_batch(..., routing=True)")
    return mb["routing"]

  def _ref_logprobs(self, state: TrainState, params, tokens_bt, mask_btw=None, routing_btlk=None, layout=None):
    ref_params = lora_lib.zero_adapters(params) if self.lora else state.ref_params
    logp, _ = self._policy_logprobs(jax.lax.stop_gradient(ref_params), state.frozen, tokens_bt, False, mask_btw,
                                    routing_btlk, layout=layout)
    return jax.lax.stop_gradient(logp)

  def _off_policy(self, logp, behav, mask, mb):
    """(old logprobs of the clip, behaviour -> proximal IS weights or None, stats) of the decoupled
    objective (DESIGN "Staleness"): the trust region is around the learner's proximal policy and the
    IS weight corrects for the sampler's behaviour policy."""
    a = self.cfg.algo
    if "proximal_logprobs" in mb:  # computed before a series of updates (several minibatches per batch)
      prox = _next(mb["proximal_logprobs"]).astype(jnp.float32)
    else:  # one update per batch: the proximal policy is the current one
      prox = jax.lax.stop_gradient(logp)
    if not a.decoupled:
      return behav, None, {"mismatch_kl": jnp.exp(prox - behav) - 1.0 - (prox - behav)}
    is_w, stats = is_correction.importance_weights(prox, behav, mask, mode=a.is_mode, level=a.is_level,
                                                   cap=a.is_cap, low=a.is_low, high=a.is_high)
    return prox, is_w, dict(stats)

  def _micro_loss(self, params, state: TrainState, mb, denom):
    """Loss contribution of one micro-batch (already divided by the whole batch's normaliser)."""
    a = self.cfg.algo
    mask = _next(mb["loss_mask"]).astype(jnp.float32)
    behav = _next(mb["behaviour_logprobs"]).astype(jnp.float32)
    layout = _layout(mb)
    logp, entropy, aux = self._policy_logprobs(params, state.frozen, mb["tokens"], True, self._sampling_mask(mb),
                                               self._routing(mb), return_aux=True, layout=layout)
    old, is_w, stats = self._off_policy(logp, behav, mask, mb)
    if "routing" in mb:  # position t's routing feeds the log-prob of token t+1, weighted by mask[t]
      stats["routing_disagreement"], stats["routing_token_disagreement"] = routing_lib.disagreement(
          aux.router_logits_btlx, mb["routing"])
    if "token_advantages" in mb:  # one advantage per token (token_advantages.py): the same clip loss per token
      pg_bt, loss_stats = gae_lib.token_policy_loss(a.loss, logp, old, _next(mb["token_advantages"]).astype(jnp.float32),
                                                    mask, eps_low=a.eps_low_value, eps_high=a.eps_high_value,
                                                    is_weights_bt=is_w)
    else:
      pg_bt, loss_stats = self.loss.fn(logp, old, mb["advantages"].astype(jnp.float32), mask,
                                       eps_low=a.eps_low_value, eps_high=a.eps_high_value, is_weights_bt=is_w)
    stats["clip_frac"] = loss_stats["clip_frac"]
    stats["entropy"] = entropy
    loss_bt = pg_bt
    tw = losses.token_weights(mask, a.resolved_aggregation, a.norm_length, _next_segments(mb))
    sums = {"pg_loss": (pg_bt * tw).sum() / denom}
    if a.kl_coef > 0:
      kl_bt = self.kl_fn(logp, self._ref_logprobs(state, params, mb["tokens"], self._sampling_mask(mb),
                                                  self._routing(mb), layout))
      loss_bt = loss_bt + a.kl_coef * kl_bt
      stats["kl"] = kl_bt
    loss = (loss_bt * tw).sum() / denom
    for k, v in stats.items():
      v = jax.lax.stop_gradient(v)
      if k.endswith("_max"):
        sums[k] = jnp.where(mask > 0, v, -jnp.inf).max()
      else:
        sums[k] = (v * mask).sum()
    assert set(sums) == set(self._batch_stat_keys(mb)), (sorted(sums), self._batch_stat_keys(mb))
    return loss, sums

  def _batch_stat_keys(self, batch) -> tuple[str, ...]:
    """`_stat_keys` plus the routing metrics when the batch carries the sampler's routing."""
    return self._stat_keys() + (ROUTING_STAT_KEYS if "routing" in batch else ())

  def _stat_keys(self) -> tuple[str, ...]:
    """The scalar sums `_micro_loss` returns (static, so the scan carry needs no extra trace)."""
    a = self.cfg.algo
    keys = ("pg_loss", "clip_frac", "entropy")
    keys += is_correction.STAT_KEYS if a.decoupled else ("mismatch_kl",)
    return keys + (("kl",) if a.kl_coef > 0 else ())

  def _accumulate(self, state: TrainState, batch):
    """Summed gradients, loss and metric sums over the micro-batches (leading axis M)."""
    a = self.cfg.algo
    mask_all = _next(batch["loss_mask"]).astype(jnp.float32)  # [M, b, T]
    segments = _next_segments(batch)
    denom = losses.normaliser(mask_all.reshape(-1, mask_all.shape[-1]), a.resolved_aggregation,
                              None if segments is None else segments.reshape(-1, segments.shape[-1]))
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def micro(carry, mb):
      g_acc, loss_acc, s_acc = carry
      (loss, sums), g = self._micro_grads(grad_fn, state, mb, denom)
      g_acc = jax.tree.map(jnp.add, g_acc, g)
      s_acc = {k: (jnp.maximum(s_acc[k], v) if k.endswith("_max") else s_acc[k] + v) for k, v in sums.items()}
      return (g_acc, loss_acc + loss, s_acc), None

    zeros_g = jax.tree.map(jnp.zeros_like, state.params)
    s0 = {k: jnp.float32(-jnp.inf if k.endswith("_max") else 0.0) for k in self._batch_stat_keys(batch)}
    (grads, loss, sums), _ = jax.lax.scan(micro, (zeros_g, jnp.zeros((), jnp.float32), s0), batch)
    return grads, loss, sums

  def _micro_grads(self, grad_fn, state: TrainState, mb, denom):
    """grad_fn on one micro-batch; with `length_branch`, on its rows trimmed to that prefix length
    (every per-token leaf [b, T, ...] is cut along T; per-row leaves [b] are kept)."""
    if "length_branch" not in mb:
      return grad_fn(state.params, state, mb, denom)
    mb = dict(mb)
    branch = mb.pop("length_branch")

    def at(length):
      return lambda mb: grad_fn(state.params, state, {k: v[:, :length] if v.ndim >= 2 else v for k, v in mb.items()},
                                denom)

    lengths = prefix_lengths(mb["tokens"].shape[1], self.cfg.optim.group_by_length)
    return jax.lax.switch(branch, [at(n) for n in lengths], mb)

  def _update(self, state: TrainState, batch):
    """One optimizer update on the whole batch: (params, opt_state, finite, metrics before the per-token means)."""
    grads, loss, sums = self._accumulate(state, batch)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = self.tx.update(grads, state.opt_state, state.params)
    new_params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), state.params, updates)
    return new_params, new_opt, finite, {"loss": loss, "grad_norm": grad_norm, **sums}

  def _updates(self, state: TrainState, batch):
    """optim.updates_per_batch = K updates on one batch (TRL's num_iterations, verl's ppo_epochs):
    (params, opt_state, whether the first was finite, metrics averaged over the updates taken).

    The trust region of every update is the policy that started the batch: its logprobs are the
    proximal ones (`_off_policy`), so the first update is the K = 1 step and from the second on the
    ratio moves and the clip binds. A non-finite update is not applied, nor is any after it; the
    step counts (the version advances) when the first one was applied."""
    k = self.cfg.optim.updates_per_batch
    if self.cfg.algo.decoupled and "proximal_logprobs" not in batch:
      batch = {**batch, "proximal_logprobs": jax.lax.stop_gradient(self._token_logprobs(state, batch))}

    def one(carry, _):
      params, opt_state, ok = carry
      new_params, new_opt, finite, out = self._update(state.replace(params=params, opt_state=opt_state), batch)
      take = ok & finite
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(take, n, o), new, old)
      return (keep(new_params, params), keep(new_opt, opt_state), take), (out, take)

    (params, opt_state, _), (outs, taken) = jax.lax.scan(one, (state.params, state.opt_state, jnp.bool_(True)),
                                                         None, length=k)
    n = taken.sum()
    w = jnp.where(n > 0, taken / jnp.maximum(n, 1), jnp.arange(k) == 0).astype(jnp.float32)  # none taken: the first's
    out = {key: v.max() if key.endswith("_max") else (v * w).sum() for key, v in outs.items()}
    return params, opt_state, taken[0], {**out, "updates_taken": n.astype(jnp.float32)}

  def _train_step(self, state: TrainState, batch: dict[str, jax.Array], rng: jax.Array):
    del rng  # the objective is deterministic; kept in the signature for dropout-style extensions
    mask_all = _next(batch["loss_mask"]).astype(jnp.float32)  # [M, b, T]
    t = mask_all.shape[-1]
    n_tokens = jnp.maximum(mask_all.sum(), 1.0)
    if self.cfg.optim.updates_per_batch == 1:
      new_params, new_opt, finite, sums = self._update(state, batch)
    else:
      new_params, new_opt, finite, sums = self._updates(state, batch)
    # A non-finite step leaves the state as it was; the runtime counts `nonfinite` and stops.
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(step=state.step + finite.astype(jnp.int32), params=keep(new_params, state.params),
                              opt_state=keep(new_opt, state.opt_state))

    metrics = {"loss": sums.pop("loss"), "grad_norm": sums.pop("grad_norm"),
               "nonfinite": (~finite).astype(jnp.float32),
               "learning_rate": jnp.asarray(self.schedule(state.step), jnp.float32), "num_tokens": n_tokens,
               "pg_loss": sums.pop("pg_loss")}
    if "updates_taken" in sums:
      metrics["updates_taken"] = sums.pop("updates_taken")
    for k, v in sums.items():
      metrics[k] = v if k.endswith("_max") else v / n_tokens
    if "is_weight" in metrics:
      metrics["is_ess"] = jnp.square(metrics["is_weight"]) / jnp.maximum(metrics.pop("is_weight_sq"), 1e-12)
    versions = _next(batch["versions"], -1)
    segments = _next_segments(batch)
    metrics.update(is_correction.version_lag_stats(versions.reshape(-1, t), mask_all.reshape(-1, t), state.step,
                                                   None if segments is None else segments.reshape(-1, t)))
    adv = batch["advantages"].reshape(-1)
    rows = mask_all.reshape(-1, t).sum(-1) > 0
    metrics["advantage_abs_mean"] = jnp.where(rows, jnp.abs(adv), 0.0).sum() / jnp.maximum(rows.sum(), 1)
    return new_state, metrics

  def _token_logprobs(self, state: TrainState, batch):
    """log pi(token t) aligned with `tokens` (0 at t = 0), [M, b, T]: the proximal logprobs."""
    def one(mb):
      logp, _ = self._policy_logprobs(state.params, state.frozen, mb["tokens"], False, self._sampling_mask(mb),
                                      self._routing(mb), layout=_layout(mb))
      return jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp[:, :-1]], axis=-1)
    a = self.cfg.algo
    keys = ("tokens",) + (("sampling_mask",) if a.keep_sampling_mask else ()) + (("routing",) if a.keep_routing else ())
    keys += prompt_rows.LAYOUT_KEYS
    return jax.lax.map(one, {k: batch[k] for k in keys if k in batch})

  # ------------------------------------------------------------------ public

  def train_step(self, state: TrainState, batch: dict[str, jax.Array], rng: jax.Array):
    """(state, batch, rng) -> (state, metrics). `state` is donated: do not reuse it afterwards.

    Metrics stay on device; `jax.device_get` them only when logging.
    """
    batch, stats = self.prepare_batch(state, batch)
    state, metrics = self._step(state, batch, rng)
    return (state, {**metrics, **stats}) if stats else (state, metrics)

  def step_with_output(self, fn, out_sharding):
    """A second compiled train step that also returns `fn(new_state)`:
    (state, batch, rng) -> (state, metrics, fn(new state)), `state` donated as in `train_step`. Work
    that must follow every step (weight sync's packing) runs inside the step's program, without a
    dispatch of its own; the learner and its `train_step` are unchanged."""
    def step_then_fn(state, batch, rng):
      state, metrics = self._train_step(state, batch, rng)
      return state, metrics, fn(state)

    compiled = self._jit(step_then_fn, donate_argnums=(0,), out_shardings=(self.state_shardings, None, out_sharding))

    def step(state, batch, rng):
      batch, stats = self.prepare_batch(state, batch)
      state, metrics, out = compiled(state, batch, rng)
      return state, ({**metrics, **stats} if stats else metrics), out

    return step

  def prepare_batch(self, state: TrainState, batch: dict[str, jax.Array]):
    """(batch, host-side stats) as the step takes it: the batch itself here (PPO adds its targets)."""
    del state
    return batch, {}

  def policy(self, state: TrainState) -> nnx.Module:
    """The policy the sampler runs (for weight sync, eval and export): the model itself here."""
    return self.model(state)

  def sampler_params(self, state: TrainState):
    """The sampler's params: the policy's whole nnx State over `state`'s arrays."""
    return nnx.split(self.policy(state))[1]

  def loss_and_grads(self, state: TrainState, batch: dict[str, jax.Array]):
    """(loss, gradients w.r.t. the trainable params) of a placed batch, without an update."""
    grads, loss = self._grads(state, batch)
    return loss, grads

  def token_logprobs(self, state: TrainState, batch: dict[str, jax.Array]) -> jax.Array:
    """Per-token logprobs of the current policy (set as batch['proximal_logprobs'] before taking
    several updates on one batch, the decoupled objective's proximal policy)."""
    return self._logprobs(state, batch)

