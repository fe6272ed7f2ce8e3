"""A config that leaves optim.learning_rate and warm_start.max_steps None gets them by what the run starts
from (`rl.starting_point`): the built-in model from random weights, or a pretrained model.hf_path."""

import json

import pytest

import tunixlike
from tunixlike.learner import optimizer
from tunixlike.learner.config import OptimConfig
from tunixlike.rl import starting_point

OWN_DATA = {"data.task": None, "data.train": "train.jsonl", "data.prompt_field": "q", "data.answer_field": "a"}


def resolved(overrides):
  cfg, lines = starting_point.resolved(tunixlike.load_config(tunixlike.Config(), overrides))
  return cfg.optim.learning_rate, cfg.warm_start.max_steps, [l for l in lines if "temperature" not in l]


def temperature(overrides) -> tuple[float, list[str]]:
  cfg, lines = starting_point.resolved(tunixlike.load_config(tunixlike.Config(), overrides))
  return cfg.sampler.temperature, [l for l in lines if l.startswith("sampler.temperature")]


def test_the_built_in_model_with_answers_gets_a_supervised_stage_and_its_rate():
  rate, steps, lines = resolved(OWN_DATA)
  assert (rate, steps) == (starting_point.BUILT_IN_LEARNING_RATE, starting_point.SUPERVISED_STEPS) == (2e-4, 2000)
  assert lines == ["optim.learning_rate=0.0002: the built-in model, trained from random weights (set "
                   "optim.learning_rate to choose)",
                   "warm_start.max_steps=2000: the built-in model starts from random weights: a supervised stage "
                   "on 'a' until held-out accuracy reaches warm_start.target_accuracy=0.2 (set warm_start.max_steps "
                   "to choose)"]


def test_a_pretrained_checkpoint_gets_the_fields_rate_and_no_supervised_stage():
  rate, steps, lines = resolved({**OWN_DATA, "model.hf_path": "org/model"})
  assert (rate, steps) == (1e-6, 0)
  assert lines[0] == ("optim.learning_rate=1e-06: the pretrained model.hf_path (TRL's GRPO default) (set "
                      "optim.learning_rate to choose)")
  rate, _, lines = resolved({**OWN_DATA, "model.hf_path": "org/model", "lora.rank": 8})
  assert rate == 1e-5 and "LoRA adapters" in lines[0]


def test_data_without_answers_gets_no_supervised_stage():
  _, steps, lines = resolved({"data.task": None, "data.train": "train.jsonl", "data.prompt_field": "q"})
  assert steps == 0 and "no data.answer_field or data.messages_field" in lines[1]
  _, steps, _ = resolved({})  # a built-in task: its configs set their own stage
  assert steps == 0


def test_keys_the_user_sets_are_kept_and_not_announced():
  overrides = {**OWN_DATA, "optim.learning_rate": 5e-4, "warm_start.max_steps": 10, "sampler.temperature": 1.0}
  cfg, lines = starting_point.resolved(tunixlike.load_config(tunixlike.Config(), overrides))
  assert (cfg.optim.learning_rate, cfg.warm_start.max_steps, cfg.sampler.temperature, lines) == (5e-4, 10, 1.0, [])


def test_the_sampling_temperature_is_lower_for_the_built_in_model_than_the_fields():
  assert temperature(OWN_DATA) == (0.7, ["sampler.temperature=0.7: the built-in model: its samples at 1.0 rarely "
                                         "end right after a supervised stage (set sampler.temperature to choose)"])
  assert temperature({**OWN_DATA, "model.hf_path": "org/model"})[0] == 1.0
  distill = {"algo.advantage": "distill", "model.teacher_path": "teacher"}
  value, lines = temperature(distill)
  assert value == 1.0 and "distillation samples at temperature 1" in lines[0]


def test_a_library_optimizer_without_a_rate_is_refused_naming_the_key():
  with pytest.raises(ValueError, match=r"optim.learning_rate is None: a run chooses it"):
    optimizer.make_schedule(OptimConfig())


def test_tunixlikes_own_export_goes_on_with_the_settings_its_run_recorded(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", starting_point.RUN_KEY: {
      "optim.learning_rate": 3e-4, "sampler.temperature": 0.7}}))
  cfg, lines = starting_point.resolved(tunixlike.load_config(tunixlike.Config(), {**OWN_DATA,
                                                                                   "model.hf_path": str(tmp_path)}))
  assert (cfg.optim.learning_rate, cfg.sampler.temperature, cfg.warm_start.max_steps) == (3e-4, 0.7, 0)
  assert lines[:2] == ["optim.learning_rate=0.0003: the run that exported model.hf_path (its config.json) (set "
                       "optim.learning_rate to choose)",
                       "sampler.temperature=0.7: the run that exported model.hf_path (its config.json) (set "
                       "sampler.temperature to choose)"]
  lora, _ = starting_point.resolved(tunixlike.load_config(tunixlike.Config(), {
      **OWN_DATA, "model.hf_path": str(tmp_path), "lora.rank": 8}))
  assert (lora.optim.learning_rate, lora.sampler.temperature) == (1e-5, 0.7)  # adapters start afresh
