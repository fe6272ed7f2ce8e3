"""The settings a config leaves None that depend on what the run starts from.

A pretrained checkpoint (model.hf_path) already answers: RL only reweighs what it says, in small
steps, the field's defaults for GRPO (TRL's), with no supervised stage. The built-in model starts from
random weights: it needs a supervised stage on the data's answers before RL can find a reward, and its
128k parameters take (and need) much larger steps. A checkpoint that `tunixlike.export` wrote goes on
with the learning rate and temperature its run trained with (recorded in its config.json). A user who
sets a key gets that value; the line this returns says what was chosen and why.
"""

from __future__ import annotations

import json
import os

from tunixlike import config as config_lib

PRETRAINED_LEARNING_RATE = 1e-6  # TRL's GRPOConfig default, for a pretrained model's full weights
# LoRA adapters start at zero and are scaled by alpha / rank: the field's LoRA GRPO recipes use 1e-5 and more.
PRETRAINED_LORA_LEARNING_RATE = 1e-5
# The built-in model after its supervised stage: 5e-4 unlearned countdown's warm start before it
# relearned, 2e-4 rose steadily (benchmarks/defaults.py measures it on three tasks: docs/benchmarks.md).
BUILT_IN_LEARNING_RATE = 2e-4
# The built-in model after its supervised stage: at 1.0 its samples rarely end right (under 1% of them on
# two tasks where greedy decoding was right 60% of the time) and RL unlearned; at 0.7 they did.
BUILT_IN_TEMPERATURE = 0.7
FIELD_TEMPERATURE = 1.0  # TRL's GRPO default; distillation's reverse KL is to the teacher at 1
RUN_KEY = "tunixlike_run"  # config.json's record of the settings the exporting run trained with (`tunixlike.export`)
# Stops at warm_start.target_accuracy long before on the tasks measured (50-950 steps).
SUPERVISED_STEPS = 2000


def exported_run(cfg: config_lib.Config) -> dict:
  """The settings recorded in model.hf_path's config.json by `tunixlike.export` (RUN_KEY; {} for any other
  checkpoint, or a Hub model not downloaded yet): a run that goes on from tunixlike's own export keeps them."""
  from tunixlike.models import hub
  path = cfg.model.hf_path
  if path is None:
    return {}
  path = hub.cached(path, cfg.model.revision) if hub.is_hub_name(path) else path
  config_file = os.path.join(path or "", "config.json")
  if not path or not os.path.isfile(config_file):
    return {}
  with open(config_file, encoding="utf-8") as f:
    return json.load(f).get(RUN_KEY) or {}


def learning_rate(cfg: config_lib.Config, run: dict) -> tuple[float, str]:
  """optim.learning_rate for a config that leaves it None, and why (`run`: `exported_run(cfg)`)."""
  if cfg.model.hf_path is None:
    return BUILT_IN_LEARNING_RATE, "the built-in model, trained from random weights"
  if cfg.lora.rank:
    return PRETRAINED_LORA_LEARNING_RATE, "LoRA adapters on the pretrained model.hf_path"
  if "optim.learning_rate" in run:
    return run["optim.learning_rate"], "the run that exported model.hf_path (its config.json)"
  return PRETRAINED_LEARNING_RATE, "the pretrained model.hf_path (TRL's GRPO default)"


def temperature(cfg: config_lib.Config, run: dict) -> tuple[float, str]:
  """sampler.temperature for a config that leaves it None, and why (`run`: `exported_run(cfg)`)."""
  if cfg.algo.advantage == "distill":
    return FIELD_TEMPERATURE, "distillation samples at temperature 1"
  if "sampler.temperature" in run:
    return run["sampler.temperature"], "the run that exported model.hf_path (its config.json)"
  if cfg.model.hf_path is not None:
    return FIELD_TEMPERATURE, "the pretrained model.hf_path (TRL's GRPO default)"
  return BUILT_IN_TEMPERATURE, "the built-in model: its samples at 1.0 rarely end right after a supervised stage"


def supervised_steps(cfg: config_lib.Config) -> tuple[int, str]:
  """warm_start.max_steps for a config that leaves it None, and why: a stage on the data's answers when
  the built-in model starts from random weights, none from a pretrained checkpoint or without answers."""
  d = cfg.data
  answers = d.answer_field or d.messages_field
  if cfg.model.hf_path is None and answers:
    target = cfg.warm_start.target_accuracy
    return SUPERVISED_STEPS, (f"the built-in model starts from random weights: a supervised stage on {answers!r} "
                              f"until held-out accuracy reaches warm_start.target_accuracy={target}")
  return 0, ("the pretrained model.hf_path answers already" if cfg.model.hf_path is not None
             else "no data.answer_field or data.messages_field to learn from")


def resolved(cfg: config_lib.Config) -> tuple[config_lib.Config, list[str]]:
  """`cfg` with optim.learning_rate, sampler.temperature and warm_start.max_steps chosen where they are
  None, and one line for each chosen (set the key to choose)."""
  changes, lines = {}, []
  run = exported_run(cfg) if cfg.optim.learning_rate is None or cfg.sampler.temperature is None else {}
  if cfg.optim.learning_rate is None:
    rate, why = learning_rate(cfg, run)
    changes["optim"] = dict(learning_rate=rate)
    lines.append(f"optim.learning_rate={rate:g}: {why} (set optim.learning_rate to choose)")
  if cfg.sampler.temperature is None:
    value, why = temperature(cfg, run)
    changes["sampler"] = dict(temperature=value)
    lines.append(f"sampler.temperature={value:g}: {why} (set sampler.temperature to choose)")
  if cfg.warm_start.max_steps is None:
    steps, why = supervised_steps(cfg)
    changes["warm_start"] = dict(max_steps=steps)
    lines.append(f"warm_start.max_steps={steps}: {why} (set warm_start.max_steps to choose)")
  return (config_lib.replace(cfg, **changes) if changes else cfg), lines
