"""Process rewards on partial rollouts: step boundaries, PRM calls pipelined with decoding (real threads,
real engine, timestamps from the trace), failures, and per-token advantages consumed by a learner step."""

import dataclasses
import json
import pathlib
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from tunixlike import config as config_lib, models, trace
from tunixlike.data import char_tokenizer
from tunixlike.learner import batch as batch_lib, token_advantages as tok_adv
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.learner.train_step import Learner
from tunixlike.rewards import process
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler import Engine, PromptRequest, RolloutDriver, SamplerConfig
from tunixlike.sampler.process_steps import ProcessRewardRecorder

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"

VOCAB = 64
RUN = config_lib.Config()  # algo.step_* and rl.reward_* at their defaults


def _completion(ids, logprobs=None):
  ids = np.asarray(ids, np.int32)
  lp = np.full(len(ids), -1.0, np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
  return Completion(ids, lp, np.zeros(len(ids), np.int32), "eos")


def test_step_boundaries_at_a_delimiter_and_every_n_tokens():
  tok = char_tokenizer.build()
  ids = tok.encode("12\n3\n\n45", add_special_tokens=False)
  newline = process.StepConfig.from_config(RUN, delimiter="\n")
  ends = [t for t in range(len(ids)) if newline.is_boundary(ids[:t + 1], tok.decode)]
  assert ends == [2, 4, 5]  # each newline token ends a step
  two_chars = process.StepConfig.from_config(RUN, delimiter="\n\n")  # spanning two tokens: ends at the second
  assert [t for t in range(len(ids)) if two_chars.is_boundary(ids[:t + 1], tok.decode)] == [5]
  every3 = process.StepConfig.from_config(RUN, delimiter="", every_tokens=3)
  assert [t for t in range(9) if every3.is_boundary(list(range(t + 1)), None)] == [2, 5, 8]
  with pytest.raises(ValueError, match="step boundaries"):  # checked where the keys are: the run's config
    config_lib.replace(RUN, algo=dict(process_reward="answer_prefix", step_delimiter="", step_every_tokens=0))


def test_process_supervised_advantages_match_the_hand_computation():
  c0, c1 = _completion([5, 6, 7, 8]), _completion([9, 10, 11])
  c0.step_ends, c0.step_rewards = np.array([1, 3], np.int32), np.array([1.0, 0.0], np.float32)
  c1.step_ends, c1.step_rewards = np.array([2], np.int32), np.array([1.0], np.float32)
  group = RolloutGroup("p", np.array([1, 2], np.int32), [c0, c1], rewards=np.array([1.0, 0.0], np.float32))
  # R = {1, 0, 1}: mean 2/3, population std sqrt(2/9); normalised 1/sqrt(2), -sqrt(2), 1/sqrt(2).
  hi, lo = 1 / np.sqrt(2), -np.sqrt(2)
  a0, a1 = tok_adv.process_supervised(group)
  np.testing.assert_allclose(a0, [hi + lo, hi + lo, lo, lo], rtol=1e-5)  # steps at or after each token
  np.testing.assert_allclose(a1, [hi, hi, hi], rtol=1e-5)
  # Through assemble_batch: outcome advantage (GRPO: +-1/sqrt(2) for two samples) + coef * process term.
  b = batch_lib.assemble_batch([group], num_rows=2, seq_buckets=(8,), sampling_mask=False, routing=False,
                               unscored=dataclasses.replace(UNSCORED,
                                                            token=tok_adv.TokenAdvantageConfig(process_coef=0.5)))
  out = 1 / np.sqrt(2)
  np.testing.assert_allclose(b["token_advantages"][0, 2:6], out + 0.5 * a0, atol=1e-5)
  np.testing.assert_allclose(b["token_advantages"][1, 2:5], -out + 0.5 * a1, atol=1e-5)
  assert not b["token_advantages"][0, :2].any() and not b["token_advantages"][1, 5:].any()
  c1.step_ends = np.array([3], np.int32)  # past the completion's 3 tokens
  with pytest.raises(ValueError, match=r"completions\[1\].step_ends"):
    tok_adv.process_supervised(group)


def test_a_failing_or_slow_prm_call_costs_only_its_own_step():
  release, stuck_finished = threading.Event(), threading.Event()

  def prm(prefix):
    last = int(prefix.token_ids[-1])
    if last == 13:
      raise RuntimeError("grader crashed")
    if last == 14:
      return float("nan")
    if last == 15:
      release.wait(30)  # misses the deadline
      stuck_finished.set()
    return float(len(prefix.token_ids))

  steps = process.StepConfig.from_config(RUN, every_tokens=1, workers=2)
  scorer = process.ProcessRewardScorer(prm, name="lengths", steps=steps)
  c = _completion([11, 12, 13, 14, 15, 16])
  group = RolloutGroup("p", np.array([1], np.int32), [c])
  handles = [[(t, scorer.submit(process.Prefix(np.array([1]), c.token_ids[:t + 1], None))) for t in range(6)]]
  scorer.attach(group, handles)
  metrics = scorer.collect(group, timeout_s=0.5)
  assert not stuck_finished.is_set()  # the group waited for its deadline, not for the stuck call
  release.set()
  np.testing.assert_array_equal(c.step_ends, np.arange(6))
  np.testing.assert_array_equal(c.step_rewards, [1, 2, 0, 0, 0, 6])
  assert metrics["process_reward/failures"] == 3 and metrics["process_reward/timeout_failures"] == 1
  assert scorer.failures == 3 and scorer.timeouts == 1 and scorer.calls == 6
  with pytest.raises(ValueError, match="no process-reward calls attached"):
    scorer.collect(group)  # collected twice
  scorer.close()


@pytest.fixture(scope="module")
def engine():
  cfg = models.tiny_config(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, num_layers=2)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "tensor"))
  scfg = SamplerConfig(max_concurrent_decodes=4, max_prefill_length=16, max_new_tokens=12, steps_per_call=1,
                       attend_bucket=16, group_size=2, temperature=1.0, eos_ids=(), seed=0)
  return Engine(model, scfg, mesh)


