"""benchmarks/vs_trl.py without TRL: its flags, the settings TRL gets from a run's config, the data and
prompt ids both sides see, and the one evaluator on a real exported start checkpoint."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def vs_trl():
  import sys
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # harness, beside it
  try:
    import vs_trl
    yield vs_trl
  finally:
    sys.path.remove(os.path.join(ROOT, "benchmarks"))


def test_flags(vs_trl):
  args = vs_trl.parse([])
  assert (args.tasks, args.budget_s, args.torch_threads, args.learning_rate) == ("addition,countdown", 180.0, 1, None)
  assert vs_trl.parse(["--quick", "--tasks", "countdown"]).budget_s == 20.0
  assert vs_trl.parse(["--budget-s", "30"]).budget_s == 30.0
  args = vs_trl.parse(["--tunixlike-devices", "4+4"])
  assert (args.sampler_devices, args.learner_devices) == (4, 4)
  with pytest.raises(SystemExit, match="S\\+L"):
    vs_trl.parse(["--tunixlike-devices", "4"])
  with pytest.raises(SystemExit, match="unknown"):
    vs_trl.parse(["--tasks", "addition,gsm8k"])


@pytest.mark.parametrize("task", ["addition", "countdown"])
def test_trl_settings_follow_the_run(vs_trl, task):
  args = vs_trl.parse(["--learning-rate", "3e-4"])
  overrides = vs_trl.rl_overrides(vs_trl.TASKS[task], "/start", args)
  cfg = vs_trl.resolved(vs_trl.TASKS[task], overrides)
  assert cfg.model.hf_path == "/start" and cfg.warm_start.max_steps == 0 and cfg.optim.schedule == "constant"
  assert (cfg.mesh.sampler_devices, cfg.mesh.learner_devices) == (1, 1)
  trl = vs_trl.grpo_config(cfg)
  # Each optimizer step: prompts_per_step groups of group_size completions, one generation batch.
  assert trl["per_device_train_batch_size"] == cfg.rl.prompts_per_step * cfg.algo.group_size
  assert trl["num_generations"] == cfg.algo.group_size and trl["gradient_accumulation_steps"] == 1
  assert trl["max_completion_length"] == cfg.sampler.max_new_tokens
  assert trl["temperature"] == cfg.sampler.temperature and trl["learning_rate"] == cfg.optim.learning_rate == 3e-4
  assert trl["warmup_steps"] == cfg.optim.warmup_steps and trl["adam_beta2"] == cfg.optim.b2
  assert trl["beta"] == cfg.algo.kl_coef == 0.0 and trl["scale_rewards"] == "group"
  assert trl["loss_type"] == vs_trl.LOSS_TYPES[cfg.algo.resolved_aggregation]
  assert trl["bf16"] is False and trl["use_vllm"] is False
  # Without --learning-rate, the rate and temperature of the task config's own job (the built-in model after
  # its supervised stage), not those a model.hf_path run would choose for a pretrained model.
  from tunixlike.rl import starting_point
  own, _ = starting_point.resolved(vs_trl.resolved(vs_trl.TASKS[task], {}))
  theirs = vs_trl.rl_overrides(vs_trl.TASKS[task], "/start", vs_trl.parse([]))
  assert theirs["optim.learning_rate"] == own.optim.learning_rate
  assert theirs["sampler.temperature"] == own.sampler.temperature == trl["temperature"]


def test_gain_ratio(vs_trl):
  assert vs_trl.gain_ratio({"tunixlike": 0.3, "trl": 0.1})["gain_ratio"] == pytest.approx(3.0)
  for trl in (0.0, -0.05):
    out = vs_trl.gain_ratio({"tunixlike": 0.3, "trl": trl})
    assert out["gain_ratio"] is None and "<= 0" in out["gain_ratio_note"]


def test_countdown_rows_and_its_verifier(vs_trl):
  from tunixlike.data import char_tokenizer
  cfg = vs_trl.resolved(vs_trl.TASKS["countdown"], {})
  rows = vs_trl.task_rows(cfg, char_tokenizer.build(), "test", 8)
  assert [r.text for r in rows][:1] == ["9 6 9 to 7:"]  # test.jsonl's first line, in file order
  assert all(r.ids[0] == 1 for r in rows)  # <bos> first
  assert set(rows[0].reward_columns) == {"problem", "numbers", "target", "solution"}  # as tunixlike hands them
  assert vs_trl.accuracy(cfg, rows, [r.columns["solution"] for r in rows]) == 1.0
  assert vs_trl.accuracy(cfg, rows, ["1+1=2"] * len(rows)) == 0.0


def test_start_checkpoint_prompt_ids_and_the_evaluator(vs_trl, tmp_path):
  """The real start: the tiny addition config's supervised stage, exported (its compilation cache filled on
  the way), then TRL's prompt strings and the torch evaluator on it."""
  config = vs_trl.TASKS["addition"].with_name("addition_grpo.py:size=tiny")
  start, info = vs_trl.start_checkpoint(config, tmp_path, quick=True, seed=0)
  assert info["supervised_steps"] == 10 and 0.0 <= info["tunixlike_held_out_accuracy"] <= 1.0
  assert any((tmp_path / "jax-cache-sft").iterdir())  # tunixlike.sft wrote its compiled programs
  cfg = vs_trl.resolved(config, vs_trl.rl_overrides(config, start, vs_trl.parse(["--quick"])))
  from tunixlike.data import tokenizer as tokenizer_lib
  tok = tokenizer_lib.load(start)
  held_out = vs_trl.task_rows(cfg, tok, "test", 16)
  train = vs_trl.task_rows(cfg, tok, "train", 64)
  texts, form = vs_trl.trl_prompts(start, train + held_out)  # raises unless every row's ids are equal
  assert form.startswith("formatted text") and texts[0] == train[0].text
  bad = [vs_trl.Row(r.ids[1:], r.text, r.columns) for r in held_out]  # ids without <bos>: no form gives them
  with pytest.raises(SystemExit, match="no prompt string"):
    vs_trl.trl_prompts(start, bad)
  result = vs_trl.evaluate(cfg, start, held_out)
  assert 0.0 <= result["accuracy"] <= 1.0 and len(result["examples"]) == 3
  assert vs_trl.accuracy(cfg, held_out, [r.columns["answer"] for r in held_out]) == 1.0
