"""Speculative decoding (sampler.speculative): the tokens and logprobs of plain decoding on the same
keys, whatever the drafts; drafts from a group's samples, its prompt's history and its own text; the
adaptive switch-off; one verify program per decode width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jit_traces import count_traces, engine_counts
from sampler_prompts import VOCAB, random_prompts
from test_engine import _decode_all
from tunixlike.sampler import PromptRequest, RolloutDriver, SamplerConfig, drafts as drafts_lib, sampling
from tunixlike.sampler.speculative import NO_DRAFT, position_uniforms, verify
from tunixlike.settings import ConfigError

SPEC = dict(kv_layout="paged", kv_block_size=4, speculative=True, draft_tokens=4)
SAMPLING = {"temperature 1": dict(temperature=1.0), "top-p and top-k": dict(temperature=1.0, top_p=0.8, top_k=20),
            "greedy": dict(temperature=0.0)}


def test_verify_accepts_the_draft_while_it_equals_plain_decodings_tokens():
  """By hand: 3 positions, a point-mass-like distribution at each (logit 30 on one token), so the
  token sampled there is that token whatever the noise; drafts right, half right and wrong."""
  want = np.array([[7, 2, 9], [7, 2, 9], [7, 2, 9]])
  logits = jnp.asarray(np.where(np.arange(16) == want[..., None], 30.0, 0.0), jnp.float32)  # [S=3, T=3, V=16]
  drafts = jnp.asarray([[7, 2], [7, 5], [1, 2]], jnp.int32)
  keys, n_gen = jnp.zeros((3, 2), jnp.uint32), jnp.asarray([0, 5, 9], jnp.int32)
  out = verify(logits, drafts, keys, n_gen, sampling.SamplingParams(temperature=1.0))
  np.testing.assert_array_equal(out.tokens_st, want)
  np.testing.assert_array_equal(out.accepted_s, [2, 1, 0])
  # The noise of position t is the engine's for token n_gen + t.
  u = position_uniforms(keys, n_gen, 3)
  assert float(u[1, 2]) == float(jax.random.uniform(jax.random.fold_in(keys[1], 7), (), jnp.float32))
  # Each logprob is the processed distribution's: log softmax of the row at the sampled token.
  np.testing.assert_allclose(out.logprobs_st, jax.nn.log_softmax(logits, -1)[0, [0, 1, 2], want[0]][None].repeat(3, 0),
                             rtol=1e-6)


def _verify_all(engine, params, prompts, keys, draft_for):
  """Each prompt in its own slot, decoded by verify calls with draft_for(i, tokens so far) as the
  slot's draft; returns (tokens, logprobs, calls)."""
  state = engine.init_decode_state()
  for i, p in enumerate(prompts):
    state = engine.insert(engine.prefill(params, p), state, i, key=keys[i])
  toks, lps = [[] for _ in prompts], [[] for _ in prompts]
  for calls in range(1, 100):
    drafts = np.full((engine.max_concurrent_decodes, engine.draft_length), NO_DRAFT, np.int32)
    for i in range(len(prompts)):
      d = draft_for(i, toks[i])[:engine.draft_length]
      drafts[i, :len(d)] = d
    state, res = engine.verify(params, state, drafts)
    for k in range(res.tokens_ks.shape[0]):
      for i in range(len(prompts)):
        if res.valid_ks[k, i]:
          toks[i].append(int(res.tokens_ks[k, i]))
          lps[i].append(float(res.logprobs_ks[k, i]))
    state = engine.mark_finished(state, res.done_s)
    if res.done_s[:len(prompts)].all():
      return toks, lps, calls
  raise AssertionError("decode did not finish")


