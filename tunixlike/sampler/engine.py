"""The decode engine, in the shape of JetStream's Engine API.

  params = engine.load_params()
  state = engine.init_decode_state()
  prefix = engine.prefill(params, prompt_ids, true_length)   # one prompt, bucketed length
  state = engine.insert(prefix, state, slot)                 # G times for a GRPO group
  state, result = engine.generate(params, state)             # steps_per_call tokens per slot

Several groups at once (what the rollout driver does when slots free up): `prefill_many` runs their
prompts as one batch ([prompts, bucket], padded to a power-of-two count) and `insert_many` writes
all their samples into free slots with one scatter program. A program call costs about a
millisecond of fixed overhead on a 4-device CPU mesh whatever its size, so one call per refill
instead of one prefill and one insert per group is most of the admission cost saved.

Params are passed on every call so the driver can swap them between steps (in-flight update); the
policy version lives in the decode state and is stamped on every token it produces.

Prefill writes the KV of prompt[:-1] and leaves the last prompt token as the slot's next input, so
the first completion token is sampled by `generate` in its own slot: the G samples of a group share
one prefill yet draw independent first tokens. Each slot samples with the noise
uniform(fold_in(slot_key, n)) for its n-th token, so a seeded completion does not depend on which
slot it ran in nor on what else was decoding (continuous batching and one-at-a-time agree).

Sharding: slots are split over the 'replica' mesh axis (data parallel), weights and KV heads over
'tensor' (the model's logical-axis rules).

The decode cache is only as long as the longest live sequence needs (rounded up to
`attend_bucket`): it is grown or shrunk by one copy when that changes, so each decode step reads
just that window. Slicing a longer cache inside the step instead costs a copy of the window every
step (XLA materialises the slice before the attention matmul), 2-3x the attention bytes. There is
one compiled decode program per window size, and one prefill program per power-of-two bucket and
prompt batch size (`SamplerConfig.prompt_batch_sizes`).

Slot groups (`sampler.slot_groups` = G > 1): the cache is split into G groups of slots, each with its
own window (`kv_cache.GroupedKVCache`); projections and MLP still run once over all slots, only
attention is split. `plan_insert` keeps long sequences together: a new sequence goes into the group
whose oldest live sequence is youngest, moving that sequence (one row copy, `move`) into the free
slot if needed, so a group of young sequences reads a short window instead of the longest one's.
There is one decode program per tuple of group windows that occurs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tunixlike import mesh as mesh_lib
from tunixlike.models import kv_cache as kv_cache_lib
from tunixlike.models import sharding as sharding_lib
from tunixlike.sampler import params as params_lib
from tunixlike.sampler import sampling
from tunixlike.sampler.config import SamplerConfig, check_sized

def _key_data(key) -> np.ndarray:
  """A PRNG key (typed or raw uint32 data, on device or host) as host uint32 data."""
  if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(key, np.uint32)


Params = Any  # nnx.State of the model, params.WithAdapters (LoRA adapters still packed) or params.Packed (a small model)


class PromptError(ValueError):
  """A prompt the engine cannot take (empty, too long, ids outside the vocabulary)."""


@dataclasses.dataclass(frozen=True)
class Prefix:
  """The prefilled KV of one prompt (all but its last token), ready to insert into slots.

  Prompts prefilled in one call (`prefill_many`) share its cache: each Prefix names its row.
  """

  cache: kv_cache_lib.KVCache  # per layer k [rows, Hkv, D, bucket], v [rows, Hkv, bucket, D]
  last_token: int  # the prompt's last token: the first input of decode
  true_length: int  # prompt length in tokens
  version: int  # policy version of the params that computed the KV
  # sampler.record_routing ("Keep Routing"): experts the prefill chose for prompt[:-1] (positions
  # past true_length - 1 are padding), a device array fetched only when the completion is finished.
  routing: jax.Array | None = None  # int32 [rows, bucket, L, k]
  row: int = 0  # this prompt's row of `cache` and `routing`


@dataclasses.dataclass(frozen=True)
class ParkedKV:
  """KV of a finished turn kept without its slot (`PagedEngine.park`): positions [0, length)."""

  key: int
  length: int


@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Device arrays of every slot, plus a host-side upper bound of each slot's position.

  The host mirror picks the static attention window without a device round-trip.
  """

  arrays: dict[str, Any]
  host_positions: np.ndarray  # int64 [S]: next decode position upper bound of each live slot
  host_live: np.ndarray  # bool [S]: slot holds a sequence that may still be decoding


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  """steps_per_call decode steps of every slot (device arrays; fetch with jax.device_get)."""

  tokens_ks: jax.Array  # int32 [K, S]
  logprobs_ks: jax.Array  # float32 [K, S], under the processed sampling distribution
  valid_ks: jax.Array  # bool [K, S]: slot was decoding at that step (token is real)
  done_s: jax.Array  # bool [S]: slot finished (EOS or its length limit) by the end of the call
  version: jax.Array  # int32 []: policy version of every valid token in this result
  mask_ksw: jax.Array | None  # uint8 [K, S, ceil(V/8)] packed sampling masks, if recorded
  # Experts each MoE layer used for the step's *input* token (the forward that produced the
  # step's logprob), if sampler.record_routing.
  routing_kslk: jax.Array | None = None  # int32 [K, S, L, k]