def test_prm_calls_run_while_decoding_continues_and_land_at_their_step_ends(engine, tmp_path):
  """A PRM on 2 worker threads whose calls are held until decoding is over, a step every 3 tokens:
  the decode loop ends with every PRM call submitted and none finished (it never waited for one),
  generate calls ran while PRM calls were in flight (the trace's spans), and every step reward
  belongs to the prefix ending at its recorded token index."""
  seen, decoding_over = [], threading.Event()
  lock = threading.Lock()

  def prm(prefix):  # a deterministic function of the prefix, so each reward can be traced to its tokens
    if not decoding_over.wait(30):  # a decode loop that waits for its PRM calls gets here
      decoding_over.set()
    with lock:
      seen.append(len(prefix.token_ids))
    return float(len(prefix.token_ids)) + float(prefix.token_ids[-1]) / 1000.0

  tracer = trace.Tracer(tmp_path / "trace.json")
  scorer = process.ProcessRewardScorer(prm, name="len", tracer=tracer,
                                       steps=process.StepConfig.from_config(RUN, delimiter="", every_tokens=3,
                                                                            workers=2))
  rng = np.random.default_rng(0)
  requests = [PromptRequest(prompt_id=i, token_ids=rng.integers(1, VOCAB, size=4).astype(np.int32))
              for i in range(4)]
  RolloutDriver(engine, engine.load_params(), source=iter(requests), sink=lambda g: None).run(max_wall_s=120)  # compile
  groups = []
  driver = RolloutDriver(engine, engine.load_params(), source=iter(requests), sink=groups.append, tracer=tracer,
                         recorders=[ProcessRewardRecorder(scorer)])
  driver.run(max_wall_s=120)
  assert scorer.calls == 4 * 2 * 4 and seen == []  # every call submitted, none finished: no wait in decoding
  decoding_over.set()
  for g in groups:  # the reward stage
    scorer.collect(g)
  tracer.save()
  scorer.close()

  assert sorted(g.prompt_id for g in groups) == [0, 1, 2, 3]
  for g in groups:
    for c in g.completions:
      assert c.num_tokens == 12
      np.testing.assert_array_equal(c.step_ends, [2, 5, 8, 11])
      want = [len(c.token_ids[:e + 1]) + c.token_ids[e] / 1000.0 for e in c.step_ends]
      np.testing.assert_allclose(c.step_rewards, want, rtol=1e-6)
  assert len(seen) == 32 and scorer.failures == 0

  events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
  spans = lambda name: [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e["name"] == name]
  gen, prm_calls = spans("generate"), spans("prm")
  assert len(prm_calls) == 32
  # Generate calls started while a PRM call was running, and PRM calls ran on after decoding ended.
  during = [s for s, _ in gen if any(a < s < b for a, b in prm_calls)]
  assert len(during) >= 5, (len(during), len(gen))
  assert max(b for _, b in prm_calls) > gen[-1][1]


