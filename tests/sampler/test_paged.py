"""The paged KV cache (sampler.kv_layout='paged'): the same samples as the contiguous cache, shared
prompt blocks, a memory budget with preemption and recompute, chunked prefill, no compilation after
warm-up, and a property test of the block bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jit_traces import count_traces, engine_counts
from sampler_prompts import random_prompts
from test_driver import _requests, _run, _tokens
from test_engine import _decode_all
from tunixlike.models import paged_cache
from tunixlike.sampler import PagedEngine, PromptRequest, RolloutDriver, SamplerConfig
from tunixlike.sampler.blocks import BlockTables, OutOfBlocks
from tunixlike.settings import ConfigError

PAGED = dict(kv_layout="paged", kv_block_size=4)
MIXED = (1, 3, 7, 12, 5, 16, 9, 2)


def _logprobs(groups):
  return {pid: [c.logprobs for c in g.completions] for pid, g in groups.items()}


@pytest.mark.parametrize("temperature", [1.0])  # greedy: test_paged_greedy_equals_argmax_of_full_forward
def test_paged_decoding_equals_contiguous(make_engine, mesh_2x2, temperature):
  prompts = random_prompts(4, lengths=MIXED)
  keys = [jax.random.PRNGKey(3 + i) for i in range(4)]
  contiguous = make_engine(temperature=temperature)
  params = contiguous.load_params()
  want_tokens, want_lps, _ = _decode_all(contiguous, params, prompts, keys)
  for mesh in (None, mesh_2x2):  # one replica, and two replicas with a pool each
    paged = make_engine(mesh=mesh, temperature=temperature, **PAGED)
    tokens, lps, _ = _decode_all(paged, paged.load_params(), prompts, keys)
    assert tokens == want_tokens
    np.testing.assert_allclose(np.concatenate(lps), np.concatenate(want_lps), atol=1e-5)


@pytest.mark.gpu
def test_paged_greedy_equals_argmax_of_full_forward(tiny_model, make_engine):
  engine = make_engine(temperature=0.0, **PAGED)
  prompts = random_prompts(4, lengths=MIXED[4:])
  tokens, _, _ = _decode_all(engine, engine.load_params(), prompts)
  for p, t in zip(prompts, tokens):
    logits = np.asarray(tiny_model(jnp.asarray(np.concatenate([p, t])[None])))[0]
    np.testing.assert_array_equal(logits[len(p) - 1:-1].argmax(-1), t)


@pytest.mark.gpu
def test_blocks_return_to_the_pool_when_sequences_end(make_engine):
  engine = make_engine(temperature=0.0, **PAGED)
  params = engine.load_params()
  state = engine.init_decode_state()
  prompt = np.arange(1, 11, dtype=np.int32)  # 9 prefilled positions: 2 full blocks of 4 and a partial one
  keys = np.zeros((3, 2), np.uint32)
  state = engine.bulk_insert(engine.prefill(params, prompt), state, [0, 1, 2], keys=keys)
  full, own = engine._first_blocks(len(prompt))
  assert (full, own) == (2, 1)  # positions 9..11 of the first call stay in the partial block
  assert engine.blocks_in_use(state) == full + 3 * own  # the prompt's full blocks once, not per sample
  for _ in range(20):
    state, res = engine.generate(params, state)
    state = engine.mark_finished(state, np.asarray(res.done_s))
  assert not state.host_live.any() and engine.blocks_in_use(state) == 0


def test_shared_prompt_blocks_give_the_samples_of_copied_prompts(make_engine):
  """A group's samples read one copy of the prompt; each equals its sample decoded alone."""
  requests = _requests(6, seed=4)
  grouped = make_engine(temperature=1.0, group_size=4, **PAGED)
  alone = make_engine(temperature=1.0, group_size=4, kv_block_size=4)  # contiguous: every slot its own copy
  got, driver = _run(grouped, requests)
  want, _ = _run(alone, requests, params=grouped.load_params())
  assert _tokens(got) == _tokens(want)
  assert any(len({tuple(t) for t in ts}) > 1 for ts in _tokens(got).values())  # samples differ: no leak