@pytest.mark.parametrize("sampler", list(SAMPLING))
def test_verify_gives_plain_decodings_tokens_with_right_partly_right_and_wrong_drafts(make_engine, sampler):
  kw = dict(SAMPLING[sampler], eos_ids=(3,))
  plain = make_engine(kv_layout="paged", kv_block_size=4, **kw)
  spec = make_engine(**SPEC, **kw)
  params = plain.load_params()
  prompts = random_prompts(4, seed=2)
  keys = [jax.random.PRNGKey(11 + i) for i in range(4)]
  want, want_lps, _ = _decode_all(plain, params, prompts, keys)
  rng = np.random.default_rng(0)
  drafts = {"right": lambda i, t: want[i][len(t):],
            "one wrong": lambda i, t: [x if j != 2 else (x + 1) % VOCAB for j, x in enumerate(want[i][len(t):])],
            "partly right": lambda i, t: want[i][len(t):len(t) + 2] + [int(x) for x in rng.integers(0, VOCAB, 2)],
            "wrong": lambda i, t: [(x + 1) % VOCAB for x in want[i][len(t):]]}
  calls = {}
  for name, draft_for in drafts.items():
    got, lps, calls[name] = _verify_all(spec, params, prompts, keys, draft_for)
    assert got == want, name
    np.testing.assert_allclose(np.concatenate(lps), np.concatenate(want_lps), atol=1e-6, err_msg=name)
  longest = max(len(t) for t in want)
  assert calls["wrong"] == -(-longest // spec.config.steps_per_call)  # a wrong draft costs no tokens
  assert calls["right"] < calls["partly right"] < calls["wrong"]
  # After a rejected token a call's next step verifies the draft from there on: the rest is accepted.
  assert calls["one wrong"] < calls["partly right"]


def test_a_verify_calls_accounting_follows_the_slot_through_the_draft():
  """2 steps x 3 positions, draft_tokens 2: step 0 accepts 7, 2 and emits the bonus 9; step 1 verifies
  the draft from position 3 (4, 5) and accepts 4 only (6 corrects 5)."""
  tokens = np.asarray([7, 2, 9, 4, 6, 1])
  valid = np.asarray([1, 1, 1, 1, 1, 0], bool)
  assert drafts_lib.step_rows(6, 2, 2) == [slice(0, 3), slice(3, 6)]
  assert drafts_lib.verified(tokens, valid, np.asarray([7, 2, 9, 4, 5]), 2, verify_steps=2) == (4, 3)
  short = np.asarray([7, 2, 9, NO_DRAFT, NO_DRAFT])  # no draft for step 1: nothing verified there
  assert drafts_lib.verified(tokens, valid, short, 2, verify_steps=2) == (2, 2)
  # A call of one verify step (every draft fitted it), then a decode step: rows 0-2, then row 3.
  assert drafts_lib.step_rows(4, 2, 2) == [slice(0, 3), slice(3, 4)]
  assert drafts_lib.verified(tokens[:4], valid[:4], short, 2, verify_steps=1) == (2, 2)


def _run(engine, requests, params, drafter=None):
  out = []
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out.append, drafter=drafter)
  driver.run(max_wall_s=300)
  return {g.prompt_id: g for g in out}, driver.stats


@pytest.mark.parametrize("sampler", list(SAMPLING))
def test_speculative_rollouts_equal_plain_ones_on_the_same_keys(make_engine, sampler):
  """Groups of 4 through the driver: the same completions, logprobs within 1e-6 (fp32), versions and
  (top-p / top-k) sampling masks;
  drafts were verified, and with greedy decoding (samples repeat each other) accepted."""
  kw = dict(SAMPLING[sampler], group_size=4, max_new_tokens=24, max_concurrent_decodes=8, eos_ids=(3,),
            record_sampling_mask=sampler == "top-p and top-k")
  plain = make_engine(kv_layout="paged", kv_block_size=4, **kw)
  spec = make_engine(**SPEC, **kw)
  params = plain.load_params()
  requests = [PromptRequest(prompt_id=i, token_ids=p) for i, p in enumerate(random_prompts(6, seed=1))]
  want, plain_stats = _run(plain, requests, params)
  got, stats = _run(spec, requests, params)
  assert sorted(got) == sorted(want) == list(range(6))
  for pid, g in got.items():
    for c, w in zip(g.completions, want[pid].completions):
      np.testing.assert_array_equal(c.token_ids, w.token_ids)
      np.testing.assert_allclose(c.logprobs, w.logprobs, atol=1e-6)
      np.testing.assert_array_equal(c.policy_versions, w.policy_versions)
      assert c.finish_reason == w.finish_reason
      if w.sampling_mask is not None:  # the kept-token sets, one per token
        np.testing.assert_array_equal(c.sampling_mask, w.sampling_mask)
  assert stats.verify_calls > 0 and stats.drafted_tokens > 0
  assert plain_stats.tokens_per_decode_step == 1.0 and plain_stats.verify_calls == 0
  if sampler == "greedy":
    assert stats.draft_acceptance > 0.5 and stats.tokens_per_decode_step > 1.1
    assert stats.generate_calls < plain_stats.generate_calls


