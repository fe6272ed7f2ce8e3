"""On-policy distillation: teacher logprobs aligned with the sampled tokens, the per-token reverse-KL
advantage, and the student's KL to a fixed tiny teacher falling through the real async runtime."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunixlike import config as config_lib, models
from tunixlike.learner import batch as batch_lib, token_advantages as tok_adv
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.rl import build, distill
from tunixlike.rl.prompts import PromptStream, requests_for
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler.driver import RolloutDriver

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"

TINY = models.tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)


def _group(rng, g=3):
  comps = []
  for _ in range(g):
    n = int(rng.integers(2, 7))
    comps.append(Completion(rng.integers(1, 64, size=n).astype(np.int32), (-3 + rng.normal(size=n)).astype(np.float32),
                            np.zeros(n, np.int32), "length"))
  return RolloutGroup("p", rng.integers(1, 64, size=4).astype(np.int32), comps, rewards=np.zeros(g, np.float32))


def test_teacher_logprobs_are_those_of_each_sampled_token_given_its_prefix():
  model = models.Transformer(TINY, rngs=nnx.Rngs(3))
  teacher = distill.Teacher(model, vocab_size=64, seq_buckets=(16,))
  group = _group(np.random.default_rng(0))
  teacher.score(group)
  for c in group.completions:
    tokens = np.concatenate([group.prompt_token_ids, c.token_ids])
    logp_tv = jax.nn.log_softmax(model(jnp.asarray(tokens[None]))[0], axis=-1)
    p = len(group.prompt_token_ids)
    want = [float(logp_tv[p - 1 + i, tok]) for i, tok in enumerate(c.token_ids)]
    np.testing.assert_allclose(c.teacher_logprobs, want, atol=1e-5)
  gaps = np.concatenate([c.logprobs - c.teacher_logprobs for c in group.completions])
  assert group.reward_metrics["distill/reverse_kl"] == pytest.approx(gaps.mean(), rel=1e-5)
  with pytest.raises(ValueError, match="vocab_size=64, the student 80"):
    distill.Teacher(model, vocab_size=80)


def test_distill_advantage_is_teacher_minus_student_logprob_per_token():
  rng = np.random.default_rng(1)
  group = _group(rng)
  for c in group.completions:
    c.teacher_logprobs = (-2 + rng.normal(size=c.num_tokens)).astype(np.float32)
  group.rewards = np.array([1.0, 0.0, 1.0], np.float32)  # ignored by "distill": no outcome term
  b = batch_lib.assemble_batch([group], num_rows=4, seq_buckets=(16,), sampling_mask=False, routing=False,
                               unscored=dataclasses.replace(UNSCORED, estimator="distill",
                                                            token=tok_adv.TokenAdvantageConfig(distill_coef=1.0)))
  assert not b["advantages"].any()
  for i, c in enumerate(group.completions):
    np.testing.assert_allclose(b["token_advantages"][i, 4:4 + c.num_tokens], c.teacher_logprobs - c.logprobs,
                               rtol=1e-6)
  group.completions[1].teacher_logprobs = None
  with pytest.raises(ValueError, match=r"completions\[1\] has no teacher_logprobs"):
    tok_adv.distill(group)


def _config(teacher_path, num_steps, advantage="distill"):
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  return config_lib.replace(
      cfg, model=dict(teacher_path=teacher_path),
      algo=dict(advantage=advantage, group_size=4),
      data=dict(digits=2, num_eval_examples=16), warm_start=dict(max_steps=0),
      log=dict(progress_bar=False, tensorboard=False), optim=dict(learning_rate=3e-3),
      sampler=dict(max_concurrent_decodes=16, max_new_tokens=8),
      rl=dict(num_steps=num_steps, prompts_per_step=4, max_staleness=1))


def _held_out_kl(setup, rl, teacher_model) -> float:
  """Exact mean reverse KL(student || teacher) over the vocabulary at every position of completions the
  current student samples for the held-out prompts (same sampling seed each time)."""
  params = rl.policy.sync_weights().params
  groups = []
  RolloutDriver(rl.engine, params, source=iter(requests_for(setup.eval_records)), sink=groups.append).run(120)
  rows = [(g.prompt_token_ids, c.token_ids) for g in groups for c in g.completions]
  t = max(len(p) + len(c) for p, c in rows)
  tokens, mask = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), np.float32)
  for i, (p, c) in enumerate(rows):
    tokens[i, :len(p) + len(c)] = np.concatenate([p, c])
    mask[i, len(p):len(p) + len(c)] = 1.0
  student = rl.policy.model()
  return distill.reverse_kl(student, teacher_model, tokens, mask)


@pytest.mark.slow
def test_student_reverse_kl_to_a_fixed_teacher_falls_through_the_async_runtime(tmp_path):
  # The teacher: a different random model of the student's shape, made peaked (final norm x4, so its
  # logits are 4x larger), saved as a Hugging Face checkpoint and loaded back through model.teacher_path.
  probe = _config(None, 1, advantage="grpo")
  tok, _ = build.build_task(probe)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
  teacher = build.build_model(dataclasses.replace(probe, seed=7), tok, mesh)
  teacher.norm.weight[...] = teacher.norm.weight[...] * 4.0
  models.save_pretrained(teacher, tmp_path / "teacher")

  steps = 30
  setup = build.build(_config(str(tmp_path / "teacher"), steps))
  rl = build.build_rl(setup)
  teacher_model = models.from_pretrained(str(tmp_path / "teacher"))
  before = _held_out_kl(setup, rl, teacher_model)
  records = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: records.append(info.metrics))
  runtime.run()
  after = _held_out_kl(setup, rl, teacher_model)
  assert rl.policy.version == steps
  sampled = [m["distill/reverse_kl"] for m in records]  # the reward stage's per-batch sampled estimate
  print(f"held-out reverse KL(student || teacher): {before:.3f} -> {after:.3f}; sampled estimate per batch "
        f"{np.mean(sampled[:5]):.3f} (first 5 steps) -> {np.mean(sampled[-5:]):.3f} (last 5)")
  assert after < 0.85 * before, (before, after)
  assert np.mean(sampled[-5:]) < np.mean(sampled[:5])


@pytest.mark.parametrize("changes, message", [
    (dict(model=dict(teacher_path="/t"), algo=dict(advantage="grpo")), "model.teacher_path='/t'"),
    (dict(algo=dict(advantage="distill")), "model.teacher_path=None"),
    (dict(model=dict(teacher_path="/t"), algo=dict(advantage="distill"), sampler=dict(top_p=0.9)), "sampler.top_p=0.9"),
    (dict(model=dict(teacher_path="/t"), algo=dict(advantage="distill", loss="gspo")), "algo.loss='gspo'"),
    (dict(algo=dict(process_reward="nope")), "algo.process_reward='nope'"),
    (dict(algo=dict(process_reward="answer_prefix", step_delimiter="", step_every_tokens=0)), "algo.step_delimiter=''"),
    (dict(algo=dict(process_reward="answer_prefix"), rl=dict(env="calculator")), "rl.env='calculator'"),
])
def test_bad_distillation_and_process_reward_configs_name_the_key(changes, message):
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
    config_lib.replace(cfg, **changes)
