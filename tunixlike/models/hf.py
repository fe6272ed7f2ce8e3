"""Hugging Face checkpoint import / export (local directories; safetensors only).

MoE expert weights are one stacked [X, in, out] array per projection here and one tensor per
expert on disk (the Hub layout that transformers 5.x also writes: `mlp.experts.{e}.gate_proj.weight`
for Qwen3-MoE, `block_sparse_moe.experts.{e}.w1.weight` for Mixtral); the mapping is in hf_sources.

from_pretrained reads config.json plus model.safetensors or a sharded model.safetensors.index.json.
With a mesh, each tensor is placed directly with its target sharding: every device reads only its
own slice from the (memory-mapped) file, so the model is never whole on one device. Any mismatch
(missing file, missing / unexpected tensor, wrong shape, truncated file, unsupported architecture)
raises an error naming the file, tensor or field; nothing is ever partially loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import uuid
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


_MIXTRAL_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def hf_sources(path: tuple, cfg: ModelConfig) -> tuple[list[str], bool, bool]:
  """Our parameter path -> (HF tensor names, transposed, stacked).

  Expert stacks [X, in, out] (stacked=True) map to X names, one [out, in] tensor per expert.
  """
  parts = [str(p) for p in path]
  if cfg.is_moe and cfg.arch == "mixtral":
    parts = ["block_sparse_moe" if p == "mlp" else p for p in parts]
  if len(parts) >= 2 and parts[-2] == "experts":
    mods = ".".join("self_attn" if p == "attn" else p for p in parts[:-1])
    leaf = _MIXTRAL_EXPERT[parts[-1]] if cfg.arch == "mixtral" else parts[-1]
    return [f"model.{mods}.{e}.{leaf}.weight" for e in range(cfg.num_experts)], True, True
  name, transpose = hf_name(tuple(parts))
  return [name], transpose, False


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
  """Loads a local HF Llama 3.x / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral directory.

  dtype: parameter and compute dtype (e.g. 'bfloat16'); default float32 whatever the file holds.
  mesh/rules: place every parameter with `state_shardings(model, mesh, rules)` (rules=None replicates).
  Without a mesh, parameters go to the default device.
  """
  root = pathlib.Path(path)
  if not root.is_dir():
    raise CheckpointError(f"{root}: not a directory{'' if root.exists() else ' (it does not exist)'}")
  if not any(root.iterdir()):
    raise CheckpointError(f"{root}: directory is empty")
  cfg = _load_config(root, dtype)
  files = _tensor_files(root)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  if mesh is not None:
    check_mesh(mesh)
    shardings = dict(nnx.to_flat_state(sharding_lib.state_shardings(abstract, mesh, rules or ())))

  params, wanted = [], set()
  for p, var in nnx.to_flat_state(abstract):
    names, transpose, stacked = hf_sources(p, cfg)
    params.append((p, var, names, transpose, stacked))
    wanted.update(names)
  missing = sorted(set(wanted) - set(files))
  if missing:
    raise CheckpointError(f"{root}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                          f"for {cfg.arch} with {cfg.num_layers} layers")
  unexpected = sorted(n for n in set(files) - set(wanted) if not _ignored(n, cfg))
  if unexpected:
    raise CheckpointError(f"{root}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
                          f" in {files[unexpected[0]].name}; config.json does not describe this checkpoint")

  from safetensors import SafetensorError, safe_open
  flat = []
  with contextlib.ExitStack() as stack:
    opened: dict[pathlib.Path, tuple[Any, set[str]]] = {}

    def get_slice(name):
      file = files[name]
      try:
        if file not in opened:
          handle = stack.enter_context(safe_open(str(file), framework="numpy"))
          opened[file] = handle, set(handle.keys())
        handle, present = opened[file]
        if name not in present:
          raise CheckpointError(f"{file}: tensor {name!r} listed in {INDEX_FILE} is not in the file")
        return handle.get_slice(name)
      except SafetensorError as e:
        raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None

    for p, var, names, transpose, stacked in params:
      sources = [(get_slice(n), n, files[n]) for n in names]
      sharding = shardings[p].get_value() if mesh is not None else None
      try:
        flat.append((p, var.replace(_place(sources, var.get_value(), transpose, stacked, sharding))))
      except SafetensorError as e:
        raise CheckpointError(f"{files[names[0]]}: unreadable safetensors file ({e})") from None
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place(sources, target: jax.ShapeDtypeStruct, transpose: bool, stacked: bool, sharding):
  """sources: [(slice, name, file)], one tensor, or (stacked) one per expert on a leading axis."""
  inner = tuple(target.shape[1:] if stacked else target.shape)
  want = tuple(reversed(inner)) if transpose else inner
  for slice_, name, file in sources:
    shape = tuple(slice_.get_shape())
    if shape != want:
      raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)}, expected {list(want)}")
  dtype = np.dtype(target.dtype)

  def read_one(slice_, index) -> np.ndarray:
    hf_index = tuple(reversed(index)) if transpose else index
    block = np.asarray(slice_[hf_index] if hf_index else slice_[:])
    return np.ascontiguousarray(block.T if transpose else block).astype(dtype)

  def read(index) -> np.ndarray:
    index = tuple(index) if index is not None else tuple(slice(None) for _ in target.shape)
    if not stacked:
      return read_one(sources[0][0], index)
    experts = range(len(sources))[index[0]]
    return np.stack([read_one(sources[e][0], index[1:]) for e in experts])

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
    names, transpose, stacked = hf_sources(p, model.cfg)
    if type(var) is not nnx.Param:
      raise ValueError(f"save_pretrained: {'/'.join(map(str, p))} is a {type(var).__name__}, which has no "
                       "Hugging Face name; merge LoRA adapters into the base weights first")
    arr = np.asarray(jax.device_get(var.get_value()))
    for name, part in zip(names, arr if stacked else [arr]):
      tensors[name] = np.ascontiguousarray(part.T if transpose else part)
  save_file(tensors, str(root / SINGLE_FILE), metadata={"format": "pt"})
  # safetensors writes a private temporary file (0600) and renames it into place: give the file the
  # mode every other file gets, so other users of a shared machine can read the model.
  os.chmod(root / SINGLE_FILE, _new_file_mode(root))
  (root / "config.json").write_text(json.dumps(model.cfg.to_hf_config(), indent=2) + "\n")
  return root


def _new_file_mode(directory: pathlib.Path) -> int:
  """The permission bits a file created in `directory` gets (0666 less the umask, or the directory's
  default ACL). Read from a probe file: reading the umask means setting it, for every thread."""
  probe = directory / f".mode-probe-{uuid.uuid4().hex}"
  fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  try:
    return os.fstat(fd).st_mode & 0o777
  finally:
    os.close(fd)
    os.remove(probe)