def test_a_learner_step_consumes_per_token_process_advantages():
  """The loss is -mean_rows mean_t A_t at ratio 1 (behaviour = learner logprobs, so every IS weight is 1):
  with process rewards it uses each token's own A_t, and it differs from the outcome-only loss."""
  cfg = models.tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8)
  c0, c1 = _completion([5, 6, 7, 8]), _completion([9, 10, 11, 12])
  c0.step_ends, c0.step_rewards = np.array([1, 3], np.int32), np.array([1.0, 0.0], np.float32)
  c1.step_ends, c1.step_rewards = np.array([0, 3], np.int32), np.array([0.0, 1.0], np.float32)
  group = RolloutGroup("p", np.array([1, 2, 3], np.int32), [c0, c1], rewards=np.array([1.0, 1.0], np.float32))
  learner = Learner(models.Transformer(cfg, rngs=nnx.Rngs(0)),
                    LearnerConfig(algo=AlgoConfig(), optim=OptimConfig(learning_rate=1e-3)))
  losses = {}
  for name, tcfg in (("outcome", None), ("process", tok_adv.TokenAdvantageConfig(process_coef=1.0))):
    host = batch_lib.assemble_batch([group], num_rows=2, seq_buckets=(8,), sampling_mask=False, routing=False,
                                    unscored=dataclasses.replace(UNSCORED, token=tcfg))
    logp = np.asarray(learner.token_logprobs(learner.state, learner.put_batch(host)))[0]
    host["behaviour_logprobs"] = logp * host["loss_mask"]  # behaviour = learner: every IS weight is 1
    placed = learner.put_batch(host)
    if tcfg is None:  # no update: the loss of the outcome-only batch at the same weights
      losses[name] = float(learner.loss_and_grads(learner.state, placed)[0])
      continue
    learner.state, metrics = learner.train_step(learner.state, placed, jax.random.PRNGKey(0))
    losses[name] = float(metrics["pg_loss"])
    adv = host["token_advantages"]
    assert len(np.unique(np.round(adv[0, 3:7], 5))) == 2  # tokens of different steps differ
    mask = host["loss_mask"]
    want = -np.mean([(adv[r] * mask[r]).sum() / mask[r].sum() for r in range(2)])
    assert losses[name] == pytest.approx(want, rel=1e-4, abs=1e-5)
  assert losses["outcome"] == pytest.approx(0.0, abs=1e-6)  # equal outcome rewards: no signal
  assert abs(losses["process"]) > 1e-3


@pytest.mark.slow
def test_process_rewards_train_through_the_async_runtime():
  """algo.process_reward through the trainer: the driver hands per-digit prefixes to the registered
  `answer_prefix` PRM, the reward stage collects them, and the learner trains on per-token advantages."""
  from tunixlike import config as config_lib
  from tunixlike.rl import build
  from tunixlike.rl.prompts import PromptStream

  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  cfg = config_lib.replace(cfg, data=dict(digits=2, num_eval_examples=16), warm_start=dict(max_steps=0),
                           log=dict(progress_bar=False, tensorboard=False), sampler=dict(max_concurrent_decodes=16),
                           algo=dict(process_reward="answer_prefix", step_delimiter="", step_every_tokens=1),
                           rl=dict(num_steps=2, prompts_per_step=4))
  setup = build.build(cfg)
  assert len(setup.train_pipe.source) == cfg.data.train_size == 4096  # the tiny config's generated problems
  rl = build.build_rl(setup)
  assert rl.scorer.advantages.token == tok_adv.TokenAdvantageConfig(process_coef=1.0)
  records = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: records.append(info.metrics))
  runtime.run()
  assert rl.policy.version == 2 and len(records) == 2
  for m in records:
    assert m["process_reward/failures"] == 0
    assert m["process_reward/steps_per_completion"] >= 1  # one step per generated token (the last closes one too)
    assert 0.0 <= m["process_reward/mean"] <= 1.0 and np.isfinite(m["loss"])
  rl.close()


def test_a_language_model_as_prm_scores_p_good_after_the_prefix():
  cfg = models.tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8)
  model = models.Transformer(cfg, rngs=nnx.Rngs(5))
  prefix = process.Prefix(np.array([3, 4, 5], np.int32), np.array([6, 7], np.int32), None)
  logits = np.asarray(model(jax.numpy.asarray([[3, 4, 5, 6, 7]])))[0, -1]
  p = np.exp(logits - logits.max())
  p /= p.sum()
  assert process.TokenProbPRM(model, good_id=9, bucket=8)(prefix) == pytest.approx(p[9], rel=1e-4)
  assert process.TokenProbPRM(model, good_id=9, bad_id=10, bucket=8)(prefix) == pytest.approx(
      p[9] / (p[9] + p[10]), rel=1e-4)
