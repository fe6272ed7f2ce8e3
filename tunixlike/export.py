"""Export a run's checkpoint as a Hugging Face model directory (LoRA merged into the weights).

    python -m tunixlike.export --workdir DIR --out HF_DIR [--step N | --best]

Reads the checkpoint in DIR/checkpoints (or DIR itself), rebuilds the model from the checkpoint's
`meta["model"]` (the ModelConfig fields), restores only the weights (not the optimizer state)
onto one CPU device, merges LoRA adapters (`meta["lora"]`), and writes config.json +
model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained` loads, plus the
tokenizer the run used: the files of `meta["hf_path"]`, or the character tokenizer of the
built-in tasks. Base weights left out of the checkpoint (save_frozen=False) are read from
`meta["hf_path"]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys

import jax
from flax import nnx

from tunixlike import checkpoint as ckpt_lib
from tunixlike.learner import state as state_lib
from tunixlike.data import tokenizer as tokenizer_lib
from tunixlike.models import hf, hub, lora as lora_lib
from tunixlike.models.config import ModelConfig, RopeScaling
from tunixlike.models.transformer import Transformer
from tunixlike.rl import starting_point

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


class ExportError(ValueError):
  """The checkpoint's meta does not describe a model this code can rebuild."""


def model_config_from_meta(fields: dict, *, where: str) -> ModelConfig:
  """ModelConfig from its fields as stored in JSON (tuples became lists, RopeScaling a dict)."""
  if not isinstance(fields, dict):
    raise ExportError(f"{where}: meta['model'] is {type(fields).__name__}, expected the ModelConfig fields as a dict")
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ExportError(f"{where}: meta['model'] has unknown field(s) {unknown}")
  kw = dict(fields)
  if isinstance(kw.get("rope_scaling"), dict):
    kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
  if isinstance(kw.get("eos_token_ids"), list):
    kw["eos_token_ids"] = tuple(kw["eos_token_ids"])
  try:
    return ModelConfig(**kw)
  except (TypeError, ValueError) as e:
    raise ExportError(f"{where}: meta['model'] is not a valid ModelConfig ({e})") from None


def lora_config_from_meta(fields, *, where: str) -> lora_lib.LoRAConfig | None:
  if not fields:
    return None
  try:
    return lora_lib.LoRAConfig(rank=fields["rank"], alpha=fields["alpha"], targets=tuple(fields["targets"]))
  except (KeyError, TypeError, ValueError) as e:
    raise ExportError(f"{where}: meta['lora']={fields!r} is not a LoRA config ({type(e).__name__}: {e})") from None


def find_checkpoints(workdir) -> str:
  """DIR/checkpoints when it exists, else DIR itself (a checkpoint directory given directly)."""
  sub = ckpt_lib.workdir_checkpoints(workdir)
  return sub if os.path.isdir(sub) else os.fspath(workdir)


def _model_dir(meta: dict) -> str | None:
  """The run's model.hf_path as a local directory (a Hub name through the huggingface_hub cache)."""
  hf_path = meta.get("hf_path")
  if not hf_path:
    return None
  try:
    return hub.resolve(hf_path, meta.get("config", {}).get("model", {}).get("revision"))
  except hub.HubError as e:
    print(f"export: warning: {e}", file=sys.stderr)
    return hf_path


def _token_ids(hf_path: str | None, out: pathlib.Path):
  """config.json keeps the special token ids transformers reads (generate pads with pad_token_id):
  the base model's own, else the ids of the tokenizer written beside it."""
  ids = {}
  if hf_path and os.path.isfile(os.path.join(hf_path, "config.json")):
    with open(os.path.join(hf_path, "config.json"), encoding="utf-8") as f:
      base = json.load(f)
    ids = {k: base[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if base.get(k) is not None}
  if "pad_token_id" not in ids and os.path.isfile(out / "tokenizer.json"):
    tok = tokenizer_lib.load(str(out))
    ids = {"pad_token_id": tok.pad_id, "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, **ids}
  if ids:
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config.update({k: v for k, v in ids.items() if v is not None})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _save_tokenizer(meta: dict, out: pathlib.Path) -> str:
  hf_path = _model_dir(meta)
  if hf_path:
    if not os.path.isdir(hf_path):
      print(f"export: warning: tokenizer not written: the run's hf_path {hf_path} is not a directory",
            file=sys.stderr)
      return "none"
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_path, name))]
    for name in copied:
      shutil.copyfile(os.path.join(hf_path, name), out / name)
    return f"copied {copied} from {hf_path}"
  from tunixlike.data import char_tokenizer  # the built-in tasks' tokenizer, as the trainer builds it
  char_tokenizer.build().save(str(out))
  return "char tokenizer"