def test_drafts_come_from_siblings_history_and_the_sequence_itself():
  drafter = drafts_lib.Drafter(draft_tokens=3, ngram=3, min_acceptance=0.3, history=2, steps_per_call=1)
  prompt = np.asarray([1, 2], np.int32)
  live = lambda slot, index, tokens, budget=10: drafts_lib.Live(slot, 0, index, prompt, tokens, budget)
  # Sample 1 ran ahead: sample 0, at the same text, drafts what followed there.
  out, lengths = drafter.drafts([live(0, 0, [5, 6]), live(1, 1, [5, 6, 7, 8, 9, 4])], num_slots=2)
  np.testing.assert_array_equal(out[0], [7, 8, 9])
  assert lengths[1] == 0  # sample 1's suffix occurs nowhere with a continuation
  # The budget (the sequence's remaining limit - 1) caps the draft.
  out, _ = drafter.drafts([live(0, 0, [5, 6], budget=2), live(1, 1, [5, 6, 7, 8, 9, 4])], num_slots=2)
  np.testing.assert_array_equal(out[0], [7, 8, NO_DRAFT])
  # Its own text: a repeated stretch (no sibling has the suffix).
  out, _ = drafter.drafts([live(0, 2, [40, 41, 42, 43, 40, 41])], num_slots=1)
  np.testing.assert_array_equal(out[0], [42, 43, 40])
  # The prompt's earlier completions: a group started later drafts from what this one wrote.
  for index, tokens in enumerate(([5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 4])):
    drafter.completion((0, index), prompt, tokens, None)
  drafter.group(0, None)
  out, _ = drafter.drafts([drafts_lib.Live(0, 1, 0, prompt, [5, 6, 7], 10)], num_slots=1)
  np.testing.assert_array_equal(out[0], [8, 9, 4])
  assert drafter.drafts([drafts_lib.Live(0, 2, 0, np.asarray([9, 9]), [5, 6, 7], 10)], num_slots=1) is None


def test_a_sequence_whose_drafts_fail_stops_drafting_and_tries_again_later():
  drafter = drafts_lib.Drafter(draft_tokens=4, ngram=3, min_acceptance=0.3, history=0, steps_per_call=1)
  prompt = np.asarray([1, 2], np.int32)
  # A text that repeats itself: every length has a draft, unless the sequence is paused.
  ask = lambda n, index=0: drafter.drafts([drafts_lib.Live(0, 0, index, prompt, ([5, 6, 7, 8] * 100)[:n], 100)], 1)
  for _ in range(drafts_lib.WINDOW - 1):
    assert ask(8) is not None
    drafter.observe(0, 0, drafted=4, accepted=1, length=8)  # 25% < 30%
  assert ask(8) is not None  # judged over WINDOW tries
  drafter.observe(0, 0, drafted=4, accepted=1, length=8)
  assert ask(8) is None and ask(8 + drafts_lib.FIRST_PAUSE - 1) is None  # paused for FIRST_PAUSE tokens
  assert ask(8 + drafts_lib.FIRST_PAUSE) is not None  # then it tries again
  for _ in range(drafts_lib.WINDOW):
    drafter.observe(0, 0, drafted=4, accepted=0, length=30)
  assert ask(30 + 2 * drafts_lib.FIRST_PAUSE - 1) is None  # failing again: a pause twice as long
  assert ask(30 + 2 * drafts_lib.FIRST_PAUSE) is not None
  for _ in range(3 * drafts_lib.WINDOW):  # drafts that are accepted keep it drafting
    drafter.observe(0, 1, drafted=4, accepted=3, length=10)
  assert ask(10, index=1) is not None


