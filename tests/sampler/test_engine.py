import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jit_traces import count_traces, engine_counts
from sampler_prompts import VOCAB, random_prompts
from tunixlike.sampler import Engine, PromptError, SamplerConfig, SamplingParams, process_logits, unpack_mask


def _decode_all(engine, params, prompts, keys=None):
  """Runs every prompt in its own slot until done; returns per-prompt (tokens, logprobs, masks)."""
  state = engine.init_decode_state()
  for i, p in enumerate(prompts):
    key = None if keys is None else keys[i]
    state = engine.insert(engine.prefill(params, p), state, i, key=key)
  toks, lps, masks = ([[] for _ in prompts] for _ in range(3))
  for _ in range(100):
    state, res = engine.generate(params, state)
    res = jax.device_get(res)
    for k in range(res.tokens_ks.shape[0]):
      for i in range(len(prompts)):
        if res.valid_ks[k, i]:
          toks[i].append(int(res.tokens_ks[k, i]))
          lps[i].append(float(res.logprobs_ks[k, i]))
          if res.mask_ksw is not None:
            masks[i].append(res.mask_ksw[k, i])
    state = engine.mark_finished(state, res.done_s)
    if res.done_s[:len(prompts)].all():
      return toks, lps, masks
  raise AssertionError("decode did not finish")


@pytest.mark.gpu
def test_greedy_equals_argmax_of_full_forward(tiny_model, make_engine):
  engine = make_engine(temperature=0.0)
  params = engine.load_params()
  prompts = random_prompts(4)
  toks, lps, _ = _decode_all(engine, params, prompts)
  for p, t in zip(prompts, toks):
    assert len(t) == engine.config.max_new_tokens
    seq = np.concatenate([p, t])
    logits = np.asarray(tiny_model(jnp.asarray(seq[None])))[0]
    np.testing.assert_array_equal(logits[len(p) - 1:-1].argmax(-1), t)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_logprobs_and_mask_equal_processed_full_forward(tiny_model, make_engine, kw):
  engine = make_engine(record_sampling_mask=True, **kw)
  params = engine.load_params()
  prompts = random_prompts(4, seed=1)
  keys = [jax.random.PRNGKey(10 + i) for i in range(4)]
  toks, lps, masks = _decode_all(engine, params, prompts, keys)
  sp = SamplingParams(**{"temperature": 1.0, **kw})
  for p, t, lp, m in zip(prompts, toks, lps, masks):
    seq = np.concatenate([p, t])
    logits = tiny_model(jnp.asarray(seq[None]))[0, len(p) - 1:-1]
    ref = np.asarray(process_logits(logits, sp))
    np.testing.assert_allclose(lp, ref[np.arange(len(t)), t], atol=1e-4)
    np.testing.assert_array_equal(unpack_mask(np.stack(m), VOCAB), np.isfinite(ref))
  # Different keys gave different samples (the noise is per slot, not shared).
  assert len({tuple(t) for t in toks}) == len(toks)


@pytest.mark.gpu
def test_eos_stops_exactly_and_is_kept(make_engine):
  greedy = make_engine(temperature=0.0)
  params = greedy.load_params()
  prompts = random_prompts(4, seed=2)
  toks, _, _ = _decode_all(greedy, params, prompts)
  eos = toks[0][4]  # a token the first prompt samples at step 5
  engine = make_engine(temperature=0.0, eos_ids=(eos,))
  cut, _, _ = _decode_all(engine, params, prompts)
  for full, got in zip(toks, cut):
    expect = full[:full.index(eos) + 1] if eos in full else full
    assert got == expect


@pytest.mark.slow
def test_sharded_2x2_matches_single_device(make_engine, mesh_2x2):
  kw = dict(temperature=1.0, max_concurrent_decodes=4)
  prompts = random_prompts(4, seed=3)
  keys = [jax.random.PRNGKey(i) for i in range(4)]
  e1 = make_engine(**kw)
  e4 = make_engine(mesh=mesh_2x2, **kw)
  p4 = e4.load_params()
  state = e4.init_decode_state()
  assert state.arrays["tokens"].sharding.spec == jax.sharding.PartitionSpec("replica")
  t1, l1, _ = _decode_all(e1, e1.load_params(), prompts, keys)
  t4, l4, _ = _decode_all(e4, p4, prompts, keys)
  assert t1 == t4
  np.testing.assert_allclose(np.concatenate(l1), np.concatenate(l4), atol=1e-4)