def test_copy_on_write_keeps_shared_blocks_and_other_samples_intact(make_engine):
  engine = make_engine(temperature=1.0, **PAGED)
  params = engine.load_params()
  state = engine.init_decode_state()
  prompt = np.arange(1, 8, dtype=np.int32)  # 6 prefilled positions: one full block, one partial
  keys = np.asarray([[0, i] for i in range(4)], np.uint32)
  state = engine.bulk_insert(engine.prefill(params, prompt), state, [0, 1, 2, 3], keys=keys)
  tables = [list(state.tables.slots[s].blocks) for s in range(4)]
  shared = tables[0][0]
  assert all(t[0] == shared for t in tables) and len({t[1] for t in tables}) == 4  # own partial copies
  before = [np.asarray(x[0, :, shared]) for x in state.arrays["cache"].v]
  state, _ = engine.generate(params, state)
  after = [np.asarray(x[0, :, shared]) for x in state.arrays["cache"].v]
  for b, a in zip(before, after):
    np.testing.assert_array_equal(a, b)  # decoding never writes into the shared block
  # Each sample's own block holds the prompt's last 2 positions, then its own tokens' V.
  pool = np.asarray(state.arrays["cache"].v[0][0])  # [Hkv, NB, bs, D]
  for t in tables:
    np.testing.assert_array_equal(pool[:, t[1], :2], pool[:, tables[0][1], :2])
  assert len({pool[:, t[1], 2:5].tobytes() for t in tables}) == 4


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_preemption_and_recompute_give_the_uninterrupted_completions(make_engine, temperature):
  requests = _requests(8, seed=2)
  roomy = make_engine(temperature=temperature, group_size=2, **PAGED)
  # 8 blocks hold one longest sequence (32 positions) and its group: 4 slots must take turns.
  tight = make_engine(temperature=temperature, group_size=2, kv_cache_bytes=10 * roomy.block_bytes, **PAGED)
  assert tight.num_blocks == 10
  want, _ = _run(roomy, requests)
  got, driver = _run(tight, requests, params=roomy.load_params())
  assert driver.stats.preemptions > 0 and driver.stats.resumed == driver.stats.preemptions
  assert _tokens(got) == _tokens(want)
  for pid in want:
    for a, b in zip(_logprobs(got)[pid], _logprobs(want)[pid]):
      np.testing.assert_allclose(a, b, atol=1e-5)
    for c in got[pid].completions:
      assert np.all(c.policy_versions == 0) and c.finish_reason == "length"


def test_compaction_moves_scattered_blocks_down_and_changes_no_sample(make_engine):
  """Long and short completions interleaved: when the short ones end, the long ones' blocks are
  scattered over the pool; compaction packs them into the lowest ids (so the pool attention reads
  fewer leading blocks) and every sample stays what the contiguous cache gives."""
  limits = [24, 2, 3, 24, 2, 4, 3, 24, 2, 2, 5, 3]
  requests = [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=m)
              for i, (p, m) in enumerate(zip(random_prompts(len(limits), seed=4), limits))]
  contiguous = make_engine(temperature=1.0, max_new_tokens=24)
  paged = make_engine(temperature=1.0, max_new_tokens=24, kv_layout="paged", kv_block_size=2)
  want, _ = _run(contiguous, requests)
  before = paged.compactions
  got, driver = _run(paged, requests, params=contiguous.load_params())
  assert paged.compactions > before
  assert _tokens(got) == _tokens(want)
  for pid in want:
    for a, b in zip(_logprobs(got)[pid], _logprobs(want)[pid]):
      np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("two_replicas", [False, True])