def test_nothing_compiles_after_warmup_and_one_verify_program_per_width(make_engine):
  engine = make_engine(temperature=0.0, group_size=2, max_concurrent_decodes=16, kv_cache_bytes=32 * 2048,
                       **{**SPEC, "kv_block_size": 8})
  params = engine.load_params()
  with count_traces() as warm:
    engine.warmup(params)
  # two verify programs per generate program: 1 verify step (short drafts) or steps_per_call
  assert warm["_verify_impl"] == 2 * warm["_narrow_generate_impl"] > 0
  requests = [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=12 if i % 5 == 3 else 4)
              for i, p in enumerate(random_prompts(24, seed=5))]
  # Call times that make every verify call pay: the run verifies at every width it reaches.
  fast_verify = {(steps, w): 1e-3 if steps else 1.0 for steps in (0, 1, 4) for w in (8, 16)}
  with count_traces() as traces:
    _, stats = _run(engine, requests, params, drafts_lib.Drafter.from_config(engine.config, fast_verify))
  assert stats.verify_calls > 0
  assert not any(engine_counts(traces).values()), traces


def test_speculation_needs_the_paged_cache_and_single_turn_rollouts(tiny_model):
  with pytest.raises(ConfigError, match=r"sampler.speculative=True needs sampler.kv_layout='paged'"):
    SamplerConfig(max_new_tokens=8, speculative=True)
  with pytest.raises(ConfigError, match=r"sampler.draft_ngram=1: must be an int >= 2"):
    SamplerConfig(max_new_tokens=8, kv_layout="paged", speculative=True, draft_ngram=1)


def test_a_verify_call_runs_only_where_the_drafts_pay_for_it():
  """The gate by hand: a verify call measured at 3 times a plain call's seconds pays when the drafts
  are expected to add more than twice the tokens the plain call gives (8 live sequences x 4 steps)."""
  prompt = np.asarray([1, 2], np.int32)
  live = [drafts_lib.Live(s, s, 0, prompt, [5, 6, 7, 8] * 3, 100) for s in range(8)]  # each repeats: full drafts
  times = {(0, 8): 1.0, (4, 8): 3.0, (1, 8): 3.0}  # (verify steps, decode width): 0 a plain call
  drafter = drafts_lib.Drafter(draft_tokens=8, ngram=3, min_acceptance=0.3, history=0, steps_per_call=4,
                               call_seconds=times)
  assert drafter.length == 4 * 9 - 1  # a call's 4 steps verify 8 draft tokens each and emit one more
  assert drafter.may_pay(8, width=8)  # 8 x 35 x 0.5 (the prior acceptance) = 140 more: 172 / 3 > 32 / 1
  assert drafter.drafts(live, 8, width=8)[0].shape == (8, 35)
  for g in range(60):  # other sequences' drafts were wrong: the recent acceptance falls toward 0
    drafter.observe(100 + g, 0, drafted=8, accepted=0, length=12)
  # 8 x 35 x 0.023 = 6.4 more: 38.4 / 3 < 32 / 1, and even at half the measured time (no retry)
  assert not drafter.may_pay(8, width=8) and drafter.drafts(live, 8, width=8) is None
  assert drafter.drafts(live, 8, width=None) is not None  # without a width: no gate
  # An unmeasured width: a plain call is measured first, then a verify call.
  assert not drafter.may_pay(8, width=16)
  drafter.timed(False, 16, 5.0)  # the first call of a kind at a width may compile: left out
  drafter.timed(False, 16, 1.0)
  assert times[(0, 16)] == 1.0 and drafter.may_pay(8, width=16)