def test_no_recompilation_after_warmup():
  engine = Engine(_fresh_model(), SamplerConfig(max_prefill_length=32, max_new_tokens=12,
                                                max_concurrent_decodes=4, steps_per_call=3, attend_bucket=16))
  params = engine.load_params()
  cfg = engine.config
  assert cfg.prefill_buckets == (16, 32) and cfg.attend_windows == (16, 32, 48)
  lengths = (1, 2, 5, 8, 11, 16, 13, 3, 31, 20, 17, 32)
  with count_traces() as traces:
    _decode_all(engine, params, random_prompts(4, lengths=lengths, seed=0))  # warm-up
    with count_traces() as again:
      _decode_all(engine, params, random_prompts(4, lengths=lengths, seed=100))  # new ids, same lengths
    assert not any(engine_counts(again).values()), again
    # Many prompts of other lengths: compilations stay within the buckets (one decode program per
    # window, at most two resize programs per window, one prefill per bucket).
    for seed in range(1, 5):
      _decode_all(engine, params, random_prompts(4, lengths=lengths[seed:] + lengths[:seed], seed=seed))
  n_win, n_pre = len(cfg.attend_windows), len(cfg.prefill_buckets)
  counts = engine_counts(traces)
  assert counts["generate"] <= n_win and counts["prefill"] <= n_pre
  assert counts["resize"] <= 2 * n_win and counts["insert"] <= n_pre * n_win


def _fresh_model():
  from flax import nnx
  from tunixlike import models
  cfg = models.tiny_config(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, num_layers=2)
  return models.Transformer(cfg, rngs=nnx.Rngs(1))


def test_bad_prompts_get_clear_errors(make_engine):
  engine = make_engine(temperature=0.0)
  params = engine.load_params()
  with pytest.raises(PromptError, match="empty prompt"):
    engine.prefill(params, np.zeros((0,), np.int32))
  with pytest.raises(PromptError, match="max_prefill_length=16"):
    engine.prefill(params, np.ones((17,), np.int32))
  with pytest.raises(PromptError, match=r"\[0, 128\)"):
    engine.prefill(params, np.array([1, VOCAB], np.int32))
  with pytest.raises(ValueError, match="slot=4"):
    engine.insert(engine.prefill(params, np.ones((3,), np.int32)), engine.init_decode_state(), 4)


def test_bad_config_gets_clear_errors(tiny_model):
  with pytest.raises(ValueError, match=r"eos_ids=\(5, 500\).*\[500\]"):
    Engine(tiny_model, SamplerConfig(max_new_tokens=8, eos_ids=(5, 500)))
  with pytest.raises(ValueError, match=r"^sampler.max_new_tokens is None: an engine needs"):
    Engine(tiny_model, SamplerConfig())  # None is for a run, which sizes it from the data
  with pytest.raises(ValueError, match="group_size=9"):
    SamplerConfig(max_concurrent_decodes=8, group_size=9)
  with pytest.raises(ValueError, match="max_new_tokens"):
    SamplerConfig(max_new_tokens=0)
  with pytest.raises(ValueError, match="top_p"):
    SamplerConfig(top_p=2.0)


def test_bulk_insert_equals_inserting_one_by_one(make_engine):
  """A group's samples inserted in one call (a chunk of 2 and a padded one here) decode exactly as if
  inserted one at a time, each with its own key."""
  engine = make_engine(temperature=1.0, group_size=2)
  params = engine.load_params()
  prefix = engine.prefill(params, random_prompts(1, lengths=(7,), seed=3)[0])
  keys = [jax.random.key_data(jax.random.PRNGKey(i)) for i in (5, 6, 7)]
  slots = [3, 0, 2]
  bulk = engine.bulk_insert(prefix, engine.init_decode_state(), slots, keys=keys, max_new_tokens=9)
  one = engine.init_decode_state()
  for slot, key in zip(slots, keys):
    one = engine.insert(prefix, one, slot, key=key, max_new_tokens=9)
  np.testing.assert_array_equal(bulk.host_live, one.host_live)
  np.testing.assert_array_equal(bulk.host_positions, one.host_positions)
  for _ in range(3):
    bulk, got = engine.generate(params, bulk)
    one, want = engine.generate(params, one)
    np.testing.assert_array_equal(got.tokens_ks, want.tokens_ks)
    np.testing.assert_array_equal(got.logprobs_ks, want.logprobs_ks)
    np.testing.assert_array_equal(got.valid_ks, want.valid_ks)
  assert np.asarray(got.valid_ks)[:, slots].all() and not np.asarray(got.valid_ks)[:, 1].any()
  assert len({tuple(np.asarray(got.tokens_ks)[:, s]) for s in slots}) == 3  # own keys: different samples
  with pytest.raises(ValueError, match="distinct slots"):
    engine.bulk_insert(prefix, engine.init_decode_state(), [1, 1], keys=keys[:2])