def test_decoding_narrows_to_the_live_slots_and_packs_them_low(make_engine, mesh_2x2, two_replicas):
  """A generate call computes each replica's leading slots up to the highest live one (a power of
  two, at least 8); when short sequences end below long ones, the long ones move down into the
  free slots (their KV stays in its blocks) and every sample is still what the contiguous cache gives."""
  limits = [2, 3, 2, 2, 3, 2, 2, 3, 2, 2, 2, 24, 3, 2, 24, 2] * 2
  requests = [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=m)
              for i, (p, m) in enumerate(zip(random_prompts(len(limits), seed=6), limits))]
  common = dict(temperature=1.0, max_new_tokens=24, max_concurrent_decodes=32 if two_replicas else 16)
  contiguous = make_engine(**common)
  paged = make_engine(mesh=mesh_2x2 if two_replicas else None, **common, **PAGED)
  widths = []
  narrow = paged._paged_generate_fn
  paged._paged_generate_fn = lambda *a, width: widths.append(width) or narrow(*a, width=width)
  try:
    want, _ = _run(contiguous, requests)
    got, driver = _run(paged, requests)  # the same weights (the fixture's model), on the paged engine's mesh
  finally:
    del paged._paged_generate_fn
  assert driver.stats.moves > 0 and widths[0] == 16 and widths[-1] == 8  # slots per replica: 16
  assert _tokens(got) == _tokens(want)
  for pid in want:
    for a, b in zip(_logprobs(got)[pid], _logprobs(want)[pid]):
      np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_chunked_prefill_equals_one_shot(make_engine, layout):
  prompts = random_prompts(4, lengths=(16, 13, 9, 5))
  keys = [jax.random.PRNGKey(i) for i in range(4)]
  kw = dict(temperature=1.0, kv_layout=layout, kv_block_size=4)
  one_shot = make_engine(**kw)
  params = one_shot.load_params()
  want = _decode_all(one_shot, params, prompts, keys)
  chunked = make_engine(prefill_chunk=4, **kw)
  with count_traces() as traces:
    got = _decode_all(chunked, params, prompts, keys)
  assert got[0] == want[0]
  np.testing.assert_allclose(np.concatenate(got[1]), np.concatenate(want[1]), atol=1e-5)
  # Prompts of 4, 8, 12 and 15 prefilled positions (all in the 16 bucket): one chunk program for all.
  assert engine_counts(traces)["extend"] == 1


def test_long_prompts_prefill_a_chunk_per_step_while_others_decode(make_engine):
  prompts = random_prompts(6, lengths=(3, 16, 5, 14, 2, 16))
  requests = [PromptRequest(prompt_id=i, token_ids=p) for i, p in enumerate(prompts)]
  one_shot = make_engine(temperature=1.0, **PAGED)
  want, _ = _run(one_shot, requests)
  chunked = make_engine(temperature=1.0, prefill_chunk=4, **PAGED)
  out = []
  driver = RolloutDriver(chunked, one_shot.load_params(), source=iter(requests), sink=out.append)
  steps = []  # (chunks run, generate calls) per driver step
  while not (driver.exhausted and driver.is_idle):
    before = (driver.stats.prefill_chunks, driver.stats.generate_calls)
    driver.step()
    steps.append((driver.stats.prefill_chunks - before[0], driver.stats.generate_calls - before[1]))
  assert sum(c for c, _ in steps) == 12  # 3 long prompts of 4 chunks each
  assert max(c for c, _ in steps) == 1  # never two chunks back to back
  assert sum(1 for c, g in steps if c and g) >= 9  # the other slots decoded meanwhile
  assert _tokens({g.prompt_id: g for g in out}) == _tokens(want)


@pytest.mark.parametrize("added", [[], [5, 6, 7]])  # nothing since the turn, or an observation
def test_resume_prefill_from_parked_kv_equals_a_full_prefill(make_engine, added):
  engine = make_engine(temperature=0.0, **PAGED)
  params = engine.load_params()
  prompt = np.arange(1, 10, dtype=np.int32)
  state = engine.bulk_insert(engine.prefill(params, prompt), engine.init_decode_state(), [0],
                             keys=np.zeros((1, 2), np.uint32))
  state, res = engine.generate(params, state)
  turn = np.asarray(res.tokens_ks)[:, 0]
  conversation = np.concatenate([prompt, turn])
  parked = engine.park(state, 0, len(conversation) - 1)  # the last token was sampled, not fed
  state = engine.release(state, 0)
  ids = np.concatenate([conversation, np.asarray(added, np.int32)])
  got = engine.resume_prefill(params, state, parked, ids)
  want = engine.prefill(params, ids)
  assert engine.blocks_in_use(state) == 0 and not state.tables.parked  # the parked blocks went back
  assert (got.true_length, got.last_token) == (want.true_length, want.last_token)
  n = len(ids) - 1
  for a, b in zip(got.cache.k, want.cache.k):  # [1, Hkv, D, L]
    np.testing.assert_allclose(np.asarray(a)[..., :n], np.asarray(b)[..., :n], atol=1e-5)
  for a, b in zip(got.cache.v, want.cache.v):  # [1, Hkv, L, D]
    np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b)[:, :, :n], atol=1e-5)


