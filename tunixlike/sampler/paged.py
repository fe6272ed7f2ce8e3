"""The decode engine over a paged KV cache (`sampler.kv_layout = "paged"`).

Same API as `engine.Engine` (prefill, insert, generate, release), over a pool of blocks per sampler
replica (`models.paged_cache`) whose ownership the host tracks (`sampler.blocks`):
  * a group's G samples read its prompt's full blocks once; each gets its own copy of the last,
    partly filled one (the copy-on-write happens at insert, since every sample writes there first);
  * a sequence's blocks go back to the pool the moment it ends;
  * the pool is sized by `sampler.kv_cache_bytes`, so how many sequences decode at once depends on
    how long they are, not on the longest one possible;
  * `fits` tells the driver whether new sequences' blocks fit before it admits them, and `reserve`
    gives every live sequence the blocks of its next call, preempting the youngest sequences when
    the pool runs dry (vLLM's recompute policy: the driver prefills a preempted sequence's prompt
    and completion so far again later and it continues where it stopped, same noise, same tokens);
  * `park` keeps a finished turn's KV in the pool without its slot, and `resume_prefill` builds
    the next turn's prefix from it, computing only the positions added since (a multi-turn
    episode does not prefill its history again). Parked KV is a cache: both `fits` and `reserve`
    drop it, oldest first, before refusing a sequence or preempting one.
A decode call attends each pool block once in place for the slot that owns it (`PoolPlan`), or on
TPU reads the block tables with the Pallas kernel (`KernelPlan`); see `paged_cache`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunixlike import mesh as mesh_lib
from tunixlike.models import kv_cache as kv_cache_lib
from tunixlike.models import paged_cache
from tunixlike.sampler import params as params_lib, speculative
from tunixlike.sampler.blocks import BlockTables, OutOfBlocks, SlotBlocks, blocks_for
from tunixlike.sampler.engine import DecodeState, Engine, GenerateResult, ParkedKV, Prefix

ATTENTION = ("auto", "pool", "kernel")  # auto: the Pallas kernel on TPU, the pool attention elsewhere


@dataclasses.dataclass(frozen=True)
class PagedDecodeState(DecodeState):
  tables: BlockTables | None = None  # host bookkeeping of every slot's blocks (updated in place)


class PagedEngine(Engine):
  """`Engine` over a paged cache; see the module docstring."""

  def __init__(self, model, config, mesh=None, rules=mesh_lib.SAMPLER_RULES, *, attention: str = "auto"):
    super().__init__(model, config, mesh, rules)
    if config.kv_layout != "paged":
      raise ValueError(f"PagedEngine needs sampler.kv_layout='paged', got {config.kv_layout!r}")
    if attention not in ATTENTION:
      raise ValueError(f"PagedEngine attention={attention!r}: one of {ATTENTION}")
    self.use_kernel = attention == "kernel" or (attention == "auto" and jax.default_backend() == "tpu")
    mc = self.model_config
    self.replicas = self.mesh.shape["replica"]
    self.block_size = bs = config.kv_block_size
    self._dtype = jnp.dtype(self._cache_dtype or mc.dtype)
    self.block_bytes = paged_cache.bytes_per_block(mc.num_layers, mc.num_kv_heads, bs, mc.head_dim,
                                                   self._dtype.itemsize)
    budget = config.kv_cache_bytes or self._slots_per_replica * blocks_for(config.cache_length, bs) * self.block_bytes
    self.num_blocks = budget // self.block_bytes  # per replica
    need = blocks_for(config.cache_length, bs) + config.group_size
    if self.num_blocks < need:
      raise ValueError(
          f"sampler.kv_cache_bytes={budget}: {self.num_blocks} blocks of {self.block_bytes} bytes per replica "
          f"cannot hold one sequence of max_prefill_length + max_new_tokens ({config.cache_length} positions) "
          f"and its group's {config.group_size} samples: at least {need * self.block_bytes} bytes "
          f"({need} blocks of {bs} positions)")
    self._max_blocks = blocks_for(config.cache_length, bs)  # blocks of the longest sequence
    self.draft_length = speculative.draft_length(config.steps_per_call, config.draft_tokens)  # per slot and verify call
    # positions a slot's next call may write: admission (`fits`) leaves room for a verify call's
    self._most_reach = self._verify_reach(config.steps_per_call) if config.speculative else config.steps_per_call
    small = {k: v for k, v in self._state_shardings(config.cache_length).items() if k != "cache"}
    self._pool_shardings = jax.eval_shape(self._empty_pool).shardings(self.mesh, rules)
    self._paged_shardings = dict(small, cache=self._pool_shardings)
    self._paged_insert_fn = jax.jit(self._paged_insert_impl, donate_argnums=(1, 2),
                                    out_shardings=(self._pool_shardings, small))
    self._paged_generate_fn = jax.jit(self._narrow_generate_impl, donate_argnums=(1,), static_argnames=("width",),
                                      out_shardings=(self._paged_shardings, self._replicated))
    self._verify_fn = jax.jit(self._verify_impl, donate_argnums=(1,), static_argnames=("width", "steps"),
                              out_shardings=(self._paged_shardings, self._replicated))
    self._move_slots_fn = jax.jit(self._move_slots_impl, donate_argnums=(0,), out_shardings=small)
    self._gather_fn = jax.jit(self._gather_impl, static_argnums=(3,), out_shardings=self._replicated)
    self._move_fn = jax.jit(self._move_impl, donate_argnums=(0,), out_shardings=self._pool_shardings)
    self._resize_pool_fn = jax.jit(self._resize_pool_impl, static_argnames=("blocks",),  # a new size: no donation
                                   out_shardings=self._pool_shardings)
    self.compactions = 0  # times blocks in use were moved down to the lowest ids (`_compact`)

  # ------------------------------------------------------------------ state

  def _empty_pool(self, blocks: int | None = None) -> paged_cache.PagedKVCache:
    mc = self.model_config
    return paged_cache.PagedKVCache.zeros(mc.num_layers, self.replicas, mc.num_kv_heads, blocks or self.num_blocks,
                                          self.block_size, mc.head_dim, self._dtype, kernel_layout=self.use_kernel)

  def init_decode_state(self, version: int = 0) -> PagedDecodeState:
    s = self.max_concurrent_decodes
    pool = self._empty_pool(None if self.use_kernel else self.pool_width(1))
    arrays = jax.device_put(dict(self._slot_arrays(version), cache=pool), self._paged_shardings)
    tables = BlockTables(s, self.replicas, self.num_blocks, self.block_size)
    return PagedDecodeState(arrays, np.zeros((s,), np.int64), np.zeros((s,), bool), tables=tables)

  def blocks_in_use(self, decode_state: PagedDecodeState) -> int:
    """Blocks referenced by some sequence, over every replica."""
    return decode_state.tables.blocks_in_use()

  # ------------------------------------------------------------------ admission

  def _first_blocks(self, true_length: int, reach: int | None = None) -> tuple[int, int]:
    """(shared full prompt blocks, own blocks per sample) of a sequence inserted at true_length:
    its own cover the prompt's partly filled block and the positions of its first call (`reach`)."""
    filled = true_length - 1  # KV positions the prefill wrote
    first_call = self._call_end(filled, reach)
    full = filled // self.block_size
    return full, blocks_for(first_call, self.block_size) - full

  def fits(self, decode_state: PagedDecodeState, requests) -> int:
    """How many of `requests` ((true_length, slots) each, in order) can be inserted now: the
    blocks of each request's prompt (once per replica its slots are on) and its samples' own, with
    a watermark left for the live sequences to grow one block past their next call (without it a
    sequence admitted into a full pool is the youngest, preempted at the next call, resumed at
    once, and so on). Parked KV on a replica that is short is dropped (oldest first) to make room.
    With sampler.speculative the first call's room is a verify call's; where even an idle pool has
    too few blocks for that, a plain call's (its verify calls run as plain ones when short)."""
    tables = decode_state.tables
    while True:
      n, short = self._count_fitting(decode_state, requests, self._most_reach)
      if n == 0 and self._most_reach > self.config.steps_per_call and not decode_state.host_live.any():
        n, short = self._count_fitting(decode_state, requests, self.config.steps_per_call)
      if n == len(requests) or not tables.drop_parked(replica=short):
        return n

  def _count_fitting(self, decode_state: PagedDecodeState, requests, reach: int) -> tuple[int, int | None]:
    """(requests that fit in the free blocks above the watermark, the replica that ran short first),
    each sequence's next call writing `reach` positions."""
    tables, bs = decode_state.tables, self.block_size
    free = [p.num_free for p in tables.pools]
    for slot in np.flatnonzero(decode_state.host_live):
      grown = blocks_for(self._call_end(decode_state.host_positions[slot] + bs, reach), bs)
      free[slot // tables.per_replica] -= max(0, grown - len(tables.slots[slot].blocks))
    for n, (true_length, slots) in enumerate(requests):
      full, own = self._first_blocks(true_length, reach)
      need = [0] * self.replicas
      for slot in slots:
        need[slot // tables.per_replica] += own
      for r in {slot // tables.per_replica for slot in slots}:
        need[r] += full
      short = next((r for r in range(self.replicas) if need[r] > free[r]), None)
      if short is not None:
        return n, short
      free = [f - x for f, x in zip(free, need)]
    return len(requests), None

  def reserve(self, decode_state: PagedDecodeState) -> tuple[PagedDecodeState, list[int]]:
    """Gives every live sequence the blocks its next generate call writes into, oldest first; when
    a replica's pool runs dry its parked KV is dropped, then its youngest sequence is preempted
    (blocks freed, slot released).
    Returns (state, preempted slots): the caller re-queues those (prefill prompt + completion so far
    and insert with `generated=`)."""
    tables, live = decode_state.tables, decode_state.host_live.copy()
    preempted = []
    for slot in sorted(np.flatnonzero(live), key=lambda s: tables.slots[s].started):
      while live[slot]:
        try:
          tables.grow(slot, self._call_end(decode_state.host_positions[slot]))
          break
        except OutOfBlocks:
          if tables.drop_parked(replica=slot // tables.per_replica):
            continue
          victim = tables.youngest(slot // tables.per_replica, exclude=preempted)
          tables.free(victim)  # `release` below frees nothing more
          live[victim] = False
          preempted.append(int(victim))
    decode_state = dataclasses.replace(decode_state, host_live=live)
    for slot in preempted:
      decode_state = self.release(decode_state, slot)
    return decode_state, preempted

  def _call_end(self, position, reach: int | None = None) -> int:
    """Positions [0, end) a slot at `position` may have written by the end of its next call, which
    writes `reach` positions (default: a plain call's steps_per_call; a verify call writes its drafts'
    too, `_verify_reach`). Blocks are reserved for plain calls: a verify call takes its drafts' blocks
    when it runs (where the pool has none, it runs as a plain call), so a gate that rarely verifies
    does not hold them (they widen the pool every call attends)."""
    return int(min(position + (reach or self.config.steps_per_call), self.config.cache_length))

  def _verify_reach(self, steps: int) -> int:
    """Positions a verify call of `steps` verify steps writes per slot."""
    return steps * (self.config.draft_tokens + 1) + self.config.steps_per_call - steps

  # ------------------------------------------------------------------ multi-turn

  def park(self, decode_state: PagedDecodeState, slot: int, num_positions: int) -> ParkedKV:
    """Keeps the KV of the slot's positions [0, num_positions) in the pool, without the slot (the
    caller still releases the slot as usual; its blocks are no longer the slot's)."""
    return ParkedKV(key=decode_state.tables.park(slot, num_positions), length=num_positions)

  def discard(self, decode_state: PagedDecodeState, parked: ParkedKV | None) -> None:
    if parked is not None:
      decode_state.tables.drop_parked(key=parked.key)

  def resume_prefill(self, params, decode_state: PagedDecodeState, parked: ParkedKV, tokens, *,
                     version: int = 0) -> Prefix | None:
    """The prefix of `tokens` (the conversation so far, which starts with the parked positions'
    tokens) from the parked KV: only positions from `parked.length` on are computed, in chunks of
    at most `sampler.prefill_chunk` (one program per chunk width and cache bucket). The parked
    blocks go back to the pool. None if the parked KV was dropped (prefill the tokens instead)."""
    entry = decode_state.tables.unpark(parked.key)
    if entry is None:
      return None
    replica, blocks = entry
    ids = self._prompt_ids(tokens, max_length=self.config.cache_length)
    start, n = min(parked.length, len(ids) - 1), len(ids) - 1
    width = min(self.bucket(max(n - start, 1), least=16), self.config.prefill_chunk)
    chunks = -(-(n - start) // width)  # 0 when nothing came since (the last token is decode's first input)
    length = self.prefill_bucket(max(n, start + chunks * width))
    table = np.zeros((blocks_for(length, self.block_size),), np.int32)
    table[:len(blocks)] = blocks
    cache = self._gather_fn(decode_state.arrays["cache"], np.int32(replica), table, length)
    decode_state.tables.pools[replica].release(blocks)
    padded = np.zeros((1, length), np.int32)
    padded[0, :n] = ids[:-1]
    for c in range(chunks):
      at = start + c * width
      cache, _ = self._extend_fn(params, padded[:, at:at + width], np.int32(at), np.asarray([n], np.int32),
                                 cache, None)
    return Prefix(cache=cache, last_token=int(ids[-1]), true_length=len(ids), version=version)

  def _gather_impl(self, pool: paged_cache.PagedKVCache, replica, table, length: int) -> kv_cache_lib.KVCache:
    """One replica's blocks `table`, in order, as a one-row contiguous cache of `length` positions."""
    def k_of(x):
      x = x[replica][:, table]  # [Hkv, n, bs, D] (kernel layout) or [Hkv, n, D, bs]
      x = x.transpose(0, 3, 1, 2) if pool.kernel_layout else x.transpose(0, 2, 1, 3)  # [Hkv, D, n, bs]
      return x.reshape(1, x.shape[0], x.shape[1], -1)[..., :length]

    v_of = lambda x: x[replica][:, table].reshape(1, x.shape[1], -1, x.shape[-1])[:, :, :length]  # [1, Hkv, L, D]
    return kv_cache_lib.KVCache(k=tuple(k_of(x) for x in pool.k), v=tuple(v_of(x) for x in pool.v))

  # ------------------------------------------------------------------ insert

  def insert_many(self, prefixes, decode_state: PagedDecodeState, slots, *, keys, max_new_tokens=None,
                  generated=None) -> PagedDecodeState:
    """As `Engine.insert_many`; the prompt's full blocks are written once per replica and shared by
    its samples there (OutOfBlocks, with nothing taken, if they do not fit: ask `fits` first)."""
    entries = self._insert_entries(prefixes, slots, keys, max_new_tokens, generated)
    seen = {}
    for prefix, slot, *_ in entries:
      seen.setdefault((id(prefix.cache), prefix.row), (prefix.true_length, []))[1].append(slot)
    requests = list(seen.values())
    if self.fits(decode_state, requests) < len(requests):
      raise OutOfBlocks(f"insert: the paged cache has too few free blocks for {len(entries)} new sequences "
                        "(the driver asks PagedEngine.fits first)")
    tables, bs = decode_state.tables, self.block_size
    shared: dict[tuple, list[int]] = {}  # (prefill call, row, replica) -> the prompt's full blocks
    calls: dict[int, tuple] = {}  # prefill call -> (its cache, block writes, slot entries)
    for prefix, slot, key, limit, gen in entries:
      replica = slot // tables.per_replica
      pool = tables.pools[replica]
      full, own_count = self._first_blocks(prefix.true_length)
      call = calls.setdefault(id(prefix.cache), (prefix.cache, [], []))
      where = (id(prefix.cache), prefix.row, replica)
      if where not in shared:
        shared[where] = pool.allocate(full)
        call[1].extend((replica, prefix.row, j, b) for j, b in enumerate(shared[where]))
      own = pool.allocate(own_count)
      if (prefix.true_length - 1) % bs:  # the partly filled block: this sample's copy
        call[1].append((replica, prefix.row, full, own[0]))
      tables.start(slot, shared[where], own)
      call[2].append((prefix, slot, key, limit, gen))
    for (_, _, replica), blocks in shared.items():
      tables.pools[replica].release(blocks)  # the slots hold the references now
    arrays = self._fit_pool(decode_state).arrays
    for cache, writes, call_entries in calls.values():
      arrays = self._paged_insert_call(cache, arrays, writes, call_entries)
    return dataclasses.replace(self._started_on_host(decode_state, entries), arrays=arrays)

  def _paged_insert_call(self, cache, arrays, writes, entries) -> dict:
    rows, bucket = cache.batch_size, cache.max_len
    # Slots per call: the prefill rows' groups (more only when a caller inserts a prefix into more
    # than group_size slots: a program of its own).
    group = rows * self.config.group_size
    width = -(-len(entries) // group) * group
    write_width = rows * blocks_for(bucket, self.block_size) + width
    block_writes = np.zeros((write_width, 4), np.int32)
    block_writes[:, 0] = self.replicas  # padding: an out-of-range replica, dropped
    if writes:
      block_writes[:len(writes)] = writes
    scalars = np.zeros((width, 7), np.int32)
    scalars[:, 0] = self.max_concurrent_decodes
    keys = np.zeros((width, 2), np.uint32)
    for m, (prefix, slot, key, limit, gen) in enumerate(entries):
      scalars[m] = (slot, prefix.row, prefix.last_token, prefix.true_length - 1, limit, 0, gen)
      keys[m] = key
    pool, small = self._split_arrays(arrays)
    pool, small = self._paged_insert_fn(cache, pool, small, block_writes, scalars, keys)
    return dict(small, cache=pool)

  def _paged_insert_impl(self, prefix_cache, pool, arrays, writes_m4, scalars_e7, keys_e):
    """Copies blocks of prefill rows into the pool (writes: replica, row, block index, pool block;
    padding names replica R, dropped) and starts the slots."""
    bs = self.block_size
    replica, row, index, dst = (writes_m4[:, j] for j in range(4))

    def blocks_of(x, seq_axis, positions_minor):  # K [rows, Hkv, D, L] or V [rows, Hkv, L, D] -> per block
      pad = -x.shape[seq_axis] % bs
      if pad:
        x = jnp.pad(x, [(0, pad) if a == seq_axis else (0, 0) for a in range(x.ndim)])
      r, h = x.shape[:2]
      if seq_axis == 3:  # [rows, Hkv, D, nb, bs]
        x = x.reshape(r, h, x.shape[2], -1, bs)
        return x.transpose(0, 3, 1, 2, 4) if positions_minor else x.transpose(0, 3, 1, 4, 2)
      return x.reshape(r, h, -1, bs, x.shape[3]).transpose(0, 2, 1, 3, 4)  # [rows, nb, Hkv, bs, D]

    def put(pool_x, prefix_x, seq_axis, positions_minor=False):
      src = blocks_of(prefix_x, seq_axis, positions_minor)[row, index]  # [M, Hkv, ...] a block each
      return pool_x.at[replica, :, dst].set(src.astype(pool_x.dtype), mode="drop")

    k_minor = not pool.kernel_layout
    pool = paged_cache.PagedKVCache(k=tuple(put(p, x, 3, k_minor) for p, x in zip(pool.k, prefix_cache.k)),
                                    v=tuple(put(p, x, 2) for p, x in zip(pool.v, prefix_cache.v)),
                                    kernel_layout=pool.kernel_layout)
    return pool, self._start_slots(arrays, scalars_e7, keys_e)

  # ------------------------------------------------------------------ generate

  def generate(self, params, decode_state: PagedDecodeState) -> tuple[PagedDecodeState, GenerateResult]:
    """As `Engine.generate`. Every live slot must have its blocks for this call (`reserve`)."""
    decode_state, width, plan = self._before_call(decode_state, "generate")
    arrays, result = self._paged_generate_fn(params, decode_state.arrays, plan, width=width)
    k, live = self.config.steps_per_call, decode_state.host_live
    positions = np.where(live, np.minimum(decode_state.host_positions + k, self.config.cache_length - 1),
                         decode_state.host_positions)
    return PagedDecodeState(arrays, positions, live.copy(), tables=decode_state.tables), result

  def verify(self, params, decode_state: PagedDecodeState, drafts_sd) -> tuple[PagedDecodeState, GenerateResult]:
    """`generate` whose steps verify each slot's draft (`sampler.speculative`): int [S, L] (L =
    `speculative.draft_length`, `speculative.NO_DRAFT` padding), the slot's guess of its next L tokens.
    The call's first v steps (`speculative.verify_steps`: 1 if every draft fits one step, else all
    `steps_per_call`) are each one forward over the slot's next input and the `draft_tokens` draft
    tokens after it (`_verify_body`), emitting the tokens plain decoding samples there up to the first
    that differs from the draft (`speculative.verify`): from 1 token per step (a slot without a draft)
    to draft_tokens + 1; the others are decode steps. The tokens, logprobs and stops are plain
    decoding's; the K/V written at rejected positions lies past the slot's position, so nothing
    attends it, and the next tokens overwrite it. Returns the result fetched to the host (rows: v x
    (draft_tokens + 1) positions, then a row per decode step; a slot's position depends on how much
    of its draft was accepted)."""
    drafts_sd = np.asarray(drafts_sd, np.int32)
    want = (self.max_concurrent_decodes, self.draft_length)
    if drafts_sd.shape != want:
      raise ValueError(f"verify: drafts of shape {drafts_sd.shape}, expected {want} (slots, "
                       "sampler.steps_per_call x (sampler.draft_tokens + 1) - 1)")
    steps = speculative.verify_steps(int((drafts_sd != speculative.NO_DRAFT).sum(1).max()),
                                     self.config.steps_per_call, self.config.draft_tokens)
    try:
      decode_state, width, plan = self._before_call(decode_state, "verify", self._verify_reach(steps))
    except OutOfBlocks:  # no blocks for the drafts' positions now: a plain call (`reserve` gave it its blocks)
      decode_state, result = self.generate(params, decode_state)
      return decode_state, jax.device_get(result)
    arrays, result = self._verify_fn(params, decode_state.arrays, plan, drafts_sd, width=width, steps=steps)
    result = jax.device_get(result)
    live = decode_state.host_live
    positions = np.where(live, np.minimum(decode_state.host_positions + result.valid_ks.sum(0),
                                          self.config.cache_length - 1), decode_state.host_positions)
    return PagedDecodeState(arrays, positions, live.copy(), tables=decode_state.tables), result

  def _before_call(self, decode_state: PagedDecodeState, what: str, reach: int | None = None):
    """Blocks for every live slot's next call (`reach` positions each, `_call_end`), the pool compacted
    and sized: (state, decode width, plan)."""
    tables = decode_state.tables
    for slot in np.flatnonzero(decode_state.host_live):
      try:
        tables.grow(slot, self._call_end(decode_state.host_positions[slot], reach))
      except OutOfBlocks as e:
        raise OutOfBlocks(f"{what}: slot {slot} needs a block and the pool is empty ({e}); "
                          f"call PagedEngine.reserve before {what}") from None
    if not self.use_kernel:
      decode_state = self._fit_pool(self._compact(decode_state))
    width = self.decode_width(decode_state)
    return decode_state, width, self._plan(decode_state, width, reach)

  @staticmethod
  def bucket(n: int, least: int = 1) -> int:
    """Static size of a plan's table width or extra references (one program each): 0 for none,
    else a power of two of at least `least`."""
    return 0 if n <= 0 else max(least, 1 << math.ceil(math.log2(n)))

  def _plan(self, decode_state: PagedDecodeState, slots: int, reach: int | None = None):
    """Which blocks each of the leading `slots` slots per replica reads and writes in one call."""
    if self.use_kernel:
      return self._kernel_plan(decode_state, slots, reach)
    return self._pool_plan(decode_state, slots)

  # ------------------------------------------------------------------ decode width

  def _width(self, slots: int) -> int:
    """Slots per replica a generate call computes when the highest live one is slots - 1: a power
    of two of at least 8 (one program each), or all of them."""
    return min(self.bucket(slots, least=8), self._slots_per_replica)

  def decode_width(self, decode_state: PagedDecodeState) -> int:
    """Each replica's leading slots the next generate call computes: every live one. With budgeted
    admission the pool, not the slot count, bounds how many sequences decode, so most slots may be
    empty; the model's work of an empty slot is as large as a live one's."""
    live = decode_state.host_live.reshape(self.replicas, self._slots_per_replica)
    return self._width(max((int(np.flatnonzero(row)[-1]) + 1 for row in live if row.any()), default=1))

  def compact_slots(self, decode_state: PagedDecodeState) -> tuple[PagedDecodeState, list[tuple[int, int]]]:
    """Moves live sequences from each replica's highest slots into its lowest free ones when that
    narrows the decode width. Cheap here: a sequence's KV stays in its blocks; only its per-slot
    arrays and block table move. Returns (state, moves (src, dst)) for the caller to follow."""
    per, live = self._slots_per_replica, decode_state.host_live
    moves = []
    for r in range(self.replicas):
      local = live[r * per:(r + 1) * per]
      n = int(local.sum())
      if n and self._width(int(np.flatnonzero(local)[-1]) + 1) > self._width(n):
        sources, holes = np.flatnonzero(local[n:]) + n, np.flatnonzero(~local[:n])
        moves += [(r * per + int(s), r * per + int(d)) for s, d in zip(sources, holes)]
    if not moves:
      return decode_state, []
    m = self.bucket(len(moves), least=8)
    src, dst = np.zeros((m,), np.int32), np.full((m,), self.max_concurrent_decodes, np.int32)  # padding: dropped
    src[:len(moves)], dst[:len(moves)] = zip(*moves)
    pool, small = self._split_arrays(decode_state.arrays)
    small = self._move_slots_fn(small, src, dst)
    tables, positions, live = decode_state.tables, decode_state.host_positions.copy(), live.copy()
    for s, d in moves:
      tables.slots[d], tables.slots[s] = tables.slots[s], SlotBlocks()
      positions[d], live[d], live[s] = positions[s], True, False
    return PagedDecodeState(dict(small, cache=pool), positions, live, tables=tables), moves

  @staticmethod
  def _move_slots_impl(small, src_m, dst_m):
    out = {k: v if k == "version" else v.at[dst_m].set(v[src_m], mode="drop") for k, v in small.items()}
    out["done"] = out["done"].at[jnp.where(dst_m < small["done"].shape[0], src_m, dst_m)].set(True, mode="drop")
    return out

  def _narrow_generate_impl(self, params, arrays, plan, *, width: int):
    """`Engine._generate_impl` over each replica's first `width` slots (`_narrowed`)."""
    return self._narrowed(lambda a: self._generate_impl(params, a, plan), arrays, width)

  def _verify_impl(self, params, arrays, plan, drafts_sd, *, width: int, steps: int):
    """`verify`'s program over each replica's first `width` slots (`_narrowed`)."""
    new, result = self._narrowed(lambda a: self._verify_body(params, a, plan, steps), dict(arrays, drafts=drafts_sd),
                                 width)
    del new["drafts"]
    return new, result

  def _narrowed(self, fn, arrays, width: int):
    """fn(arrays) -> (arrays, GenerateResult) over each replica's first `width` slots (the others hold
    nothing), written back into the full arrays; the results cover every slot (the others as empty ones)."""
    r, per = self.replicas, self._slots_per_replica
    if width == per:
      return fn(arrays)
    cache, small = self._split_arrays(arrays)
    per_slot = [k for k in small if k != "version"]
    split = lambda x, axis: x.reshape(*x.shape[:axis], r, x.shape[axis] // r, *x.shape[axis + 1:])
    join = lambda x, axis: x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
    head = lambda x: join(split(x, 0)[:, :width], 0)
    new, result = fn(dict({k: head(small[k]) for k in per_slot}, cache=cache, version=small["version"]))
    put = lambda full, part: join(split(full, 0).at[:, :width].set(split(part, 0)), 0)
    out = dict({k: put(small[k], new[k]) for k in per_slot}, cache=new["cache"], version=new["version"])

    def widen(x):  # [K, R * width, ...] -> [K, R * per, ...], the added slots empty (zeros / False)
      pad = [(0, 0), (0, 0), (0, per - width)] + [(0, 0)] * (x.ndim - 2)
      return join(jnp.pad(split(x, 1), pad), 1)

    result = dataclasses.replace(
        result, tokens_ks=widen(result.tokens_ks), logprobs_ks=widen(result.logprobs_ks),
        valid_ks=widen(result.valid_ks), done_s=out["done"],
        mask_ksw=None if result.mask_ksw is None else widen(result.mask_ksw),
        routing_kslk=None if result.routing_kslk is None else widen(result.routing_kslk))
    return out, result

  def _verify_body(self, params, arrays, plan, verify_steps: int):
    """`verify_steps` verify rounds, then steps_per_call - verify_steps decode steps (traced). Round r
    is one forward over each slot's next input and the draft tokens for the positions after it,
    `draft_tokens` of arrays['drafts'] (the call's draft
    for its next positions, `speculative.NO_DRAFT` padded) from the slot's position in it (the tokens
    it emitted in earlier rounds), accepted by `speculative.verify`. A slot emits 1 to draft_tokens + 1
    tokens per round (a plain step's one without a draft), plain decoding's tokens whatever the draft;
    after a rejected token the next round drafts from the draft's next position, as good a guess as
    any (text past a stray token often goes on as drafted: a policy that writes EOS after EOS)."""
    model = nnx.merge(self._graphdef, params_lib.materialize(params))
    k, record = self.config.draft_tokens, self.config.record_sampling_mask
    drafts = jnp.pad(arrays["drafts"], [(0, 0), (0, k)], constant_values=speculative.NO_DRAFT)  # [S, L + k]
    steps = jnp.arange(k + 1)
    eos = jnp.asarray(self._eos_ids)

    def round_(carry, _):
      cache, tokens, positions, n_gen, done, emitted = carry
      live = ~done
      draft = jnp.take_along_axis(drafts, emitted[:, None] + steps[:-1], axis=1)  # [S, k]
      inputs = jnp.concatenate([tokens[:, None], jnp.maximum(draft, 0)], axis=1)  # [S, T]
      has_input = jnp.concatenate([jnp.ones_like(draft[:, :1], bool), draft != speculative.NO_DRAFT], axis=1)
      logits_stv, cache = model.decode_chunk(inputs, positions[:, None] + steps, cache, plan,
                                             has_input & live[:, None])
      ver = speculative.verify(logits_stv, draft, arrays["keys"], n_gen, self._sampling, return_mask=record)
      emit = (steps <= ver.accepted_s[:, None]) & live[:, None]
      stop = n_gen[:, None] + steps + 1 >= arrays["max_new"][:, None]  # as a decode step stops at the limit
      if eos.size:
        stop = stop | jnp.isin(ver.tokens_st, eos)
      stop = (stop & emit).astype(jnp.int32)
      valid = emit & (jnp.cumsum(stop, axis=1) - stop == 0)  # nothing after the first stop
      count = valid.sum(axis=1).astype(jnp.int32)
      last = jnp.take_along_axis(ver.tokens_st, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
      done = done | jnp.any(valid & (stop > 0), axis=1)
      carry = (cache, jnp.where(count > 0, last, tokens), positions + count, n_gen + count, done, emitted + count)
      mask = (jnp.swapaxes(ver.mask_stw, 0, 1),) if record else ()
      return carry, (ver.tokens_st.T, ver.logprobs_st.T, valid.T) + mask

    carry = (arrays["cache"], arrays["tokens"], arrays["positions"], arrays["num_generated"], arrays["done"],
             jnp.zeros_like(arrays["num_generated"]))
    (cache, tokens, positions, n_gen, done, _), outs = jax.lax.scan(round_, carry, None, length=verify_steps)
    rows = lambda x: x.reshape(-1, *x.shape[2:])  # [rounds, T, S, ...] -> [rounds * T, S, ...], in order
    new = dict(arrays, cache=cache, tokens=tokens, positions=positions, num_generated=n_gen, done=done)
    first = GenerateResult(tokens_ks=rows(outs[0]), logprobs_ks=rows(outs[1]), valid_ks=rows(outs[2]), done_s=done,
                           version=arrays["version"], mask_ksw=rows(outs[3]) if record else None)
    if verify_steps == self.config.steps_per_call:
      return new, first
    new, rest = self._decode_steps(model, new, self.config.steps_per_call - verify_steps, plan)
    cat = lambda a, b: None if a is None else jnp.concatenate([a, b])
    return new, dataclasses.replace(rest, tokens_ks=cat(first.tokens_ks, rest.tokens_ks),
                                    logprobs_ks=cat(first.logprobs_ks, rest.logprobs_ks),
                                    valid_ks=cat(first.valid_ks, rest.valid_ks),
                                    mask_ksw=cat(first.mask_ksw, rest.mask_ksw))

  def _live_blocks(self, decode_state: PagedDecodeState, replica: int):
    """(blocks, local slots, columns) of every block reference of the replica's live slots."""
    tables, per = decode_state.tables, decode_state.tables.per_replica
    slots = [s for s in range(replica * per, (replica + 1) * per) if decode_state.host_live[s]]
    refs = [np.asarray(tables.slots[s].blocks, np.int32) for s in slots]
    if not refs:
      return (np.zeros(0, np.int32),) * 3
    return (np.concatenate(refs), np.repeat(np.asarray(slots, np.int32) % per, [len(r) for r in refs]),
            np.concatenate([np.arange(len(r), dtype=np.int32) for r in refs]))

  def _pool_plan(self, decode_state: PagedDecodeState, slots: int) -> paged_cache.PoolPlan:
    per, nb = slots, decode_state.arrays["cache"].num_blocks  # slots this call computes (padding: `per`, nobody)
    owner = np.full((self.replicas, nb), per, np.int32)
    column = np.zeros((self.replicas, nb), np.int32)
    extras = []
    for r in range(self.replicas):
      blocks, slots, cols = self._live_blocks(decode_state, r)
      first = np.zeros(len(blocks), bool)
      first[np.unique(blocks, return_index=True)[1]] = True  # a shared block's first reader owns it
      owner[r, blocks[first]], column[r, blocks[first]] = slots[first], cols[first]
      extras.append(np.stack([blocks[~first], slots[~first], cols[~first]], axis=1))
    extra = np.zeros((self.replicas, self.bucket(max(len(e) for e in extras), least=8), 3), np.int32)
    extra[:, :, 1] = per  # padding: read by nobody
    for r, e in enumerate(extras):
      extra[r, :len(e)] = e
    return paged_cache.PoolPlan(owner, column, extra)  # every block of the pool as it is sized (`_fit_pool`)

  def _compact(self, decode_state: PagedDecodeState) -> PagedDecodeState:
    """Moves the blocks in use down to the lowest ids when that halves (at least) the leading blocks
    the pool attention reads: after long sequences end, the ones left are scattered over the pool,
    and every step would otherwise read up to the highest of their blocks. A copy of the moved
    blocks' KV (one program per power of two of moves), about once per halving of the blocks in use."""
    tables = decode_state.tables
    moves = []
    for replica, pool in enumerate(tables.pools):
      used = tables.blocks_in_use_of(replica)
      scattered = self.pool_width(pool.highest_in_use() + 1) > self.pool_width(max(used, 1))
      moves.append(tables.compact(replica) if scattered else [])
    if not any(moves):
      return decode_state
    self.compactions += 1
    src, dst = self._move_plan(moves)
    cache = self._move_fn(decode_state.arrays["cache"], src, dst)
    return dataclasses.replace(decode_state, arrays=dict(decode_state.arrays, cache=cache))

  def _move_plan(self, moves: list[list[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
    """[R, M] sources and destinations, M a power of two (>= 8); padding copies a block onto itself
    (a source of that replica, which no move writes to, or block 0 of a replica without moves)."""
    m = self.bucket(max(len(x) for x in moves), least=8)
    src, dst = np.zeros((self.replicas, m), np.int32), np.zeros((self.replicas, m), np.int32)
    for r, mv in enumerate(moves):
      pad = mv[-1][0] if mv else 0
      src[r], dst[r] = pad, pad
      if mv:
        src[r, :len(mv)], dst[r, :len(mv)] = zip(*mv)
    return src, dst

  @staticmethod
  def _move_impl(pool: paged_cache.PagedKVCache, src_rm, dst_rm) -> paged_cache.PagedKVCache:
    move = jax.vmap(lambda x, s, d: x.at[:, d].set(x[:, s]))  # per replica: x [Hkv, NB, ...]
    return paged_cache.PagedKVCache(k=tuple(move(x, src_rm, dst_rm) for x in pool.k),
                                    v=tuple(move(x, src_rm, dst_rm) for x in pool.v), kernel_layout=pool.kernel_layout)

  def _fit_pool(self, decode_state: PagedDecodeState) -> PagedDecodeState:
    """Sizes the pool array (pool attention) to the blocks up to the highest one in use: a power of
    two of them (`pool_width`), so a decode call reads only those, in place. (Reading the leading
    blocks of a full-sized pool instead copies them first, each layer and step: XLA does not slice
    in place; measured 1.4 ms per layer and step at 512 of 1040 blocks, as long as the attention.)
    The allocator hands out the lowest free ids first and `_compact` packs the blocks in use low, so
    the size changes rarely: a copy into an array of the new size, one program per pair of sizes."""
    if self.use_kernel:
      return decode_state
    tables = decode_state.tables
    top = max(pool.highest_in_use() for pool in tables.pools) + 1
    want = self.pool_width(max(top, 1))
    cache = decode_state.arrays["cache"]
    if cache.num_blocks == want:
      return decode_state
    return dataclasses.replace(decode_state, arrays=dict(decode_state.arrays, cache=self._resize_pool_fn(cache, blocks=want)))

  @staticmethod
  def _resize_pool_impl(pool: paged_cache.PagedKVCache, *, blocks: int) -> paged_cache.PagedKVCache:
    def fit(x):
      n = x.shape[2]
      return x[:, :, :blocks] if blocks < n else jnp.pad(x, [(0, blocks - n) if a == 2 else (0, 0) for a in range(x.ndim)])
    return paged_cache.PagedKVCache(k=tuple(map(fit, pool.k)), v=tuple(map(fit, pool.v)), kernel_layout=pool.kernel_layout)

  def pool_width(self, blocks: int) -> int:
    """Blocks of the pool array when the highest in use is `blocks` - 1 (`_fit_pool`; one program
    each): a power of two of at least 16, or the budget's."""
    return min(self.bucket(blocks, least=16), self.num_blocks)

  def _kernel_plan(self, decode_state: PagedDecodeState, slots: int,
                   reach: int | None = None) -> paged_cache.KernelPlan:
    tables, per = decode_state.tables, decode_state.tables.per_replica
    live, pos = decode_state.host_live, decode_state.host_positions
    ends = {int(s): blocks_for(self._call_end(pos[s], reach), self.block_size) for s in np.flatnonzero(live)}
    out = np.zeros((self.replicas, slots, self.bucket(max(ends.values(), default=1))), np.int32)
    for s, n in ends.items():
      out[s // per, s % per, :n] = tables.slots[s].blocks[:n]
    return paged_cache.KernelPlan(out, live.reshape(self.replicas, per)[:, :slots])

  # ------------------------------------------------------------------ ends

  def release(self, decode_state: PagedDecodeState, slot: int) -> PagedDecodeState:
    pool, small = self._split_arrays(decode_state.arrays)
    decode_state.tables.free(slot)
    live = decode_state.host_live.copy()
    live[slot] = False
    return dataclasses.replace(decode_state, arrays=dict(self._release_fn(small, np.int32(slot)), cache=pool),
                               host_live=live)

  def mark_finished(self, decode_state: PagedDecodeState, done_s) -> PagedDecodeState:
    """Slots the device reported done give their blocks back to the pool at once."""
    for slot in np.flatnonzero(decode_state.host_live & np.asarray(done_s, bool)):
      decode_state.tables.free(int(slot))
    return super().mark_finished(decode_state, done_s)

  def plan_insert(self, decode_state, free_slots):
    """The free slot on the replica with the most free blocks."""
    free = [int(s) for s in free_slots]
    if not free:
      raise ValueError("plan_insert: no free slot")
    tables = decode_state.tables
    return max(free, key=lambda s: (tables.pool_of(s).num_free, -s)), None

  def warmup(self, params) -> None:
    """Compiles, for every size the pool array takes (`_fit_pool`; one with the kernel), prefill per
    prompt bucket and batch size and the paged insert of each, generate per decode width and plan
    shape (`_warmup_plans`; verify too with sampler.speculative), compaction's copies and slot moves, and every resize between sizes."""
    lengths: dict[int, int] = {}  # prompt bucket -> a prompt length that lands in it
    for n in range(1, self.max_prefill_length + 1):
      lengths.setdefault(self.prefill_bucket(n - 1), n)
    state, key = self.init_decode_state(), np.zeros((2,), np.uint32)
    no_drafts = np.full((self.max_concurrent_decodes, self.draft_length), speculative.NO_DRAFT, np.int32)
    sizes = [self.num_blocks] if self.use_kernel else self._pool_sizes()
    pool, small = self._split_arrays(state.arrays)
    for size in sizes:
      if pool.num_blocks != size:
        pool = self._resize_pool_fn(pool, blocks=size)
      for other in sizes:  # every resize from this size (not donated: `pool` stays as it is)
        if other != size:
          self._resize_pool_fn(pool, blocks=other)
      for rows in self.config.prompt_batch_sizes:
        for n in lengths.values():
          prefix = self.prefill_many(params, [np.zeros(n, np.int32)] * rows)[0]
          arrays = self._paged_insert_call(prefix.cache, dict(small, cache=pool), [], [(prefix, 0, key, 1, 0)])
          pool, small = self._split_arrays(arrays)
          small = self._release_fn(small, np.int32(0))
      for slots, plan in self._warmup_plans(size):
        arrays, _ = self._paged_generate_fn(params, dict(small, cache=pool), plan, width=slots)
        for steps in sorted({1, self.config.steps_per_call}) if self.config.speculative else ():
          arrays, _ = self._verify_fn(params, arrays, plan, no_drafts, width=slots, steps=steps)
        pool, small = self._split_arrays(arrays)
      n = 1  # compaction's copies: at most half the pool moves
      while not self.use_kernel and n <= max(size // 2, 1):
        pool = self._move_fn(pool, *self._move_plan([[(0, 0)] * n] * self.replicas))
        n = self.bucket(n, least=8) + 1
    n = 1  # slot compaction's moves (padding only)
    while n <= max(self._slots_per_replica * self.replicas // 2, 1):
      small = self._move_slots_fn(small, np.zeros((n,), np.int32), np.full((n,), self.max_concurrent_decodes, np.int32))
      n = self.bucket(n, least=8) + 1
    jax.block_until_ready((pool, small))

  def _pool_sizes(self) -> list[int]:
    return sorted({self.pool_width(1 << k) for k in range(self.num_blocks.bit_length() + 1)})

  def _warmup_plans(self, pool_size: int):
    """(decode width, plan) of every static shape decoding can meet with a pool of `pool_size`
    blocks: per decode width, each table width up to the longest sequence's blocks (kernel), or each
    count of extra references shared prompts can make (pool)."""
    for slots in sorted({self._width(1 << k) for k in range(self._slots_per_replica.bit_length() + 1)}):
      live = np.zeros((self.replicas, slots), bool)
      if self.use_kernel:
        n = 1
        while n <= self.bucket(self._max_blocks):
          yield slots, paged_cache.KernelPlan(np.zeros((self.replicas, slots, n), np.int32), live)
          n *= 2
        continue
      most = slots * (self.max_prefill_length // self.block_size) if self.config.group_size > 1 else 0
      n = 0  # each bucket of shared references, padding only (read by nobody)
      while n == 0 or n <= most:
        x = self.bucket(n, least=8)
        yield slots, paged_cache.PoolPlan(np.full((self.replicas, pool_size), slots, np.int32),
                                          np.zeros((self.replicas, pool_size), np.int32),
                                          np.full((self.replicas, x, 3), [0, slots, 0], np.int32))
        n = x + 1


def make_engine(model, config, mesh=None, rules=mesh_lib.SAMPLER_RULES) -> Engine:
  """The engine `config.kv_layout` names."""
  if config.kv_layout == "paged":
    return PagedEngine(model, config, mesh, rules)
  return Engine(model, config, mesh, rules)