def export(workdir, out, step: int | None = None, *, best: bool = False) -> pathlib.Path:
  """Writes the checkpoint of run `workdir` at `step` (default: newest; `best`: the one with the best
  held-out accuracy) as an HF directory `out`."""
  directory = find_checkpoints(workdir)
  cpu = jax.local_devices(backend="cpu")[0]
  with ckpt_lib.Checkpointer(directory, read_only=True, best_metric=ckpt_lib.RUN_BEST_METRIC) as ck:
    step = ck.pick_step(step, best=best)
    where = ck.step_dir(step)
    meta = ck.read_meta(step)
    if "model" not in meta:
      raise ExportError(f"{where}: meta has no 'model' (the ModelConfig fields); keys are {sorted(meta)}")
    cfg = model_config_from_meta(meta["model"], where=where)
    lora_cfg = lora_config_from_meta(meta.get("lora"), where=where)
    with jax.default_device(cpu):
      hf_path = _model_dir(meta)
      frozen_saved = ck.layout(step).get("frozen_saved", True)
      if frozen_saved:
        build = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
        if lora_cfg is not None:
          build = lambda b=build: lora_lib.apply_lora(b(), lora_cfg, seed=0)
        model = nnx.eval_shape(build)  # shapes only: every weight comes from the checkpoint
      else:
        if not hf_path or not os.path.isdir(hf_path):
          raise ExportError(f"{where}: the checkpoint holds no base weights (save_frozen=False) and the run's "
                            f"hf_path {hf_path!r} is not a directory to read them from")
        model = hf.from_pretrained(hf_path, dtype=cfg.param_dtype)
        if lora_cfg is not None:
          model = lora_lib.apply_lora(model, lora_cfg, seed=0)  # the adapters' values come from the checkpoint
      ppo = meta.get("config", {}).get("algo", {}).get("estimator") == "ppo"
      model, _ = state_lib.restore_policy_weights(ck, step, model, lora=lora_cfg is not None, ppo=ppo,
                                                  sharding=jax.sharding.SingleDeviceSharding(cpu))
      if lora_cfg is not None:
        model = lora_lib.merge_lora(model)
      out = pathlib.Path(out)
      hf.save_pretrained(model, out)
      _save_tokenizer(meta, out)
      _token_ids(hf_path, out)
      _record_run(meta.get("config", {}), out)
  return out


def _record_run(run: dict, out: pathlib.Path):
  """Writes the run's sampling temperature and (for full weights: a LoRA run's rate was for its adapters) its
  learning rate into config.json: a run that starts from this directory continues with them, not with the
  defaults for a pretrained model (`rl.starting_point`)."""
  settings = {"sampler.temperature": run.get("sampler", {}).get("temperature")}
  if not run.get("lora", {}).get("rank"):
    settings["optim.learning_rate"] = run.get("optim", {}).get("learning_rate")
  settings = {k: v for k, v in settings.items() if v is not None}
  if settings:
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config[starting_point.RUN_KEY] = settings
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m tunixlike.export",
      description="Write a run's checkpoint as a Hugging Face model directory (config.json, model.safetensors "
                  "and tokenizer files) that transformers.AutoModelForCausalLM.from_pretrained loads. LoRA "
                  "adapters are merged into the base weights.")
  parser.add_argument("--workdir", required=True, help="the run's --workdir (its checkpoints/ subdirectory is read)")
  parser.add_argument("--out", required=True, help="output directory for the Hugging Face checkpoint")
  which = parser.add_mutually_exclusive_group()
  which.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest)")
  which.add_argument("--best", action="store_true", help="export the checkpoint with the best held-out accuracy")
  args = parser.parse_args(argv)
  try:
    out = export(args.workdir, args.out, step=args.step, best=args.best)
  except (ckpt_lib.CheckpointError, ExportError, hf.CheckpointError, OSError) as e:
    print("export: error: " + " ".join(str(e).split()), file=sys.stderr)
    return 2
  print(f"export: wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
