"""Hugging Face checkpoint import / export (local directories; safetensors only).

from_pretrained reads config.json plus model.safetensors or a sharded model.safetensors.index.json.
With a mesh, each tensor is placed directly with its target sharding: every device reads only its
own slice from the (memory-mapped) file, so the model is never whole on one device. Any mismatch
(missing file, missing / unexpected tensor, wrong shape, truncated file, unsupported architecture)
raises an error naming the file, tensor or field; nothing is ever partially loaded.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunixlike.models import sharding as sharding_lib
from tunixlike.models.config import ModelConfig
from tunixlike.models.transformer import Transformer, check_mesh

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
  """A Hugging Face checkpoint directory that cannot be loaded as asked."""


def hf_name(path: tuple) -> tuple[str, bool]:
  """Our parameter path -> (HF tensor name, whether the array is transposed relative to torch)."""
  parts = [str(p) for p in path]
  mods, leaf = ["self_attn" if p == "attn" else p for p in parts[:-1]], parts[-1]
  transpose = leaf == "kernel"  # nnx.Linear kernels are [in, out]; torch Linear weights are [out, in]
  leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
  name = ".".join(mods + [leaf])
  return (name if mods and mods[0] == "lm_head" else "model." + name), transpose


def _read_json(file: pathlib.Path) -> Any:
  if not file.is_file():
    raise CheckpointError(f"{file}: file not found")
  try:
    return json.loads(file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{file}: invalid JSON ({e})") from None


def _tensor_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """HF tensor name -> safetensors file holding it."""
  index = root / INDEX_FILE
  if index.is_file():
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f"{index}: missing or empty 'weight_map'")
    out = {name: root / file for name, file in weight_map.items()}
    for file in sorted(set(out.values())):
      if not file.is_file():
        raise CheckpointError(f"{file}: file not found (listed in {index})")
    return out
  single = root / SINGLE_FILE
  if not single.is_file():
    raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
  from safetensors import SafetensorError, safe_open
  try:
    with safe_open(str(single), framework="numpy") as f:
      return {name: single for name in f.keys()}
  except SafetensorError as e:
    raise CheckpointError(f"{single}: unreadable safetensors file ({e})") from None


def _ignored(name: str, cfg: ModelConfig) -> bool:
  # Old Llama exports carry the RoPE buffer; some tied checkpoints also store lm_head (a copy).
  return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


def _load_config(root: pathlib.Path, dtype) -> ModelConfig:
  file = root / "config.json"
  overrides: dict[str, Any] = {}
  if dtype is not None:
    name = jnp.dtype(dtype).name
    overrides = dict(param_dtype=name, dtype=name)
  gen = root / "generation_config.json"
  if gen.is_file():  # generation_config's eos list is the one chat models stop on
    eos = _read_json(gen).get("eos_token_id")
    if eos is not None:
      overrides["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (int(eos),)
  return ModelConfig.from_hf_config(_read_json(file), source=str(file), **overrides)


def from_pretrained(path, mesh: jax.sharding.Mesh | None = None, rules=None, dtype=None) -> Transformer:
  """Loads a local HF Llama 3.x / Qwen2 / Qwen3 directory.

  dtype: parameter and compute dtype (e.g. 'bfloat16'); default float32 whatever the file holds.
  mesh/rules: place every parameter with `state_shardings(model, mesh, rules)` (rules=None replicates).
  Without a mesh, parameters go to the default device.
  """
  root = pathlib.Path(path)
  if not root.is_dir():
    raise CheckpointError(f"{root}: not a directory")
  cfg = _load_config(root, dtype)
  files = _tensor_files(root)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  if mesh is not None:
    check_mesh(mesh)
    shardings = dict(nnx.to_flat_state(sharding_lib.state_shardings(abstract, mesh, rules or ())))

  wanted = {}
  for p, var in nnx.to_flat_state(abstract):
    name, transpose = hf_name(p)
    wanted[name] = (p, var, transpose)
  missing = sorted(set(wanted) - set(files))
  if missing:
    raise CheckpointError(f"{root}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                          f"for {cfg.arch} with {cfg.num_layers} layers")
  unexpected = sorted(n for n in set(files) - set(wanted) if not _ignored(n, cfg))
  if unexpected:
    raise CheckpointError(f"{root}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
                          f" in {files[unexpected[0]].name}; config.json does not describe this checkpoint")

  from safetensors import SafetensorError, safe_open
  by_file: dict[pathlib.Path, list[str]] = {}
  for name in wanted:
    by_file.setdefault(files[name], []).append(name)
  flat = []
  for file, names in sorted(by_file.items()):
    try:
      with safe_open(str(file), framework="numpy") as f:
        present = set(f.keys())
        for name in names:
          if name not in present:
            raise CheckpointError(f"{file}: tensor {name!r} listed in {INDEX_FILE} is not in the file")
          p, var, transpose = wanted[name]
          value = var.get_value()
          sharding = shardings[p].get_value() if mesh is not None else None
          flat.append((p, var.replace(_place(f.get_slice(name), name, file, value, transpose, sharding))))
    except SafetensorError as e:
      raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place(slice_, name: str, file: pathlib.Path, target: jax.ShapeDtypeStruct, transpose: bool, sharding):
  shape = tuple(slice_.get_shape())
  want = tuple(reversed(target.shape)) if transpose else tuple(target.shape)
  if shape != want:
    raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)}, expected {list(want)}")
  dtype = np.dtype(target.dtype)

  def read(index) -> np.ndarray:
    index = tuple(index) if index is not None else tuple(slice(None) for _ in shape)
    hf_index = tuple(reversed(index)) if transpose else index
    block = np.asarray(slice_[hf_index] if hf_index else slice_[:])
    return np.ascontiguousarray(block.T if transpose else block).astype(dtype)

  if sharding is None:
    return jnp.asarray(read(None))
  seen: dict[Any, np.ndarray] = {}  # replicated devices share one read

  def callback(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in seen:
      seen[key] = read(index)
    return seen[key]

  return jax.make_array_from_callback(target.shape, sharding, callback)


def save_pretrained(model: Transformer, path) -> pathlib.Path:
  """Writes config.json + model.safetensors that transformers.AutoModelForCausalLM loads.

  Only plain nnx.Param weights are exported (merge LoRA adapters first). Sharded parameters are
  gathered to the host one at a time (single-controller runs: every shard must be addressable).
  """
  from safetensors.numpy import save_file
  root = pathlib.Path(path)
  root.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transpose = hf_name(p)
    if type(var) is not nnx.Param:
      raise ValueError(f"save_pretrained: {'/'.join(map(str, p))} is a {type(var).__name__}, which has no "
                       "Hugging Face name; merge LoRA adapters into the base weights first")
    arr = np.asarray(jax.device_get(var.get_value()))
    tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
  save_file(tensors, str(root / SINGLE_FILE), metadata={"format": "pt"})
  (root / "config.json").write_text(json.dumps(model.cfg.to_hf_config(), indent=2) + "\n")
  return root
