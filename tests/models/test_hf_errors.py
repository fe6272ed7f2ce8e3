"""Bad checkpoints: each error names the file, tensor or field; nothing loads partially."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tunixlike.models import hf

pytest.importorskip("transformers")


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
  """A private, editable copy of a tiny untied qwen2 checkpoint."""
  return shutil.copytree(hf_checkpoint("qwen2", False), tmp_path / "ckpt")


def _edit_tensors(ckpt, fn):
  file = ckpt / hf.SINGLE_FILE
  tensors = load_file(str(file))
  fn(tensors)
  save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(ckpt, **changes):
  config = json.loads((ckpt / "config.json").read_text())
  config.update(changes)
  (ckpt / "config.json").write_text(json.dumps(config))


def test_missing_directory_and_files(ckpt, tmp_path):
  with pytest.raises(hf.CheckpointError, match=r"nowhere: not a directory"):
    hf.from_pretrained(tmp_path / "nowhere")
  (ckpt / "model.safetensors").unlink()
  with pytest.raises(hf.CheckpointError, match=r"neither model.safetensors nor model.safetensors.index.json"):
    hf.from_pretrained(ckpt)
  (ckpt / "config.json").unlink()
  with pytest.raises(hf.CheckpointError, match=r"config.json: file not found"):
    hf.from_pretrained(ckpt)


def test_wrong_shape_names_the_tensor(ckpt):
  name = "model.layers.1.mlp.up_proj.weight"
  _edit_tensors(ckpt, lambda t: t.update({name: np.zeros((64, 64), np.float32)}))
  with pytest.raises(hf.CheckpointError, match=rf"model.safetensors: tensor '{name}' has shape \[64, 64\], "
                                               r"expected \[128, 64\]"):
    hf.from_pretrained(ckpt)


def test_missing_tensor_is_named(ckpt):
  _edit_tensors(ckpt, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
  with pytest.raises(hf.CheckpointError, match=r"missing tensor\(s\) \['model.layers.0.self_attn.k_proj.bias'\]"):
    hf.from_pretrained(ckpt)


def test_unexpected_tensor_is_named(ckpt):
  _edit_tensors(ckpt, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((128, 64), np.float32)}))
  with pytest.raises(hf.CheckpointError, match=r"unexpected tensor\(s\) \['model.layers.2.mlp.up_proj.weight'\]"):
    hf.from_pretrained(ckpt)


def test_unknown_architecture_is_named(ckpt):
  _edit_config(ckpt, architectures=["GPT2LMHeadModel"])
  with pytest.raises(ValueError, match=r"config.json: unsupported architectures entry 'GPT2LMHeadModel'"):
    hf.from_pretrained(ckpt)
  _edit_config(ckpt, architectures=None, model_type="mistral")
  with pytest.raises(ValueError, match=r"config.json: unsupported model_type='mistral'"):
    hf.from_pretrained(ckpt)


def test_truncated_safetensors_is_named(ckpt):
  file = ckpt / hf.SINGLE_FILE
  file.write_bytes(file.read_bytes()[:-100])
  with pytest.raises(hf.CheckpointError, match=r"model.safetensors: unreadable safetensors file"):
    hf.from_pretrained(ckpt)


def test_sharded_index_problems(hf_checkpoint, tmp_path):
  ckpt = shutil.copytree(hf_checkpoint("qwen2", False, max_shard_size="40KB"), tmp_path / "sharded")
  index = json.loads((ckpt / hf.INDEX_FILE).read_text())
  shard = sorted(set(index["weight_map"].values()))[-1]
  (ckpt / shard).write_bytes((ckpt / shard).read_bytes()[:50])
  with pytest.raises(hf.CheckpointError, match=rf"{shard}: unreadable safetensors file"):
    hf.from_pretrained(ckpt)
  (ckpt / shard).unlink()
  with pytest.raises(hf.CheckpointError, match=rf"{shard}: file not found \(listed in .*index.json\)"):
    hf.from_pretrained(ckpt)


def test_index_pointing_to_wrong_file(hf_checkpoint, tmp_path):
  ckpt = shutil.copytree(hf_checkpoint("qwen2", False, max_shard_size="40KB"), tmp_path / "sharded")
  index = json.loads((ckpt / hf.INDEX_FILE).read_text())
  files = sorted(set(index["weight_map"].values()))
  name = next(n for n, f in index["weight_map"].items() if f == files[0])
  index["weight_map"][name] = files[1]
  (ckpt / hf.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(hf.CheckpointError, match=rf"{files[1]}: tensor '{name}' listed in .* is not in the file"):
    hf.from_pretrained(ckpt)


def test_save_refuses_lora_params(hf_checkpoint, tmp_path):
  from flax import nnx
  model = hf.from_pretrained(hf_checkpoint("qwen3", True))
  model.layers[0].attn.q_proj.lora_a = nnx.LoRAParam(np.zeros((64, 2), np.float32))
  with pytest.raises(ValueError, match=r"layers/0/attn/q_proj/lora_a is a LoRAParam"):
    hf.save_pretrained(model, tmp_path / "out")
