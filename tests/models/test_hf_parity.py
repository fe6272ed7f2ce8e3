"""Parity with transformers (fp32, atol 1e-4) for every supported architecture, tied and untied."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunixlike.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ARCH_CASES = [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False), ("qwen3", True),
              ("qwen3", False)]
RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"))
LENGTHS, T = [9, 4, 7], 9


def _torch_logits(path, toks, lengths):
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
  mask = (np.arange(toks.shape[1])[None] < np.asarray(lengths)[:, None]).astype(np.int64)
  with torch.no_grad():
    return model(torch.tensor(toks, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()


def _assert_valid_close(ours, ref, lengths, atol=1e-4):
  for b, n in enumerate(lengths):  # padded positions are don't-care
    np.testing.assert_allclose(np.asarray(ours)[b, :n], ref[b, :n], atol=atol, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch, tie", ARCH_CASES)
def test_logits_and_cached_decode_match_transformers(arch, tie, hf_checkpoint, random_batch):
  path = hf_checkpoint(arch, tie)
  model = hf.from_pretrained(path)
  assert model.cfg.arch == arch and model.cfg.tie_embeddings == tie
  assert (model.cfg.rope_scaling is not None) == (arch == "llama")
  toks, lengths = random_batch(model.cfg.vocab_size, LENGTHS, T, seed=len(arch) + tie)
  ref = _torch_logits(path, toks, lengths)
  assert np.abs(ref).max() > 1.0  # random weights are large enough that a wrong op shows
  _assert_valid_close(model(jnp.asarray(toks)), ref, LENGTHS)

  # Cached: prefill the first 3 tokens of every row, then decode the rest one by one.
  cache = model.init_cache(len(LENGTHS), 16)
  prefix = np.minimum(lengths, 3)
  logits, cache = model.prefill(jnp.asarray(toks[:, :3]), cache, jnp.asarray(prefix))
  _assert_valid_close(logits, ref, prefix)
  step = jax.jit(lambda m, t, p, c: m.decode_step(t, p, c, 16))
  for pos in range(3, T):
    logits_bv, cache = step(model, jnp.asarray(toks[:, pos]), jnp.full((3,), pos, jnp.int32), cache)
    live = pos < lengths
    np.testing.assert_allclose(np.asarray(logits_bv)[live], ref[live, pos], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_save_pretrained_round_trips_through_transformers(arch, tie, hf_checkpoint, random_batch, tmp_path):
  model = hf.from_pretrained(hf_checkpoint(arch, tie))
  out = hf.save_pretrained(model, tmp_path / "export")
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == arch and "rope_parameters" in config
  toks, lengths = random_batch(model.cfg.vocab_size, LENGTHS, T)
  _assert_valid_close(model(jnp.asarray(toks)), _torch_logits(out, toks, lengths), LENGTHS)
  again = hf.from_pretrained(out)
  assert again.cfg == model.cfg
  np.testing.assert_array_equal(again(jnp.asarray(toks)), model(jnp.asarray(toks)))


def test_sharded_checkpoint_loads_onto_a_mesh(hf_checkpoint, mesh4, random_batch):
  sharded_dir = hf_checkpoint("qwen2", False, max_shard_size="40KB")
  assert (sharded_dir / hf.INDEX_FILE).is_file()
  model = hf.from_pretrained(sharded_dir, mesh=mesh4, rules=RULES)
  plain = hf.from_pretrained(hf_checkpoint("qwen2", False))
  gate = model.layers[0].mlp.gate_proj.kernel.get_value()
  assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (32, 64)  # each device holds a quarter
  bias = model.layers[0].attn.k_proj.bias.get_value()
  assert bias.sharding.spec == jax.sharding.PartitionSpec("tensor")
  toks, _ = random_batch(model.cfg.vocab_size, LENGTHS, T)
  np.testing.assert_allclose(jax.jit(lambda m, t: m(t))(model, jnp.asarray(toks)), plain(jnp.asarray(toks)),
                             atol=1e-5)


def test_dtype_override_casts_parameters(hf_checkpoint):
  model = hf.from_pretrained(hf_checkpoint("qwen3", True), dtype=jnp.bfloat16)
  assert model.cfg.param_dtype == model.cfg.dtype == "bfloat16"
  assert model.layers[1].attn.q_norm.weight.get_value().dtype == jnp.bfloat16


def test_transformers_4x_config_layout_loads(hf_checkpoint, tmp_path, random_batch):
  import shutil
  src = hf_checkpoint("llama", False)
  dst = shutil.copytree(src, tmp_path / "v4")
  config = json.loads((dst / "config.json").read_text())
  rope = config.pop("rope_parameters")
  config["rope_theta"] = rope.pop("rope_theta")
  config["rope_scaling"] = rope
  (dst / "config.json").write_text(json.dumps(config))
  toks, _ = random_batch(256, LENGTHS, T)
  np.testing.assert_array_equal(hf.from_pretrained(dst)(jnp.asarray(toks)),
                                hf.from_pretrained(src)(jnp.asarray(toks)))