def test_a_verify_call_is_refused_where_the_sequences_end_within_a_plain_call():
  """A plain call of steps_per_call steps finishes a sequence whose limit or draft's EOS lies within
  them: drafting it saves no call, however fast the verify call (issue 53: the main job's 4-token
  answers). Drafts reaching past the plain call still pay."""
  prompt, eos = np.asarray([1, 2], np.int32), 3
  times = {(0, 8): 1.0, (4, 8): 1.0, (1, 8): 1.0}  # a verify call as cheap as a plain one
  new = lambda: drafts_lib.Drafter(draft_tokens=8, ngram=3, min_acceptance=0.3, history=0, steps_per_call=4,
                                   call_seconds=dict(times), eos_ids=(eos,))
  assert drafts_lib.extra(4, length=20, acceptance=0.5, cap=3) == 0  # the plain call gives all 3
  assert drafts_lib.extra(4, length=20, acceptance=0.5, cap=6) == 1  # 2 more if the draft is taken
  # Limits: 3 tokens left each (budget 2), fewer than the plain call's 4 steps.
  near_limit = [drafts_lib.Live(s, s, 0, prompt, [5, 6, 7, 8] * 3, 2) for s in range(8)]
  assert new().drafts(near_limit, 8, width=8) is None
  # EOS: each sample's sibling wrote its answer and EOS 2 tokens on; the drafts end there.
  drafter = new()
  drafter.completion((0, 1), prompt, [5, 6, 7, 8, eos], None)
  ending = lambda tokens: [drafts_lib.Live(0, 0, 0, prompt, tokens, 100)]
  assert drafter.drafts(ending([5, 6, 7]), 1, width=None)[0][0, :2].tolist() == [8, eos]  # the draft itself
  assert drafter.drafts(ending([5, 6, 7]), 1, width=8) is None  # ends within the call: refused
  assert drafter._groups[0].ends == {0: 5}  # and not looked up again while that end is ahead
  # A sibling that wrote on past the plain call's reach: its draft pays.
  drafter = new()
  drafter.completion((0, 1), prompt, [5, 6, 7] + list(range(10, 30)) + [eos], None)
  assert drafter.drafts(ending([5, 6, 7]), 1, width=8) is not None


def test_a_draft_without_eos_is_refused_where_recent_answers_end_within_the_call():
  """A sequence's own repetition has no EOS, but where the recent completions end at EOS within a plain
  call of the sequence's length (short answers), its draft would end there too: refused. Completions
  ended by their limit, not EOS, say nothing of that."""
  prompt, eos = np.asarray([1, 2], np.int32), 3
  live = [drafts_lib.Live(s, 1000 + s, 0, prompt, [5, 6, 5, 6], 100) for s in range(8)]  # repeats: no EOS ahead
  for ending in ([5, 6, 7, 8, 9, 10, 11, eos], [5] * 8):  # EOS or the limit 4 tokens on
    drafter = drafts_lib.Drafter(draft_tokens=8, ngram=3, min_acceptance=0.3, history=0, steps_per_call=4,
                                 call_seconds={(0, 8): 1.0, (4, 8): 1.0, (1, 8): 1.0}, eos_ids=(eos,))
    assert drafter.drafts(live, 8, width=8) is not None  # no completions seen: it may go on
    for g in range(drafts_lib.MIN_ENDINGS):
      drafter.completion((g, 0), prompt, ending, None)
    assert (drafter.drafts(live, 8, width=8) is None) == (ending[-1] == eos)


def test_a_refused_verify_call_is_measured_again_only_where_it_could_have_paid():
  """After RETRY_EVERY refused calls at a width, one verify call measures again (the measurement may
  have been an unlucky one), if the drafts would have paid were the verify call RETRY_SLOWER times
  faster: never for drafts that are not accepted."""
  prompt = np.asarray([1, 2], np.int32)
  live = [drafts_lib.Live(s, s, 0, prompt, [5, 6, 7, 8] * 3, 100) for s in range(8)]
  for acceptance, retries in ((0.5, 1), (0.02, 0)):  # 140 or 5.6 more tokens than a plain call's 32
    drafter = drafts_lib.Drafter(draft_tokens=8, ngram=3, min_acceptance=0.3, history=0, steps_per_call=4,
                                 call_seconds={(0, 8): 1.0, (4, 8): 6.0, (1, 8): 6.0})  # 172 / 6 < 32; 172 / 3 > 32
    drafter.recent_acceptance = acceptance
    verified = [drafter.may_pay(8, width=8) and drafter.drafts(live, 8, width=8) is not None  # as the driver asks
                for _ in range(drafts_lib.RETRY_EVERY)]
    assert sum(verified) == retries and verified[-1] == bool(retries)


