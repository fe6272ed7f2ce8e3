"""Evaluate a run's checkpoint with the sampler: accuracy (greedy) and pass@k (k samples), as JSON.

  python -m tunixlike.eval --config configs/addition_grpo.py --checkpoint runs/addition
  python -m tunixlike.eval --checkpoint runs/addition --split test --num_examples 200 \
      --samples 8 --temperature 1.0 --out runs/addition/eval.json

The model is built from the config as training builds it (meshes, tokenizer, task, model, LoRA),
with no learner or optimizer; only the policy's weights are read from the checkpoint, into the
live sharded model, synced to the sampler, and the split's first `--num_examples` prompts (in file
order, no shuffle) are decoded:

  accuracy          greedy decoding, one completion per prompt, scored by the task's 0/1 verifier
                    (exact match, GSM8K answer check), not by the shaped training reward;
  pass@K            with --samples K > 1: the fraction of prompts with at least one correct
                    completion among K sampled at --temperature (sampled_accuracy: mean over all).

The prompts are built as training built them (prompt field or chat messages, system prompt, chat
template). In agent runs (rl.agent) and multi-turn runs (rl.env) the eval is the same single-turn
greedy completion of each held-out prompt, not an episode through the agent or the environment.
`--out FILE` also keeps `examples`: each prompt's greedy completion with its score.

Without --config the run's own config (saved in the checkpoint's meta) is used. `--checkpoint` is
the run's --workdir (its checkpoints/ is read) or a checkpoint directory itself. The JSON goes to
stdout (and to --out); progress lines go to stderr. Bad input (no checkpoint, an unknown config key,
a bad value, a checkpoint of another model) prints one line naming it and exits with status 2.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from typing import Any

from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from tunixlike import cli
from tunixlike import config as config_lib

PROG = "tunixlike.eval"
SPLITS = ("train", "test")

_CONFIG = cli.refuse_none(config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py[:variant]) or a shipped config's name (addition_grpo[:variant]); any "
    "key can then be overridden with "
    "--config.section.key=value. Default: the config saved with the checkpoint.", lock_config=True))
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "The run's --workdir (WORKDIR/checkpoints is read) or a "
                                  "checkpoint directory holding numbered step directories. Required.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the newest complete one).")
_BEST = flags.DEFINE_bool("best", False, "Evaluate the checkpoint with the best held-out accuracy (not with --step).")
_SPLIT = flags.DEFINE_enum("split", "test", SPLITS, "Dataset split to evaluate on.")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "Number of prompts (the split's first N in file "
                                     "order). Default: data.num_eval_examples of the config.")
_SAMPLES = flags.DEFINE_integer("samples", 1, "Completions per prompt for pass@k (K > 1 also reports "
                                "pass@K and sampled_accuracy). Accuracy is always greedy.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature of the --samples K > 1 "
                                  "completions (top-k / top-p off).")
_OUT = flags.DEFINE_string("out", None, "Also write the JSON result to this file, with 'examples': every "
                           "prompt's greedy completion (prompt, completion, score, finish_reason, num_tokens).")


class EvalError(ValueError):
  """Bad input to the evaluation (the message names the flag, key or directory)."""


def checkpoint_dir(path: str) -> str:
  """WORKDIR/checkpoints when it exists, else `path` (a checkpoint directory given directly)."""
  from tunixlike import checkpoint as checkpoint_lib  # orbax and jax: not for a command line that is refused
  sub = checkpoint_lib.workdir_checkpoints(path)
  return sub if os.path.isdir(sub) else os.fspath(path)


def evaluate_checkpoint(cfg: config_lib.Config | None, checkpoint: str, *, step: int | None = None,
                        best: bool = False, split: str = "test", num_examples: int | None = None, samples: int = 1,
                        temperature: float = 1.0, say=print) -> dict[str, Any]:
  """Restores `checkpoint` (at `step`, default the newest; `best`: the one with the best held-out accuracy)
  into the parts built from `cfg` (None: the checkpoint's own config) and returns {"accuracy", "num_prompts", ..., and with samples > 1 "pass@K", "sampled_accuracy"}."""
  if split not in SPLITS:
    raise EvalError(f"split={split!r}: must be one of {list(SPLITS)}")
  if samples < 1:
    raise EvalError(f"samples={samples}: must be >= 1")
  if not temperature >= 0.0:
    raise EvalError(f"temperature={temperature}: must be >= 0")
  if num_examples is not None and num_examples < 1:
    raise EvalError(f"num_examples={num_examples}: must be >= 1")
  from tunixlike import checkpoint as checkpoint_lib
  directory = checkpoint_dir(checkpoint)
  if not os.path.isdir(directory) and "://" not in directory:
    raise EvalError(f"checkpoint {checkpoint}: no such directory")
  ckpt = checkpoint_lib.Checkpointer(directory, read_only=True, best_metric=checkpoint_lib.RUN_BEST_METRIC)
  try:
    step = ckpt.pick_step(step, best=best)
    if cfg is None:
      meta = ckpt.read_meta(step)
      if "config" not in meta:
        raise EvalError(f"{ckpt.step_dir(step)}: meta holds no 'config'; pass --config")
      cfg = config_lib.from_saved(meta["config"])
      in_memory = [f"{key}={value!r}" for key, value in _named_inputs(cfg) if value.startswith("<in memory")]
      if in_memory:
        raise EvalError(f"{ckpt.step_dir(step)} was trained on objects given to tunixlike.train in memory "
                        f"({', '.join(in_memory)}): pass --config with files or import paths for them")
    config_lib.check_paths(cfg)  # the run's model directory may have moved since
    if samples > cfg.sampler.max_concurrent_decodes:
      raise EvalError(f"samples={samples} is larger than sampler.max_concurrent_decodes="
                      f"{cfg.sampler.max_concurrent_decodes}: raise it with --config.sampler.max_concurrent_decodes")
    return _evaluate(cfg, ckpt, step, split, num_examples or cfg.data.num_eval_examples, samples, temperature,
                     say)
  finally:
    ckpt.close()


def _named_inputs(cfg: config_lib.Config):
  """(key, value) of every config key that names data or code."""
  yield from (("data.train", cfg.data.train or ""), ("data.eval", cfg.data.eval or ""), ("rl.env", cfg.rl.env or ""),
              ("rl.agent", cfg.rl.agent or ""))
  yield from ((f"rewards[{i}].fn", term["fn"]) for i, term in enumerate(cfg.rewards))


def _evaluate(cfg, ckpt, step, split, num_examples, samples, temperature, say) -> dict[str, Any]:
  import jax
  from flax import nnx

  from tunixlike.data import pipeline
  from tunixlike.learner import state as state_lib
  from tunixlike.rl import build, evaluate as eval_lib, weight_sync
  from tunixlike.rl.prompts import requests_for
  from tunixlike.sampler import make_engine

  start = time.monotonic()
  setup = build.build(cfg, say=say, training=False)
  cfg = setup.cfg  # with what build resolved (a sampler.max_new_tokens sized from the data)
  model, meta = state_lib.restore_policy_weights(ckpt, step, build.policy_model(setup), lora=bool(cfg.lora.rank),
                                                 ppo=cfg.algo.estimator == "ppo")
  version = int(meta.get("version", step))
  say(f"restored {ckpt.step_dir(step)} (policy version {version}) in {time.monotonic() - start:.1f} s")

  # The prompts are built exactly as training built them (templates, system prompt, chat messages).
  pipe_cfg = build.pipeline_config(cfg, setup.transport.data_shard, shuffle=False, num_epochs=1)
  records = list(itertools.islice(iter(pipeline.from_task(setup.task, setup.tok, split=split, config=pipe_cfg)),
                                  num_examples))
  requests = requests_for(records)
  correctness = build.correctness_reward(setup)
  s_cfg = build.sampler_config(cfg, setup.tok, setup.transport.decoders)
  engine = make_engine(model, eval_lib.eval_sampler_config(s_cfg), mesh=setup.meshes.sampler)
  params, _ = weight_sync.sync(nnx.state(model), engine.param_shardings, dtype=cfg.rl.sync_dtype)

  examples: list = []
  greedy = eval_lib.evaluate(engine, params, requests, correctness, setup.tok, version=version, examples=examples,
                            timeout_s=cfg.eval.timeout_s)
  out: dict[str, Any] = {
      "checkpoint": ckpt.step_dir(step), "step": step, "policy_version": version, "split": split,
      "task": cfg.data.task, "num_prompts": greedy["eval/num_prompts"], "accuracy": greedy["eval/accuracy"],
      "mean_completion_tokens": greedy["eval/mean_completion_tokens"], "samples": samples}
  if samples > 1:
    engine = make_engine(model, eval_lib.eval_sampler_config(s_cfg, samples=samples, temperature=temperature),
                    mesh=setup.meshes.sampler)
    sampled = eval_lib.evaluate(engine, params, requests, correctness, setup.tok, version=version,
                                timeout_s=cfg.eval.timeout_s)
    out.update({"temperature": temperature, f"pass@{samples}": sampled[f"eval/pass@{samples}"],
                "sampled_accuracy": sampled["eval/accuracy"],
                "sampled_mean_completion_tokens": sampled["eval/mean_completion_tokens"]})
  out["wall_s"] = round(time.monotonic() - start, 3)
  out["devices"] = f"{jax.device_count()} x {jax.devices()[0].platform}"
  out["examples"] = examples  # the greedy completions, one per prompt
  return out


# ---- the command line --------------------------------------------------------------------------------
def parse(argv: list[str]) -> tuple[config_lib.Config | None, dict[str, Any]]:
  """Flags -> (validated config or None, keyword arguments of `evaluate_checkpoint`); exits 2 on bad input."""
  cfg = cli.parse_config(PROG, argv, _CONFIG)
  if _CHECKPOINT.value is None:
    cli.fail(PROG, "--checkpoint is required (the run's --workdir or its checkpoints/ directory)")
  if _BEST.value and _STEP.value is not None:
    cli.fail(PROG, "--best and --step name two checkpoints: give one")
  return cfg, dict(checkpoint=_CHECKPOINT.value, step=_STEP.value, best=_BEST.value, split=_SPLIT.value,
                   num_examples=_NUM_EXAMPLES.value, samples=_SAMPLES.value, temperature=_TEMPERATURE.value)


def main(argv: list[str] | None = None):
  argv = list(sys.argv if argv is None else argv)
  if cli.wants_help(argv):
    print(cli.usage(sys.modules[__name__]))
    return
  cfg, kwargs = parse(argv)
  from tunixlike import checkpoint as checkpoint_lib  # heavy imports only once the flags are known to be good
  # orbax logs a warning per read-only manager option; a user reading one error line needs none of them.
  absl_logging.set_verbosity(absl_logging.ERROR)
  say = lambda message: print(message, file=sys.stderr, flush=True)
  try:
    result = evaluate_checkpoint(cfg, say=say, **kwargs)
  except (EvalError, checkpoint_lib.CheckpointError, config_lib.ConfigError, FileNotFoundError) as e:
    cli.fail(PROG, str(e))
  if _OUT.value:  # the file also keeps every prompt's greedy completion and its score
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w", encoding="utf-8") as f:
      f.write(json.dumps(result, indent=2) + "\n")
  print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=2))


if __name__ == "__main__":
  main()
