"""Episodes with the real tiny model and a scripted tool with real latency on worker threads."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scripted_env import ScriptedEnv
from tunixlike import config as config_lib
from tunixlike.rewards.envs import CalculatorEnv
from tunixlike.sampler import PromptRequest
from tunixlike.sampler.episodes import EpisodeConfig, EpisodeDriver

RUN = config_lib.Config()  # rl.env_* at their defaults


def _requests(tokenizer, specs):
  """specs: list of record dicts; the prompt text is fixed, the record drives the scripted env."""
  out = []
  for i, cols in enumerate(specs):
    text = f"q{i}: 2+{i}="
    out.append(PromptRequest(prompt_id=i, token_ids=np.asarray(tokenizer.encode(text), np.int32),
                             columns=dict(cols), prompt_text=text))
  return out


def _driver(engine, tokenizer, requests, params=None, **ec):
  holder = {}
  out = []
  driver = EpisodeDriver(
      engine, params if params is not None else engine.load_params(), source=iter(requests), sink=out.append,
      make_env=lambda: ScriptedEnv(probe=lambda: holder["d"].stats.generate_calls),
      tokenize=lambda t: tokenizer.encode(t, add_special_tokens=False), detokenize=tokenizer.decode,
      episode_config=EpisodeConfig.from_config(RUN, **{"max_turn_tokens": 6, "max_turns": 3, **ec}))
  holder["d"] = driver
  return driver, out


def _segments(mask):
  """[(start, end, value)] runs of equal values."""
  edges = np.flatnonzero(np.diff(mask)) + 1
  starts, ends = np.r_[0, edges], np.r_[edges, len(mask)]
  return [(int(s), int(e), int(mask[s])) for s, e in zip(starts, ends)]


@jax.jit
def _log_softmax_forward(graphdef, state, tokens_bt):
  return jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens_bt).astype(jnp.float32), axis=-1)


def _teacher_forced_logprobs(model, prompt, tokens, pad_to=128):
  """log p(token_t | everything before it) under a full causal forward (right-padded: one compile)."""
  seq = np.zeros((1, pad_to), np.int32)
  n = len(prompt) + len(tokens)
  seq[0, :n] = np.concatenate([prompt, tokens])
  graphdef, state = nnx.split(model)
  lp = np.asarray(_log_softmax_forward(graphdef, state, seq))[0, len(prompt) - 1:n - 1]
  return lp[np.arange(len(tokens)), tokens]


def test_slow_tool_does_not_stall_other_slots_and_env_tokens_are_masked(make_engine, tokenizer, tiny_model):
  engine = make_engine(temperature=1.0, group_size=2)
  # Prompt 0 waits 0.2 s on its tool every turn; the other prompts' tools answer at once.
  specs = [dict(latency_s=0.2, turns=2)] + [dict(turns=3) for _ in range(5)]
  requests = _requests(tokenizer, specs)
  driver, out = _driver(engine, tokenizer, requests)
  driver.run(max_wall_s=60)
  groups = {g.prompt_id: g for g in out}
  assert sorted(groups) == list(range(6)) and driver.stats.env_errors == driver.stats.env_timeouts == 0

  # (a) While a prompt-0 episode waited on its first slow step, the engine kept decoding others.
  slow = groups[0].reward_metrics
  assert slow["env/calls_during_step"] >= 2 * 5  # per episode, summed over its 2 steps; >= 5 per wait on average
  assert driver.stats.episodes == 12 and driver.stats.aborted_episodes == 0

  for pid, g in groups.items():
    turns = specs[pid]["turns"]
    assert g.group_size == 2
    # Step rewards 0.25 per answered turn and 1.0 at the end, summed.
    np.testing.assert_allclose(g.rewards, [0.25 * (turns - 1) + 1.0] * 2)
    for c in g.completions:
      assert c.finish_reason in ("eos", "stop", "length")
      segs = _segments(c.loss_mask)
      policy = [s for s in segs if s[2] == 1]
      env = [s for s in segs if s[2] == 0]
      # (b) policy turns and env observations alternate; env text is exactly what the env said.
      assert len(policy) == turns and len(env) == turns - 1 and segs[0][2] == 1
      for n, (s, e, _) in enumerate(env, start=1):
        assert tokenizer.decode(c.token_ids[s:e]) == f" obs{n}."
        assert np.all(c.logprobs[s:e] == 0.0)
      for s, e, _ in policy:
        assert 1 <= e - s <= 6 and np.all(c.logprobs[s:e] < 0)
      assert np.all(c.policy_versions == 0)
      # Each policy turn was sampled from the model given the whole conversation before it
      # (prompt, earlier turns and observations): the re-prefill is right.
      ref = _teacher_forced_logprobs(tiny_model, g.prompt_token_ids, c.token_ids)
      on = c.loss_mask == 1
      np.testing.assert_allclose(c.logprobs[on], ref[on], atol=2e-4)
      assert c.text == tokenizer.decode(c.token_ids)
  s = driver.stats
  assert s.env_tokens == sum(int((c.loss_mask == 0).sum()) for g in out for c in g.completions)
  assert s.tokens_generated == sum(int(c.loss_mask.sum()) for g in out for c in g.completions)


def test_weight_swap_mid_episode_records_versions_per_token(make_engine, tokenizer, tiny_model):
  engine = make_engine(temperature=1.0, group_size=2)
  params = engine.load_params()
  requests = _requests(tokenizer, [dict(latency_s=0.1, turns=3) for _ in range(4)])
  driver, out = _driver(engine, tokenizer, requests, params=params)
  deadline = time.monotonic() + 30
  # Decode until some episode waits on its tool (after a policy turn) while others are mid-turn.
  while not (driver.stats.policy_turns and driver.episodes_waiting_on_env and driver.episodes_decoding):
    assert time.monotonic() < deadline
    if not driver.step():
      time.sleep(0.005)
  noisy = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(1), x.shape, x.dtype), params)
  driver.update_params(noisy, version=5)
  driver.run(max_wall_s=60)
  assert len(out) == 4 and driver.stats.param_swaps == 1

  graphdef, _ = nnx.split(tiny_model)
  new_model = nnx.merge(graphdef, noisy)
  mixed = resumed_turns = 0
  for g in out:
    for c in g.completions:
      pol = c.policy_versions[c.loss_mask == 1]
      assert set(pol.tolist()) <= {0, 5} and np.all(np.diff(pol) >= 0)  # never goes back to old weights
      mixed += 0 in pol and 5 in pol
      assert np.all(c.policy_versions[1:] >= c.policy_versions[:-1])
      # A turn that started after the swap was prefilled and decoded with the new weights only.
      ref = _teacher_forced_logprobs(new_model, g.prompt_token_ids, c.token_ids)
      for s, e, m in _segments(c.loss_mask):
        if m == 1 and c.policy_versions[s] == 5:
          np.testing.assert_allclose(c.logprobs[s:e], ref[s:e], atol=2e-4)
          resumed_turns += 1
  assert mixed >= 1
  assert resumed_turns >= 1


def test_timeout_crash_or_garbage_costs_only_that_episode(make_engine, tokenizer):
  engine = make_engine(temperature=1.0, group_size=2)
  specs = [dict(turns=2), dict(turns=2, latency_s=3.0), dict(turns=2, fail="raise"), dict(turns=2),
           dict(turns=2, fail="garbage")]
  driver, out = _driver(engine, tokenizer, _requests(tokenizer, specs), step_timeout_s=0.3, failure_reward=-1.0,
                        env_workers=2)
  driver.run(max_wall_s=60)
  groups = {g.prompt_id: g for g in out}
  assert sorted(groups) == list(range(5))
  for pid in (0, 3):
    assert all(c.finish_reason != "aborted" for c in groups[pid].completions)
    np.testing.assert_allclose(groups[pid].rewards, [1.25, 1.25])
  for pid in (1, 2, 4):
    g = groups[pid]
    assert [c.finish_reason for c in g.completions] == ["aborted"] * 2
    np.testing.assert_allclose(g.rewards, [-1.0, -1.0])
    assert g.reward_metrics["env/failed"] == 1.0
    for c in g.completions:  # the policy's turn before the failure is kept, with its logprobs
      assert c.num_tokens >= 1 and np.all(c.loss_mask == 1)
  s = driver.stats
  assert s.env_timeouts == 2 and s.env_errors == 4 and s.aborted_episodes == 6 and s.episodes == 10


def test_calculator_env_with_the_real_model_and_length_limits(make_engine, tokenizer):
  engine = make_engine(temperature=1.0, group_size=2)
  requests = [PromptRequest(prompt_id=i, token_ids=np.asarray(tokenizer.encode(f"{i}+3="), np.int32),
                            columns={"answer": str(i + 3)}) for i in range(4)]
  out = []
  driver = EpisodeDriver(engine, engine.load_params(), source=iter(requests), sink=out.append,
                         make_env=lambda: CalculatorEnv(latency_s=0.05),
                         tokenize=lambda t: tokenizer.encode(t, add_special_tokens=False),
                         detokenize=tokenizer.decode,
                         episode_config=EpisodeConfig.from_config(RUN, max_episode_tokens=5))
  driver.run(max_wall_s=60)
  assert len(out) == 4 and driver.stats.env_errors == driver.stats.env_timeouts == 0
  for g in out:
    for c, r in zip(g.completions, g.rewards):
      assert 1 <= c.num_tokens <= 5 and np.all(c.loss_mask == 1)  # random text: a final answer at once
      assert r in (0.0, 1.0) and g.reward_metrics["env/final_answer"] == 1.0


@pytest.mark.parametrize("kw, fragment", [
    (dict(max_turns=0), "max_turns"), (dict(step_timeout_s=-1), "step_timeout_s"),
    (dict(reward_aggregation="max"), "reward_aggregation"), (dict(action_stop_strings=("",)), "action_stop"),
    (dict(max_episode_tokens=0), "max_episode_tokens"), (dict(failure_reward=float("inf")), "failure_reward"),
])
def test_bad_episode_config(kw, fragment):
  with pytest.raises(ValueError, match=fragment):
    EpisodeConfig.from_config(RUN, **kw)
