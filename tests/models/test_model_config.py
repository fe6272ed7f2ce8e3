"""ModelConfig validation and the config.json mapping (transformers 4.x and 5.x layouts)."""

import pytest

from tunixlike import models


def test_invalid_fields_are_named():
  with pytest.raises(ValueError, match=r"num_heads=6 is not a multiple of num_kv_heads=4"):
    models.tiny_config(num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match=r"ModelConfig.dtype='fp8'"):
    models.tiny_config(dtype="fp8")
  with pytest.raises(ValueError, match=r"ModelConfig.vocab_size=0"):
    models.tiny_config(vocab_size=0)
  with pytest.raises(ValueError, match=r"head_dim=15 must be even"):
    models.tiny_config(head_dim=15)
  with pytest.raises(ValueError, match=r"RopeScaling.high_freq_factor"):
    models.RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)


@pytest.mark.parametrize("cfg", [models.tiny_config(qkv_bias=True),
                                 models.tiny_config(qk_norm=True, tie_embeddings=False),
                                 models.llama3_2_1b(), models.qwen2_5_0_5b(), models.qwen3_0_6b()])
def test_hf_config_round_trip(cfg):
  again = models.ModelConfig.from_hf_config(cfg.to_hf_config())
  assert again == cfg


def test_transformers_4x_layout_is_read():
  hf = dict(models.llama3_2_1b().to_hf_config())
  rope = hf.pop("rope_parameters")
  hf["rope_theta"] = rope.pop("rope_theta")
  hf["rope_scaling"] = rope  # 4.x kept the scaling under rope_scaling
  cfg = models.ModelConfig.from_hf_config(hf)
  assert cfg.rope_theta == 500000.0
  assert cfg.rope_scaling == models.llama3_2_1b().rope_scaling


def test_transformers_config_is_read():
  transformers = pytest.importorskip("transformers")
  hf = transformers.Qwen2Config(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=96, rope_theta=123.0,
                                tie_word_embeddings=True).to_dict()
  cfg = models.ModelConfig.from_hf_config(hf)
  assert (cfg.vocab_size, cfg.num_layers, cfg.head_dim, cfg.rope_theta) == (300, 3, 16, 123.0)
  assert cfg.qkv_bias and not cfg.qk_norm and cfg.tie_embeddings


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2"}, r"config.json: unsupported model_type='gpt2'"),
    ({"architectures": ["MistralForCausalLM"]}, r"unsupported architectures entry 'MistralForCausalLM'"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}}, r"rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, r"llama3' is missing field 'factor'"),
    ({"num_key_value_heads": 3}, r"config.json: ModelConfig.num_heads=4 is not a multiple"),
    ({"vocab_size": None}, r"ModelConfig.vocab_size=None"),
])
def test_bad_hf_config_names_the_field(change, match):
  hf = models.tiny_config().to_hf_config()
  hf.update(change)
  with pytest.raises(ValueError, match=match):
    models.ModelConfig.from_hf_config(hf)


def test_missing_required_field():
  hf = models.tiny_config().to_hf_config()
  del hf["hidden_size"]
  with pytest.raises(ValueError, match=r"missing required field 'hidden_size'"):
    models.ModelConfig.from_hf_config(hf)
