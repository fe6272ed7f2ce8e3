"""Qwen3-MoE / Mixtral Hugging Face interop: parity with transformers (fp32), export, sharded import."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from tunixlike import models
from tunixlike.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LENGTHS, T = [9, 4, 7], 9
MOE_RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
             ("mlp", "tensor"), ("expert", "fsdp"))
_forward = jax.jit(lambda m, t: m(t, return_aux=True))


def _torch_out(path, toks, lengths):
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
  mask = (np.arange(toks.shape[1])[None] < np.asarray(lengths)[:, None]).astype(np.int64)
  with torch.no_grad():
    out = model(torch.tensor(toks, dtype=torch.long), attention_mask=torch.tensor(mask), output_router_logits=True)
  return out.logits.numpy(), np.stack([r.numpy().reshape(*toks.shape, -1) for r in out.router_logits], axis=2)


def _assert_valid_close(ours, ref, lengths, atol=1e-4):
  for b, n in enumerate(lengths):  # padded positions are don't-care
    np.testing.assert_allclose(np.asarray(ours)[b, :n], ref[b, :n], atol=atol, rtol=0)


@pytest.mark.parametrize("arch, tie, kw", [("qwen3_moe", False, {}), ("qwen3_moe", True, {"norm_topk_prob": False}),
                                           ("mixtral", False, {})])
def test_logits_routing_and_cached_decode_match_transformers(arch, tie, kw, hf_checkpoint, random_batch):
  model = hf.from_pretrained(hf_checkpoint(arch, tie, **kw))
  assert model.cfg.arch == arch and model.cfg.num_experts == 8 and model.cfg.tie_embeddings == tie
  assert model.cfg.norm_topk_prob == kw.get("norm_topk_prob", True)
  toks, lengths = random_batch(model.cfg.vocab_size, LENGTHS, T, seed=len(arch) + tie)
  ref, ref_router_btlx = _torch_out(hf_checkpoint(arch, tie, **kw), toks, lengths)
  assert np.abs(ref).max() > 1.0
  logits, aux = _forward(model, jnp.asarray(toks))
  _assert_valid_close(logits, ref, LENGTHS)
  _assert_valid_close(aux.router_logits_btlx, ref_router_btlx, LENGTHS)
  ref_top_btlk = torch.topk(torch.tensor(ref_router_btlx), 2, dim=-1).indices.numpy()
  for b, n in enumerate(LENGTHS):
    np.testing.assert_array_equal(np.asarray(aux.routing_btlk)[b, :n], ref_top_btlk[b, :n])

  cache = model.init_cache(len(LENGTHS), 16)
  prefix = np.minimum(lengths, 3)
  p_logits, cache = model.prefill(jnp.asarray(toks[:, :3]), cache, jnp.asarray(prefix))
  _assert_valid_close(p_logits, ref, prefix)
  step = jax.jit(lambda m, t, p, c: m.decode_step(t, p, c, 16))
  for pos in range(3, T):
    logits_bv, cache = step(model, jnp.asarray(toks[:, pos]), jnp.full((3,), pos, jnp.int32), cache)
    live = pos < lengths
    np.testing.assert_allclose(np.asarray(logits_bv)[live], ref[live, pos], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, expert_name", [("qwen3_moe", "mlp.experts.7.gate_proj.weight"),
                                               ("mixtral", "block_sparse_moe.experts.7.w1.weight")])
def test_save_pretrained_round_trips_through_transformers(arch, expert_name, hf_checkpoint, random_batch, tmp_path):
  model = hf.from_pretrained(hf_checkpoint(arch, False))
  out = hf.save_pretrained(model, tmp_path / "export")
  assert json.loads((out / "config.json").read_text())["model_type"] == arch
  with safe_open(str(out / hf.SINGLE_FILE), framework="numpy") as f:  # the Hub's per-expert layout
    np.testing.assert_array_equal(f.get_tensor(f"model.layers.1.{expert_name}"),
                                  np.asarray(model.layers[1].mlp.experts.gate_proj.get_value()[7]).T)
  toks, lengths = random_batch(model.cfg.vocab_size, LENGTHS, T)
  _assert_valid_close(model(jnp.asarray(toks)), _torch_out(out, toks, lengths)[0], LENGTHS)
  again = hf.from_pretrained(out)
  assert again.cfg == model.cfg
  np.testing.assert_array_equal(_forward(again, jnp.asarray(toks))[0], _forward(model, jnp.asarray(toks))[0])


def test_sharded_moe_checkpoint_loads_onto_an_expert_mesh(hf_checkpoint, mesh4, random_batch):
  sharded_dir = hf_checkpoint("qwen3_moe", False, max_shard_size="40KB")
  assert (sharded_dir / hf.INDEX_FILE).is_file()
  model = hf.from_pretrained(sharded_dir, mesh=mesh4, rules=MOE_RULES)
  up = model.layers[0].mlp.experts.up_proj.get_value()
  assert up.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, "tensor")
  assert up.addressable_shards[0].data.shape == (4, 64, 16)  # 4 of 8 experts, half of each expert's width
  plain = hf.from_pretrained(hf_checkpoint("qwen3_moe", False))
  toks, _ = random_batch(model.cfg.vocab_size, LENGTHS, T)
  np.testing.assert_allclose(_forward(model, jnp.asarray(toks))[0], _forward(plain, jnp.asarray(toks))[0],
                             atol=1e-5)


def test_missing_expert_tensor_is_named(hf_checkpoint, tmp_path):
  import shutil
  from safetensors.numpy import load_file, save_file
  dst = shutil.copytree(hf_checkpoint("mixtral", False), tmp_path / "broken")
  tensors = load_file(str(dst / hf.SINGLE_FILE))
  del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
  save_file(tensors, str(dst / hf.SINGLE_FILE))
  with pytest.raises(hf.CheckpointError, match=r"missing tensor\(s\) \['model.layers.1.block_sparse_moe.experts.3"):
    hf.from_pretrained(dst)


@pytest.mark.parametrize("cfg", [models.tiny_moe_config(), models.qwen3_30b_a3b(),
                                 models.tiny_moe_config(qk_norm=False, intermediate_size=32)])
def test_moe_hf_config_round_trip(cfg):
  assert models.ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


@pytest.mark.parametrize("change, match", [
    ({"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] are not supported"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be in \[1, num_experts=8\]"),
])
def test_bad_moe_hf_config_names_the_field(change, match):
  hf_cfg = models.tiny_moe_config().to_hf_config()
  hf_cfg.update(change)
  with pytest.raises(ValueError, match=match):
    models.ModelConfig.from_hf_config(hf_cfg)


def test_unmappable_moe_config_is_refused():
  with pytest.raises(ValueError, match=r"norm_topk_prob=False matches no supported HF architecture"):
    _ = models.tiny_moe_config(qk_norm=False, norm_topk_prob=False).arch