class Engine:
  """Prefill / insert / generate over `max_concurrent_decodes` slots of one model."""

  def __init__(self, model: nnx.Module, config: SamplerConfig, mesh: jax.sharding.Mesh | None = None,
               rules=mesh_lib.SAMPLER_RULES):
    if not isinstance(config, SamplerConfig):
      raise TypeError(f"Engine config must be a SamplerConfig, got {type(config).__name__}")
    check_sized(config)
    self.config = config
    self.model_config = model.cfg
    if config.record_routing and not model.cfg.is_moe:
      raise ValueError("sampler.record_routing=True needs a mixture-of-experts model, but the model is dense "
                       "(num_experts=0): there is no routing to record")
    vocab = self.model_config.vocab_size
    bad = [i for i in config.eos_ids if i >= vocab]
    if bad:
      raise ValueError(f"SamplerConfig.eos_ids={config.eos_ids}: ids {bad} are outside the vocabulary "
                       f"(vocab_size={vocab})")
    if mesh is None:
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), mesh_lib.SAMPLER_AXES)
    for axis in mesh_lib.SAMPLER_AXES:
      if axis not in mesh.shape:
        raise ValueError(f"sampler mesh axes are {tuple(mesh.shape)}, expected {mesh_lib.SAMPLER_AXES}")
    replicas = mesh.shape["replica"]
    if config.max_concurrent_decodes % replicas:
      raise ValueError(f"sampler.max_concurrent_decodes={config.max_concurrent_decodes} is not "
                       f"divisible by the {replicas} sampler replicas")
    self.mesh, self.rules = mesh, rules
    if config.max_concurrent_decodes % (replicas * config.slot_groups):
      raise ValueError(f"sampler.max_concurrent_decodes={config.max_concurrent_decodes} is not divisible by "
                       f"{replicas} replicas x sampler.slot_groups={config.slot_groups}")
    self._groups = config.slot_groups
    # GroupedKVCache interleaving: every replica holds `_block` rows of every group.
    self._block = config.max_concurrent_decodes // (replicas * config.slot_groups)
    self._slots_per_replica = config.max_concurrent_decodes // replicas
    self._graphdef, state = nnx.split(model)
    self.param_shardings = sharding_lib.state_shardings(state, mesh, rules)
    self._initial_params = state
    self._sampling = config.sampling
    self._eos_ids = np.asarray(config.eos_ids, np.int32)
    self._cache_dtype = config.cache_dtype
    self._replicated = NamedSharding(mesh, P())
    self._slots_sharding = NamedSharding(mesh, P("replica"))
    self._prefill_fn = jax.jit(self._prefill_impl, static_argnames=("bucket",),
                               out_shardings=self._replicated)
    # PartitionSpecs do not depend on the cache length, so one set serves every window size.
    state_shardings = self._state_shardings(self.config.cache_length)
    # insert / move touch one group's cache (and the per-slot arrays): their programs depend on that
    # group's window only, not on the whole tuple of windows.
    group_sharding = state_shardings["cache"].groups[0]
    small_shardings = {k: v for k, v in state_shardings.items() if k != "cache"}
    self._insert_fn = jax.jit(self._insert_impl, donate_argnums=(1, 2),
                              out_shardings=(group_sharding, small_shardings))
    self._move_fn = jax.jit(self._move_impl, donate_argnums=(1, 2),
                            out_shardings=(group_sharding, small_shardings))
    self._release_fn = jax.jit(self._release_impl, donate_argnums=(0,), out_shardings=small_shardings)
    self._generate_fn = jax.jit(self._generate_impl, donate_argnums=(1,),
                                out_shardings=(state_shardings, self._replicated))
    self._resize_fns = {}
    self._extend_fn = jax.jit(self._extend_impl, donate_argnums=(4, 5), out_shardings=self._replicated)

  # ------------------------------------------------------------------ JetStream Engine API

  @property
  def max_concurrent_decodes(self) -> int:
    return self.config.max_concurrent_decodes

  @property
  def max_prefill_length(self) -> int:
    return self.config.max_prefill_length

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def vocab_size(self) -> int:
    return self.model_config.vocab_size

  def load_params(self, params: Params | None = None) -> Params:
    """The model's params placed on the sampler mesh (or `params`, e.g. from the learner, resharded)."""
    return jax.device_put(self._initial_params if params is None else params, self.param_shardings)

  def init_decode_state(self, version: int = 0) -> DecodeState:
    s = self.max_concurrent_decodes
    cache = self._empty_grouped((self.config.attend_window(0),) * self._groups)
    arrays = dict(self._slot_arrays(version), cache=cache)
    arrays = jax.device_put(arrays, self._state_shardings(self.config.attend_window(0)))
    return DecodeState(arrays, np.zeros((s,), np.int64), np.zeros((s,), bool))

  def _slot_arrays(self, version: int) -> dict:
    """The decode state's per-slot arrays (every slot empty) and the policy version."""
    s = self.max_concurrent_decodes
    return dict(
        tokens=jnp.zeros((s,), jnp.int32),  # next input token of each slot
        positions=jnp.zeros((s,), jnp.int32),  # its position
        num_generated=jnp.zeros((s,), jnp.int32),
        max_new=jnp.zeros((s,), jnp.int32),
        done=jnp.ones((s,), jnp.bool_),  # empty slots count as done: they emit nothing
        keys=jnp.zeros((s, 2), jnp.uint32),
        version=jnp.int32(version),
    )

  def prefill(self, params: Params, tokens, true_length: int | None = None, *,
              version: int = 0) -> Prefix:
    """Prefills one prompt. `tokens` is a 1-D id sequence (may be right-padded past true_length)."""
    return self.prefill_many(params, [self._prompt_ids(tokens, true_length)], version=version)[0]

  def prefill_many(self, params: Params, prompts, *, version: int = 0, max_length: int | None = None) -> list[Prefix]:
    """Prefills several prompts (1-D id sequences): one Prefix each, as `prefill` gives, in one
    program call per prompt bucket and `max_prompt_batch` prompts. Each call pads its prompts to a
    size of `config.prompt_batch_sizes`, so there is one program per (batch size, prompt bucket).
    Prompts are not padded to a longer bucket than their own: that would waste compute and widen the
    attention window of the slots they go into. Prompts longer than `sampler.prefill_chunk` prefill
    alone, a chunk per call. `max_length` (default max_prefill_length) admits longer ids: a
    preempted sequence's prompt and completion so far, prefilled again to resume it."""
    ids = [self._prompt_ids(p, max_length=max_length) for p in prompts]
    by_bucket: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
      by_bucket.setdefault(self.prefill_bucket(len(x) - 1), []).append(i)
    out: list[Prefix | None] = [None] * len(ids)
    for bucket, idx in by_bucket.items():
      if bucket > self.config.prefill_chunk:
        for i in idx:
          out[i] = collections.deque(self._prefill_in_chunks(params, ids[i], bucket, int(version)), maxlen=1)[0]
        continue
      for start in range(0, len(idx), self.max_prompt_batch):
        batch = idx[start:start + self.max_prompt_batch]
        for i, prefix in zip(batch, self._prefill_batch(params, [ids[i] for i in batch], bucket, int(version))):
          out[i] = prefix
    return out

  def prefill_steps(self, params: Params, tokens, *, version: int = 0, max_length: int | None = None):
    """Prefills one prompt a program call per `next`: yields None after each chunk but the last,
    then the Prefix (at once for a prompt of one chunk or less). The driver runs a long prompt's
    chunks between generate calls, so the live slots never wait for a whole long prefill."""
    ids = self._prompt_ids(tokens, max_length=max_length)
    bucket = self.prefill_bucket(len(ids) - 1)
    if bucket > self.config.prefill_chunk:
      yield from self._prefill_in_chunks(params, ids, bucket, int(version))
    else:
      yield self._prefill_batch(params, [ids], bucket, int(version))[0]

  def prefills_in_chunks(self, num_tokens: int) -> bool:
    """Whether a prompt of `num_tokens` takes more than one chunk (`sampler.prefill_chunk`)."""
    return num_tokens - 1 > self.config.prefill_chunk

  def _prefill_in_chunks(self, params: Params, ids: np.ndarray, bucket: int, version: int):
    """A prompt longer than `sampler.prefill_chunk`, one chunk per program call (the same program for
    every chunk of every prompt in this bucket): prompt[:-1] into a [1, bucket] cache. A generator:
    None after each chunk but the last, then the Prefix."""
    chunk, n = self.config.prefill_chunk, len(ids) - 1
    padded = np.zeros((1, bucket), np.int32)
    padded[0, :n] = ids[:-1]
    cache = self._empty_cache_on_mesh(bucket)
    routing = None
    if self.config.record_routing:
      mc = self.model_config
      routing = jax.device_put(jnp.zeros((1, bucket, mc.num_layers, mc.num_experts_per_tok), jnp.int32),
                               self._replicated)
    length = np.asarray([n], np.int32)
    for start in range(0, n, chunk):
      cache, routing = self._extend_fn(params, padded[:, start:start + chunk], np.int32(start), length,
                                       cache, routing)
      if start + chunk < n:
        yield None
    yield Prefix(cache=cache, last_token=int(ids[-1]), true_length=len(ids), version=version, routing=routing)

  def _prefill_batch(self, params: Params, ids: list[np.ndarray], bucket: int, version: int) -> list[Prefix]:
    rows = self.prompt_batch_bucket(len(ids))
    padded, lengths = np.zeros((rows, bucket), np.int32), np.zeros((rows,), np.int32)
    for r, x in enumerate(ids):  # rows past the prompts stay empty (length 0)
      padded[r, :len(x) - 1], lengths[r] = x[:-1], len(x) - 1
    cache, routing = self._prefill_fn(params, padded, lengths, bucket=bucket)
    return [Prefix(cache=cache, last_token=int(x[-1]), true_length=len(x), version=version, routing=routing,
                   row=r) for r, x in enumerate(ids)]

  def _prompt_ids(self, tokens, true_length: int | None = None, max_length: int | None = None) -> np.ndarray:
    """The prompt's ids (tokens[:true_length]), checked: non-empty, short enough, in the vocabulary."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
      raise PromptError(f"prefill: tokens must be 1-D, got shape {tokens.shape}")
    n = len(tokens) if true_length is None else int(true_length)
    if n < 1:
      raise PromptError("prefill: empty prompt (true_length 0); a prompt needs at least one token")
    if n > len(tokens):
      raise PromptError(f"prefill: true_length={n} exceeds the {len(tokens)} tokens given")
    limit = max_length or self.max_prefill_length
    if n > limit:
      raise PromptError(f"prefill: prompt of {n} tokens exceeds max_prefill_length={limit}")
    ids = tokens[:n]
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= self.vocab_size:
      raise PromptError(f"prefill: token ids must be integers in [0, {self.vocab_size}), got "
                        f"dtype {ids.dtype}, range [{ids.min()}, {ids.max()}]")
    return ids

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
             key: jax.Array | None = None, max_new_tokens: int | None = None) -> DecodeState:
    """Puts `prefix` into `slot` (overwriting whatever was there); the slot starts decoding.

    `key` seeds the slot's sampling noise (default: derived from the prefix length and slot, so pass
    one per sample for independent, reproducible samples). `max_new_tokens` caps this completion.
    """
    if key is None:
      key = jax.random.fold_in(jax.random.PRNGKey(self.config.seed), slot)
    return self.bulk_insert(prefix, decode_state, [slot], keys=[key], max_new_tokens=max_new_tokens)

  def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots, *, keys,
                  max_new_tokens: int | None = None) -> DecodeState:
    """`insert` of one prefix into several slots (the G samples of a GRPO group), with one key per
    slot: the same state as inserting them one by one, in one program call per slot group (per
    `group_size` slots from a `prefill` prefix) instead of one per slot (as JetStream's `bulk_insert`)."""
    return self.insert_many([prefix], decode_state, [slots], keys=[keys], max_new_tokens=max_new_tokens)

  def insert_many(self, prefixes, decode_state: DecodeState, slots, *, keys,
                  max_new_tokens=None, generated=None) -> DecodeState:
    """`bulk_insert` of several prefixes at once (the G samples of each of several groups):
    prefixes[i] goes into the slots slots[i] with the keys keys[i] (one per slot) and the limit
    max_new_tokens[i] (or one limit for all; None = the config's). The same state as one
    `bulk_insert` per prefix, in one program call per slot group and prefill call the prefixes came
    from (one for the groups of a refill), instead of one per prefix. A call inserts as many slots
    as its prefill call had rows times group_size (padded: one insert program per prefill batch
    size, prompt bucket and window). `generated[i]` (default 0): tokens of the completion already
    in prefixes[i] (a resumed sequence: its prompt and completion so far were prefilled), which
    count toward the limit and continue its sampling noise where it stopped.
    """
    entries = self._insert_entries(prefixes, slots, keys, max_new_tokens, generated)
    calls: dict[tuple[int, int], list] = {}  # (slot group, id of the prefill's cache) -> its entries
    for entry in entries:
      group = kv_cache_lib.group_of_row(entry[1], self._groups, self._block)[0]
      calls.setdefault((group, id(entry[0].cache)), []).append(entry)
    arrays = decode_state.arrays
    for (group, _), call in calls.items():
      source = call[0][0].cache
      if arrays["cache"].windows[group] < source.max_len:
        window = self.config.attend_window(source.max_len - 1)
        arrays = self._resize(DecodeState(arrays, None, None), group, window).arrays
      width = self._insert_width(source.batch_size)
      for start in range(0, len(call), width):
        arrays = self._insert_call(source, arrays, group, call[start:start + width], width)
    return dataclasses.replace(self._started_on_host(decode_state, entries), arrays=arrays)

  @staticmethod
  def _started_on_host(decode_state: DecodeState, entries) -> DecodeState:
    """The host mirror after inserting `entries` (`_insert_entries`): their slots live, at the
    position of their prefix's last token."""
    positions = decode_state.host_positions.copy()
    live = decode_state.host_live.copy()
    for prefix, slot, *_ in entries:
      positions[slot], live[slot] = prefix.true_length - 1, True
    return dataclasses.replace(decode_state, host_positions=positions, host_live=live)

  def _insert_entries(self, prefixes, slots, keys, max_new_tokens, generated) -> list[tuple]:
    """insert_many's arguments, checked, as (prefix, slot, key data, limit, generated) per slot."""
    n = len(prefixes)
    limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * n
    done = [0] * n if generated is None else [int(g) for g in generated]
    if not len(slots) == len(keys) == len(limits) == len(done) == n:
      raise ValueError(f"insert_many: {n} prefixes need as many slot lists ({len(slots)}), key lists "
                       f"({len(keys)}), limits ({len(limits)}) and generated counts ({len(done)})")
    entries = []
    for i, (prefix, prefix_slots, prefix_keys, limit, gen) in enumerate(zip(prefixes, slots, keys, limits, done)):
      if len(prefix_keys) != len(prefix_slots):
        raise ValueError(f"insert_many: prefix {i} has {len(prefix_slots)} slots and {len(prefix_keys)} keys")
      limit = self._check_limit(limit)
      if not 0 <= gen < limit:
        raise ValueError(f"insert_many: generated={gen} of prefix {i} must be in [0, its limit {limit})")
      entries += [(prefix, int(s), _key_data(k), limit, gen) for s, k in zip(prefix_slots, prefix_keys)]
    self._check_slots([e[1] for e in entries])
    return entries

  def _insert_call(self, source: kv_cache_lib.KVCache, arrays, group: int, entries, width: int) -> dict:
    """One `_insert_fn` call: entries (prefixes of `source`) into their slots of slot group `group`,
    padded to `width` with entries naming a slot and row past the end (the program drops them)."""
    scalars = np.zeros((width, 7), np.int32)
    scalars[:, 0], scalars[:, 5] = self.max_concurrent_decodes, self.max_concurrent_decodes // self._groups
    keys = np.zeros((width, 2), np.uint32)
    for m, (prefix, slot, key, limit, gen) in enumerate(entries):
      row = kv_cache_lib.group_of_row(slot, self._groups, self._block)[1]
      scalars[m] = (slot, prefix.row, prefix.last_token, prefix.true_length - 1, limit, row, gen)
      keys[m] = key
    cache, small = self._split_arrays(arrays)
    new_group, small = self._insert_fn(source, cache.groups[group], small, scalars, keys)
    return self._join_arrays(cache, small, {group: new_group})

  def _insert_width(self, prefill_rows: int) -> int:
    """Slots per `_insert_fn` call from a prefill of `prefill_rows` prompts: their groups' samples."""
    return min(prefill_rows * self.config.group_size, self.max_concurrent_decodes // self._groups)

  def _check_slots(self, slots: list[int]) -> None:
    if len(set(slots)) != len(slots):
      raise ValueError(f"insert: slots {slots} must be distinct slots")
    for slot in slots:
      if not 0 <= slot < self.max_concurrent_decodes:
        raise ValueError(f"insert: slot={slot} outside [0, {self.max_concurrent_decodes})")

  def _check_limit(self, max_new_tokens: int | None) -> int:
    limit = self.config.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if not 1 <= limit <= self.config.max_new_tokens:
      raise ValueError(f"insert: max_new_tokens={max_new_tokens} must be in [1, "
                       f"sampler.max_new_tokens={self.config.max_new_tokens}]")
    return limit

  def generate(self, params: Params, decode_state: DecodeState) -> tuple[DecodeState, GenerateResult]:
    """Advances every live slot by up to steps_per_call tokens (stopping exactly at EOS / limit)."""
    k = self.config.steps_per_call
    live = decode_state.host_live
    # Positions fed this call reach host_position + k - 1 for every live slot (per slot group).
    for group, top in enumerate(self._group_tops(decode_state)):
      window = self.config.attend_window(max(top, 0) + k - 1)
      if window != self._windows(decode_state)[group]:
        decode_state = self._resize(decode_state, group, window)
    arrays, result = self._generate_fn(params, decode_state.arrays)
    positions = np.where(live, np.minimum(decode_state.host_positions + k, self.config.cache_length - 1),
                         decode_state.host_positions)
    return DecodeState(arrays, positions, live.copy()), result

  # ------------------------------------------------------------------ extras beyond JetStream

  def fits(self, decode_state: DecodeState, requests) -> int:
    """How many of `requests` ((prompt length, slots) each) can be inserted now: all of them, since
    every slot owns its whole window (a paged cache checks its block budget)."""
    return len(requests)

  def reserve(self, decode_state: DecodeState) -> tuple[DecodeState, list[int]]:
    """(state, preempted slots) before a generate call: nothing to reserve in a contiguous cache."""
    return decode_state, []

  def compact_slots(self, decode_state: DecodeState) -> tuple[DecodeState, list[tuple[int, int]]]:
    """(state, moves (src, dst) of live sequences to other slots, for the caller to follow): none
    here, where a slot's KV is its own cache row (`PagedEngine` packs live slots low)."""
    return decode_state, []

  def park(self, decode_state: DecodeState, slot: int, num_positions: int) -> ParkedKV | None:
    """Keeps a finished turn's KV for the next one: a contiguous cache keeps none (the next turn
    prefills its conversation again); `PagedEngine` keeps its blocks."""
    return None

  def discard(self, decode_state: DecodeState, parked: ParkedKV | None) -> None:
    """Drops KV `park` kept (nothing here)."""

  def resume_prefill(self, params: Params, decode_state: DecodeState, parked: ParkedKV, tokens, *,
                     version: int = 0) -> Prefix | None:
    """The prefix of `tokens` from KV `park` kept: None here, where nothing is parked (prefill the
    tokens instead); `PagedEngine` computes only the positions added since."""
    return None

  def decode_width(self, decode_state: DecodeState) -> int:
    """Slots per replica a generate call computes: all of them (every slot owns its cache row)."""
    return self._slots_per_replica

  def verify(self, params: Params, decode_state: DecodeState, drafts_sd) -> tuple[DecodeState, GenerateResult]:
    """Speculative decoding's verify call (`PagedEngine.verify`); the config rejects it for this cache."""
    raise ValueError("sampler.speculative=True needs sampler.kv_layout='paged': the contiguous cache does not "
                     "verify drafts")

  def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
    """Stops decoding `slot` (e.g. a stop string was seen on the host); it emits nothing more."""
    cache, small = self._split_arrays(decode_state.arrays)
    arrays = self._join_arrays(cache, self._release_fn(small, np.int32(slot)), {})
    live = decode_state.host_live.copy()
    live[slot] = False
    return DecodeState(arrays, decode_state.host_positions, live)

  def plan_insert(self, decode_state: DecodeState, free_slots) -> tuple[int, tuple[int, int] | None]:
    """Where a new sequence should go: (slot, move), move = None or (src, dst) to apply first with `move`.

    Keeps long sequences together (slot groups): the new sequence joins the group whose oldest live
    sequence is youngest. If that group has no free slot, its oldest live sequence on the replica
    of a free slot moves there (into an older group, whose window already covers it) and the new
    sequence takes its place (only if the free slot's group holds an older sequence, so the move
    shortens the young group's window without widening any other). One group: the first free slot.
    """
    free = [int(s) for s in free_slots]
    if not free:
      raise ValueError("plan_insert: no free slot")
    if self._groups == 1:
      return free[0], None
    tops = self._group_tops(decode_state)
    young = min(range(self._groups), key=lambda g: (tops[g], -g))
    group_of = lambda s: kv_cache_lib.group_of_row(s, self._groups, self._block)[0]
    in_young = [s for s in free if group_of(s) == young]
    if in_young:
      return in_young[0], None
    dst = free[0]
    replica = dst // self._slots_per_replica
    pos, live = decode_state.host_positions, decode_state.host_live
    movable = [s for s in range(replica * self._slots_per_replica, (replica + 1) * self._slots_per_replica)
               if live[s] and group_of(s) == young]
    if not movable or tops[young] >= tops[group_of(dst)]:  # a move would not shorten any window
      return dst, None
    src = max(movable, key=lambda s: (pos[s], -s))
    return src, (src, dst)

  def move(self, decode_state: DecodeState, src: int, dst: int) -> DecodeState:
    """Moves the sequence decoding in slot `src` to the free slot `dst` (KV, token, position, key...).

    The sequence continues exactly as it would have in `src` (its noise depends on its key, not its
    slot); `src` is left free. Slots in different groups only (within a group nothing is gained).
    """
    n = self.max_concurrent_decodes
    if not (0 <= src < n and 0 <= dst < n) or src == dst:
      raise ValueError(f"move: src={src}, dst={dst} must be different slots in [0, {n})")
    if not decode_state.host_live[src] or decode_state.host_live[dst]:
      raise ValueError(f"move: slot {src} must be decoding and slot {dst} free")
    g_src, r_src = kv_cache_lib.group_of_row(src, self._groups, self._block)
    g_dst, r_dst = kv_cache_lib.group_of_row(dst, self._groups, self._block)
    if g_src == g_dst:
      raise ValueError(f"move: slots {src} and {dst} are in the same slot group {g_src}")
    need = self.config.attend_window(int(decode_state.host_positions[src]))
    if self._windows(decode_state)[g_dst] < need:
      decode_state = self._resize(decode_state, g_dst, need)
    cache, small = self._split_arrays(decode_state.arrays)
    scalars = np.asarray([src, dst, r_src, r_dst], np.int32)
    new_group, small = self._move_fn(cache.groups[g_src], cache.groups[g_dst], small, scalars)
    arrays = self._join_arrays(cache, small, {g_dst: new_group})
    positions, live = decode_state.host_positions.copy(), decode_state.host_live.copy()
    positions[dst], live[dst], live[src] = positions[src], True, False
    return DecodeState(arrays, positions, live)

  def mark_finished(self, decode_state: DecodeState, done_s: np.ndarray) -> DecodeState:
    """Host bookkeeping only: slots the device reported done no longer widen the attention window."""
    live = decode_state.host_live & ~np.asarray(done_s, bool)
    return dataclasses.replace(decode_state, host_live=live)

  def set_version(self, decode_state: DecodeState, version: int) -> DecodeState:
    arrays = dict(decode_state.arrays)
    arrays["version"] = jax.device_put(jnp.int32(version), self._replicated)
    return dataclasses.replace(decode_state, arrays=arrays)

  def warmup(self, params: Params) -> None:
    """Compiles every program a run can call, before it runs (as JetStream's model warm-up does).

    Without it, each new prompt bucket or attention window compiles in the middle of decoding (one
    program per shape, 0.1-1 s each on CPU), stalling every slot. This runs each program once on
    scratch state, which is then discarded: prefill per prompt bucket and prefill batch size
    (`config.prompt_batch_sizes`); per attention window, insert (per prompt bucket and prefill batch
    size), the one-bucket grow and shrink; generate per tuple of slot-group windows
    (windows ** slot_groups programs); with slot groups, move per pair of windows. `params` must be
    what the run decodes with (LoRA-packed params compile their own programs).
    """
    lengths: dict[int, int] = {}  # prompt bucket -> a prompt length that lands in it
    for n in range(1, self.max_prefill_length + 1):
      lengths.setdefault(self.prefill_bucket(n - 1), n)
    # A prefix per prompt bucket and prefill batch size: insert programs depend on both.
    prefixes = [self.prefill_many(params, [np.zeros(n, np.int32)] * size)[0]
                for size in self.config.prompt_batch_sizes for n in lengths.values()]
    windows, key = self.config.attend_windows, np.zeros((1, 2), np.uint32)
    state = self.init_decode_state()  # all group caches share one shape per window: group 0 stands for all
    for window in windows:
      if self._windows(state)[0] < window:
        state = self._resize(state, 0, window)
      for prefix in prefixes:
        if prefix.cache.max_len <= window:
          state = self.bulk_insert(prefix, state, [0], keys=key)
    for _ in windows[1:]:
      state = self._resize(state, 0, 0)  # shrinks by one bucket
    state = self.release(state, 0)
    shardings = self._state_shardings(self.config.cache_length)  # specs do not depend on the windows

    def scratch(group_windows):
      return jax.device_put(dict(self.init_decode_state().arrays, cache=self._empty_grouped(group_windows)),
                            shardings)

    for group_windows in itertools.product(windows, repeat=self._groups):
      out = self._generate_fn(params, scratch(group_windows))
    if self._groups > 1:
      scalars = np.asarray([0, self._block, 0, 0], np.int32)  # slot 0 (group 0) -> first slot of group 1
      for src, dst in itertools.product(windows, repeat=2):
        arrays = scratch((src, dst) + (windows[0],) * (self._groups - 2))
        cache, small = self._split_arrays(arrays)
        out = self._move_fn(cache.groups[0], cache.groups[1], small, scalars)
    jax.block_until_ready((state.arrays, out))

  @property
  def max_prompt_batch(self) -> int:
    """Most prompts per `prefill_many` / `insert_many` program call."""
    return self.config.prompt_batch_sizes[-1]

  def prompt_batch_bucket(self, num_prompts: int) -> int:
    return next(b for b in self.config.prompt_batch_sizes if num_prompts <= b)

  def prefill_bucket(self, num_tokens: int) -> int:
    """The prefill length for `num_tokens` positions: a bucket of `config.prefill_buckets`, or past
    them (a resumed sequence) the power of two that holds them."""
    for b in self.config.prefill_buckets:
      if num_tokens <= b:
        return b
    if num_tokens > self.config.cache_length:
      raise PromptError(f"prefill: {num_tokens} tokens exceed the cache length {self.config.cache_length}")
    return 1 << math.ceil(math.log2(num_tokens))

  # ------------------------------------------------------------------ jitted bodies

  def _empty_cache(self, batch: int, length: int) -> kv_cache_lib.KVCache:
    mc = self.model_config
    dtype = self._cache_dtype or mc.dtype
    return kv_cache_lib.KVCache.zeros(mc.num_layers, batch, mc.num_kv_heads, mc.head_dim, length, dtype)

  def _empty_grouped(self, windows) -> kv_cache_lib.GroupedKVCache:
    rows = self.max_concurrent_decodes // self._groups
    return kv_cache_lib.GroupedKVCache(groups=tuple(self._empty_cache(rows, w) for w in windows),
                                       block=self._block)

  @staticmethod
  def _windows(decode_state: DecodeState) -> tuple[int, ...]:
    return decode_state.arrays["cache"].windows

  def _group_tops(self, decode_state: DecodeState) -> list[int]:
    """Per slot group, the largest host position of a live slot (-1 if none is live)."""
    tops = [-1] * self._groups
    for s in np.flatnonzero(decode_state.host_live):
      g = kv_cache_lib.group_of_row(int(s), self._groups, self._block)[0]
      tops[g] = max(tops[g], int(decode_state.host_positions[s]))
    return tops

  @staticmethod
  def _split_arrays(arrays):
    return arrays["cache"], {k: v for k, v in arrays.items() if k != "cache"}

  @staticmethod
  def _join_arrays(cache, small, new_groups: dict):
    groups = tuple(new_groups.get(g, c) for g, c in enumerate(cache.groups))
    return dict(small, cache=kv_cache_lib.GroupedKVCache(groups=groups, block=cache.block))

  def _resize(self, decode_state: DecodeState, group: int, window: int) -> DecodeState:
    """Moves slot group `group`'s cache size toward `window`: grows all the way (zero-padded), shrinks one bucket.

    Every resize changes the size by exactly one bucket, so there are at most two resize programs
    per window size; shrinking lazily (a bucket per generate call) costs a few steps at a wider
    window after a long sequence ends, instead of a program per (old, new) pair.
    """
    step = self.config.attend_bucket
    current = self._windows(decode_state)[group]
    targets = range(current + step, window + 1, step) if window > current else [current - step]
    cache, small = self._split_arrays(decode_state.arrays)
    group_cache = cache.groups[group]
    for target in targets:
      fn = self._resize_fns.get(target)
      if fn is None:
        fn = self._resize_fns[target] = jax.jit(
            functools.partial(self._resize_impl, window=target),  # new shape: nothing to donate
            out_shardings=self._state_shardings(self.config.cache_length)["cache"].groups[0])
      group_cache = fn(group_cache)
    return dataclasses.replace(decode_state, arrays=self._join_arrays(cache, small, {group: group_cache}))

  def _resize_impl(self, cache, *, window):

    def fit(x, seq_axis):
      if x.shape[seq_axis] >= window:
        return jax.lax.slice_in_dim(x, 0, window, axis=seq_axis)
      pad = [(0, 0)] * x.ndim
      pad[seq_axis] = (0, window - x.shape[seq_axis])
      return jnp.pad(x, pad)

    return kv_cache_lib.KVCache(k=tuple(fit(x, 3) for x in cache.k), v=tuple(fit(x, 2) for x in cache.v))

  @functools.cache
  def _state_shardings(self, window: int) -> dict[str, Any]:
    abstract = jax.eval_shape(lambda: self._empty_grouped((window,) * self._groups))
    cache = kv_cache_lib.GroupedKVCache(
        groups=tuple(kv_cache_lib.cache_shardings(g, self.mesh, self.rules) for g in abstract.groups),
        block=self._block)
    slots = self._slots_sharding
    return dict(cache=cache, tokens=slots, positions=slots, num_generated=slots, max_new=slots,
                done=slots, keys=slots, version=self._replicated)

  def _prefill_impl(self, params, tokens_bt, lengths_b, *, bucket):
    """Prefill of a batch of prompts. The rows are split over the replicas when they divide (each
    computes its share instead of all of them; the cache is then gathered for any slot to take)."""
    if tokens_bt.shape[0] % self.mesh.shape["replica"] == 0:
      tokens_bt = jax.lax.with_sharding_constraint(tokens_bt, self._slots_sharding)
      lengths_b = jax.lax.with_sharding_constraint(lengths_b, self._slots_sharding)
    model = nnx.merge(self._graphdef, params_lib.materialize(params))
    cache = self._empty_cache(tokens_bt.shape[0], bucket)
    if not self.config.record_routing:
      return model.prefill(tokens_bt, cache, lengths_b)[1], None
    _, cache, routing_btlk = model.prefill(tokens_bt, cache, lengths_b, return_routing=True)
    return cache, routing_btlk

  def _empty_cache_on_mesh(self, length: int) -> kv_cache_lib.KVCache:
    return jax.device_put(self._empty_cache(1, length), self._replicated)

  def _extend_impl(self, params, tokens_bc, start, lengths_b, cache, routing):
    model = nnx.merge(self._graphdef, params_lib.materialize(params))
    if routing is None:
      return model.extend(tokens_bc, start, cache, lengths_b), None
    cache, chunk_routing = model.extend(tokens_bc, start, cache, lengths_b, return_routing=True)
    return cache, jax.lax.dynamic_update_slice_in_dim(routing, chunk_routing, start, axis=1)

  def _insert_impl(self, prefix_cache, group_cache, arrays, scalars_m7, keys_m):
    """Writes prefixes (rows of one prefill's cache) into slots of one group, one scatter per array.
    scalars rows: slot, prefix row, last token, position, limit, row of the slot in its group,
    tokens generated already; padding rows name a slot and row past the end (dropped)."""
    slot, src, last_token, position, limit, row, _ = (scalars_m7[:, j] for j in range(7))
    sources = jax.tree.map(lambda x: x[src], prefix_cache)  # [M, ...] per array

    def put(dst, new):  # new[m] into row row[m] of dst, leading positions
      dims = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(1, dst.ndim)),
                                             inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))
      return jax.lax.scatter(dst, row[:, None], new.astype(dst.dtype), dims,
                             mode=jax.lax.GatherScatterMode.FILL_OR_DROP)

    group_cache = jax.tree.map(put, group_cache, sources)
    return group_cache, self._start_slots(arrays, scalars_m7, keys_m)

  @staticmethod
  def _start_slots(arrays, scalars_m7, keys_m) -> dict:
    """The per-slot arrays of the slots an insert starts (scalars as in `_insert_impl`)."""
    slot, last_token, position, limit, generated = (scalars_m7[:, j] for j in (0, 2, 3, 4, 6))
    out = dict(arrays)
    for name, value in (("tokens", last_token), ("positions", position), ("num_generated", generated),
                        ("max_new", limit), ("done", False), ("keys", keys_m)):
      out[name] = arrays[name].at[slot].set(value, mode="drop")
    return out

  def _move_impl(self, src_cache, dst_cache, arrays, scalars):
    src, dst, r_src, r_dst = scalars[0], scalars[1], scalars[2], scalars[3]

    def copy_row(to, frm, seq_axis):  # row r_src of frm -> row r_dst of to (windows may differ)
      row = jax.lax.dynamic_slice_in_dim(frm, r_src, 1, axis=0)
      w = to.shape[seq_axis]
      if row.shape[seq_axis] >= w:  # positions past w are unused: move() sized `to` to cover the sequence
        row = jax.lax.slice_in_dim(row, 0, w, axis=seq_axis)
      else:
        pad = [(0, 0)] * row.ndim
        pad[seq_axis] = (0, w - row.shape[seq_axis])
        row = jnp.pad(row, pad)
      return jax.lax.dynamic_update_slice_in_dim(to, row, r_dst, axis=0)

    new_group = kv_cache_lib.KVCache(k=tuple(copy_row(t, f, 3) for t, f in zip(dst_cache.k, src_cache.k)),
                                     v=tuple(copy_row(t, f, 2) for t, f in zip(dst_cache.v, src_cache.v)))
    out = {name: (x if name == "version" else x.at[dst].set(x[src])) for name, x in arrays.items()}
    out["done"] = out["done"].at[src].set(True)
    return new_group, out

  def _release_impl(self, arrays, slot):
    out = dict(arrays)
    out["done"] = arrays["done"].at[slot].set(True)
    return out

  def _generate_impl(self, params, arrays, plan=None):
    model = nnx.merge(self._graphdef, params_lib.materialize(params))
    return self._decode_steps(model, arrays, self.config.steps_per_call, plan)

  def _decode_steps(self, model, arrays, steps: int, plan=None):
    """`steps` decode steps of every slot (traced): (new arrays, GenerateResult of [steps, S] tokens)."""
    sp, record = self._sampling, self.config.record_sampling_mask
    record_routing = self.config.record_routing
    eos = jnp.asarray(self._eos_ids)
    version = arrays["version"]

    def step(carry, _):
      cache, tokens, positions, n_gen, done = carry
      live = ~done
      logits_sv, cache, *routing_slk = model.decode_step(tokens, positions, cache, None,
                                                         return_routing=record_routing, plan=plan)
      u_s = jax.vmap(lambda k, n: jax.random.uniform(jax.random.fold_in(k, n), (), jnp.float32))(
          arrays["keys"], n_gen)
      smp = sampling.sample_with_uniform(logits_sv, u_s, sp, return_mask=record)
      n_gen = n_gen + live.astype(jnp.int32)
      stop = (n_gen >= arrays["max_new"])
      if eos.size:
        stop = stop | jnp.isin(smp.tokens_b, eos)
      tokens = jnp.where(live, smp.tokens_b, tokens)
      positions = jnp.where(live, positions + 1, positions)
      done = done | (live & stop)
      out = (smp.tokens_b, smp.logprobs_b, live) + ((smp.mask_bw,) if record else ()) + tuple(routing_slk)
      return (cache, tokens, positions, n_gen, done), out

    carry = (arrays["cache"], arrays["tokens"], arrays["positions"], arrays["num_generated"],
             arrays["done"])
    carry, outs = jax.lax.scan(step, carry, None, length=steps)
    cache, tokens, positions, n_gen, done = carry
    new = dict(arrays, cache=cache, tokens=tokens, positions=positions, num_generated=n_gen, done=done)
    result = GenerateResult(tokens_ks=outs[0], logprobs_ks=outs[1], valid_ks=outs[2], done_s=done,
                            version=version, mask_ksw=outs[3] if record else None,
                            routing_kslk=outs[-1] if record_routing else None)
    return new, result


jax.tree_util.register_dataclass(
    GenerateResult, data_fields=["tokens_ks", "logprobs_ks", "valid_ks", "done_s", "version", "mask_ksw",
                                "routing_kslk"],
    meta_fields=[])