def test_nothing_compiles_after_warmup(make_engine):
  # Blocks of 8 and a budget of 32 (of 2,048 bytes: 2 layers x K, V x 2 KV heads x 8 dims x 4 bytes): two pool
  # sizes to warm up, not four (128 blocks of 4 without a budget), 43 CPU-s instead of 106; the budget bounds
  # admission, and the 16 slots still narrow from width 16 to 8 with slot moves.
  engine = make_engine(temperature=1.0, group_size=2, kv_layout="paged", kv_block_size=8, kv_cache_bytes=32 * 2048,
                       max_concurrent_decodes=16)
  assert engine.num_blocks == 32 and engine._pool_sizes() == [16, 32]
  params = engine.load_params()
  engine.warmup(params)
  requests = [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=12 if i % 5 == 3 else 2)
              for i, p in enumerate(random_prompts(24, seed=5))]
  with count_traces() as traces:
    _, driver = _run(engine, requests, params=params)  # decode widths 16 and 8, slot moves
    _decode_all(engine, params, random_prompts(4, lengths=(16, 2, 11, 7)))
  assert driver.stats.moves > 0
  assert not any(engine_counts(traces).values()), traces


@pytest.mark.gpu
def test_pallas_kernel_equals_pool_attention():
  """The TPU kernel (run here in Pallas's TPU interpret mode) and the plain-JAX pool attention agree,
  a block shared by two slots included, and a block a slot holds ahead of its position (reserved for
  the call's later steps, all of it masked) adds nothing however large its K and V. Each slot has two
  queries at consecutive positions (a verify forward's), each attending up to its own."""
  from jax.experimental.pallas import tpu as pltpu
  rng = np.random.default_rng(0)
  r, slots, hkv, g, d, blocks, bs, t_q = 1, 3, 2, 2, 64, 12, 16, 2
  pool_k = jnp.asarray(rng.normal(size=(r, hkv, blocks, bs, d)), jnp.float32)
  pool_v = jnp.asarray(rng.normal(size=(r, hkv, blocks, bs, d)), jnp.float32)
  pool_k, pool_v = pool_k.at[0, :, 5].set(30.0), pool_v.at[0, :, 5].set(1e4)
  tables = [[3, 1], [3, 7, 9, 2], [4, 5]]  # block 3 is a prompt block slots 0 and 1 share; 5 is ahead of slot 2
  positions = np.asarray([20, 50, 3], np.int32)[:, None] + np.arange(t_q, dtype=np.int32)  # [S, T]
  q = jnp.asarray(rng.normal(size=(slots, t_q, hkv, g, d)), jnp.float32)
  # The K/V written are what the pool already holds at each position: the writes change nothing.
  at = [[(t[p // bs], p % bs) for p in ps] for t, ps in zip(tables, positions)]
  k_new, v_new = (jnp.stack([jnp.stack([x[0, :, b, o] for b, o in row]) for row in at]) for x in (pool_k, pool_v))
  owner, column = np.full((r, blocks), slots, np.int32), np.zeros((r, blocks), np.int32)
  extra = np.zeros((r, 8, 3), np.int32)
  extra[0, :, 1] = slots
  extra[0, 0] = (3, 1, 0)
  padded = np.zeros((r, slots, 4), np.int32)
  for s, t in enumerate(tables):
    padded[0, s, :len(t)] = t
    for j, b in enumerate(t):
      if (s, b) != (1, 3):
        owner[0, b], column[0, b] = s, j
  live = np.ones((r, slots), bool)
  want, _, _ = paged_cache.attend(q, k_new, v_new, positions, jnp.swapaxes(pool_k, 3, 4), pool_v,
                                  paged_cache.PoolPlan(owner, column, extra))
  with pltpu.force_tpu_interpret_mode():
    got, _, _ = paged_cache.attend(q, k_new, v_new, positions, pool_k, pool_v, paged_cache.KernelPlan(padded, live))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2)
  # and the pool attention equals attention over each slot's positions laid out in order
  for s, t in enumerate(tables):
    for j in range(t_q):
      k = np.concatenate([pool_k[0, :, b] for b in t], axis=1)[:, :positions[s, j] + 1]  # [Hkv, L, D]
      v = np.concatenate([pool_v[0, :, b] for b in t], axis=1)[:, :positions[s, j] + 1]
      p = jax.nn.softmax(np.einsum("kgd,kld->kgl", q[s, j], k) / np.sqrt(d), axis=-1)
      np.testing.assert_allclose(np.asarray(want[s, j]), np.einsum("kgl,kld->kgd", p, v), atol=1e-4)


def test_bad_paged_settings_are_one_line_errors(make_engine, tiny_model):
  with pytest.raises(ConfigError, match=r"sampler.kv_block_size=16 does not divide sampler.prefill_chunk=8"):
    SamplerConfig(kv_layout="paged", kv_block_size=16, prefill_chunk=8)
  with pytest.raises(ConfigError, match=r"sampler.kv_block_size=6: must be a power of two"):
    SamplerConfig(kv_layout="paged", kv_block_size=6)
  with pytest.raises(ConfigError, match=r"sampler.slot_groups=2 needs sampler.kv_layout='contiguous'"):
    SamplerConfig(kv_layout="paged", slot_groups=2)
  with pytest.raises(ValueError, match=r"sampler.kv_cache_bytes=4096: .* cannot hold one sequence"):
    PagedEngine(tiny_model, SamplerConfig(max_prefill_length=16, max_new_tokens=12, max_concurrent_decodes=4,
                                          kv_cache_bytes=4096, **PAGED))
  engine = make_engine(temperature=0.0, **PAGED)
  params = engine.load_params()
  state = engine.bulk_insert(engine.prefill(params, np.arange(1, 4, dtype=np.int32)), engine.init_decode_state(),
                             [0], keys=np.zeros((1, 2), np.uint32))
  state, _ = engine.generate(params, state)  # positions 2-4: the blocks insert gave it
  state.tables.pools[0].allocate(state.tables.pools[0].num_free)  # someone else took the rest
  state, _ = engine.generate(params, state)  # 5-7: still its own
  with pytest.raises(OutOfBlocks, match="call PagedEngine.reserve before generate"):
    engine.generate(params, state)  # 8-10: a third block


# ------------------------------------------------------------------ block bookkeeping

_OPS = st.lists(st.tuples(st.sampled_from(["admit", "grow", "finish", "preempt", "compact"]), st.integers(0, 7),
                          st.integers(1, 40), st.integers(1, 4)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_block_tables_never_share_or_leak_a_block(ops):
  tables = BlockTables(num_slots=8, replicas=2, blocks_per_replica=12, block_size=4)
  for op, slot, length, samples in ops:
    pool = tables.pool_of(slot)
    if op == "admit":  # a group: shared prompt blocks, then each sample's own
      lo = slot // tables.per_replica * tables.per_replica
      free_slots = [s for s in range(lo, lo + tables.per_replica) if tables.slots[s].started < 0][:samples]
      if pool.num_free < length // 8 + len(free_slots):
        continue
      prompt = pool.allocate(length // 8)
      own = pool.allocate(len(free_slots))
      for s, b in zip(free_slots, own):
        tables.start(s, prompt, [b])
      pool.release(prompt)
    elif op == "grow" and tables.slots[slot].started >= 0:
      try:
        tables.grow(slot, length)
      except OutOfBlocks:
        victim = tables.youngest(slot // tables.per_replica)
        tables.free(victim)
    elif op in ("finish", "preempt"):
      tables.free(slot if op == "finish" else (tables.youngest(slot // tables.per_replica) or slot))
    elif op == "compact":
      replica = slot // tables.per_replica
      lengths = [len(e.blocks) for e in tables.slots]
      moves = tables.compact(replica)
      used = tables.blocks_in_use_of(replica)
      assert pool.highest_in_use() == used - 1  # packed into [0, used)
      assert all(src >= used > dst for src, dst in moves)
      assert [len(e.blocks) for e in tables.slots] == lengths
    _check(tables)
  for s in range(8):
    tables.free(s)
  _check(tables)
  assert tables.blocks_in_use() == 0


def _check(tables):
  for r, pool in enumerate(tables.pools):
    holders = {}
    for s in range(r * tables.per_replica, (r + 1) * tables.per_replica):
      for b in tables.slots[s].blocks:
        holders[b] = holders.get(b, 0) + 1
    for b in range(pool.num_blocks):
      assert pool.refs(b) == holders.get(b, 0)  # every reference is a table entry, none lost
    assert pool.num_free == pool.num_blocks - len(holders)  # free = unreferenced, none twice
    assert len(set(pool._free)) == len(pool._free)