def test_the_survival_of_recent_completions_counts_only_the_latest_endings():
  """`_survives` is counted as completions end, the oldest of the last ENDINGS dropping out: equal to
  counting the recent ones afresh, at every length."""
  prompt, eos = np.asarray([1, 2], np.int32), 3
  drafter = drafts_lib.Drafter(draft_tokens=8, ngram=3, min_acceptance=0.3, history=0, steps_per_call=4,
                               eos_ids=(eos,))
  rng = np.random.default_rng(0)
  endings = []
  for g in range(drafts_lib.ENDINGS + 700):  # long completions first, short ones at the end
    length = int(rng.integers(1, 60 if g < drafts_lib.ENDINGS else 12))
    at_eos = bool(rng.random() < 0.7)
    drafter.completion((g, 0), prompt, [5] * (length - 1) + [eos if at_eos else 5], None)
    endings.append((length, at_eos))
  recent = endings[-drafts_lib.ENDINGS:]
  for done in range(70):
    alive = sum(n > done for n, _ in recent)
    stopped = sum(e and done < n <= done + 4 for n, e in recent)
    want = 1 - stopped / alive if alive >= drafts_lib.MIN_ENDINGS else 1.0
    assert drafter._survives(done) == pytest.approx(want), done


class _AlwaysVerify(drafts_lib.Drafter):
  """A drafter whose gate verifies every draft worth a token, whatever the calls cost."""

  def _pays(self, gain, tokens, width, steps, *, stage="final"):
    return gain >= 1


def test_a_pool_without_blocks_for_the_drafts_runs_plain_calls_and_still_admits(make_engine):
  """A pool too tight for the drafts' positions: `PagedEngine.verify` runs the plain call (blocks are
  reserved for plain calls only) and the driver counts it as a fallback, not a verify call; a request
  that even the idle pool cannot give a verify call's room is admitted with a plain call's (it hung
  before); the completions are plain decoding's. Prompts come twice: the second time their history
  drafts them."""
  kw = dict(temperature=0.0, group_size=2, eos_ids=(3,))
  roomy = make_engine(kv_layout="paged", kv_block_size=4, **kw)
  tight = make_engine(**SPEC, kv_cache_bytes=10 * roomy.block_bytes, **kw)
  params = roomy.load_params()
  requests = [PromptRequest(prompt_id=i, token_ids=p) for i, p in enumerate(random_prompts(6, seed=3) * 2)]
  want, _ = _run(roomy, requests, params)
  rows = []  # per engine.verify call, the rows of its result (steps_per_call: it ran as a plain call)

  def verify(params, state, drafts, method=tight.verify):
    state, result = method(params, state, drafts)
    rows.append(result.valid_ks.shape[0])
    return state, result

  tight.verify = verify
  try:
    got, stats = _run(tight, requests, params, _AlwaysVerify.from_config(tight.config))
  finally:
    del tight.verify
  plain_rows = tight.config.steps_per_call
  assert stats.verify_fallbacks == rows.count(plain_rows) > 0
  assert stats.verify_calls == len(rows) - rows.count(plain_rows) > 0 and stats.accepted_tokens > 0
  assert stats.preemptions > 0  # the pool is tight for plain calls too
  assert {pid: [c.token_ids.tolist() for c in g.completions] for pid, g in got.items()} == \
      {pid: [c.token_ids.tolist() for c in g.completions] for pid, g in want.items()}


def test_text_that_does_not_repeat_is_looked_up_less_and_less_often():
  """A lookup that finds no draft worth a token pauses the sequence's lookups for steps_per_call
  tokens, twice as long after each further one (text that does not repeat costs O(log length)
  lookups, not one per call); a draft found again ends the pauses."""
  prompt, tokens = np.asarray([1, 2], np.int32), []
  drafter = drafts_lib.Drafter(draft_tokens=8, ngram=3, min_acceptance=0.3, history=0, steps_per_call=4,
                               call_seconds={(0, 8): 1.0, (4, 8): 1.0, (1, 8): 1.0})
  looked = []
  for done in range(0, 200, 4):  # 4 new tokens per call, none repeating
    tokens.extend(range(100 + done, 104 + done))
    paused = drafter._control.get((0, 0))
    paused = paused.paused_until if paused else 0
    drafter.drafts([drafts_lib.Live(0, 0, 0, prompt, tokens, 1000)], 1, width=8)
    if drafter._control[(0, 0)].paused_until != paused:
      looked.append(done)
  assert looked == [0, 4, 12, 28, 60, 124]
  tokens.extend([7, 8, 9] * 20)  # now it repeats (and its last pause, 128 tokens from 124, is over)
  assert drafter.drafts([drafts_lib.Live(0, 0, 0, prompt, tokens, 1000)], 1, width=8) is not None
  assert drafter._control[(0, 0)].unfound == 0
