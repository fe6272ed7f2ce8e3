"""Tiny random Hugging Face checkpoints written by transformers itself (tests, benchmarks, notebooks).

Needs torch and transformers (test-only dependencies), imported lazily.
"""

from __future__ import annotations

import pathlib

from tunixlike.models.config import ARCHITECTURES, MOE_ARCHS, ModelConfig, RopeScaling

TINY_SIZES = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)
# MoE families: 8 experts, top-2 (Mixtral's experts use intermediate_size, so both widths agree).
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def tiny_hf_config(arch: str = "qwen2", tie_embeddings: bool = True, llama3_rope: bool | None = None,
                   **sizes) -> ModelConfig:
  """The ModelConfig of a tiny checkpoint of `arch` (llama / qwen2 / qwen3 / qwen3_moe / mixtral)."""
  if arch not in ARCHITECTURES:
    raise ValueError(f"arch={arch!r}, expected one of {sorted(ARCHITECTURES)}")
  kw = dict(TINY_SIZES, max_position_embeddings=128, rope_theta=10_000.0, rms_norm_eps=1e-6,
            qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "qwen3_moe"), tie_embeddings=tie_embeddings)
  if arch in MOE_ARCHS:
    kw.update(TINY_MOE)
  if arch == "mixtral":
    kw["intermediate_size"] = kw["moe_intermediate_size"]
  if llama3_rope if llama3_rope is not None else arch == "llama":
    # original context 32 with head_dim 16 puts RoPE frequencies in all three llama3 bands.
    kw["rope_scaling"] = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=32)
  kw.update(sizes)
  return ModelConfig(**kw)


def write_random_hf_checkpoint(path, arch: str = "qwen2", tie_embeddings: bool = True, *, seed: int = 0,
                               std: float = 0.1, max_shard_size: str | None = None,
                               llama3_rope: bool | None = None, dtype: str = "float32", **sizes) -> pathlib.Path:
  """Writes a random `arch` checkpoint with transformers' own save_pretrained; returns the directory.

  Every tensor is random, including biases and norm weights (1 + noise), so a parity test
  catches a missing bias or norm; std is large enough that logits are O(1), not all near zero.
  max_shard_size (e.g. '20KB') writes a sharded model.safetensors.index.json checkpoint.
  dtype: the dtype of the tensors on disk ('bfloat16' as the Hub's Qwen2.5 checkpoints are).
  """
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError("write_random_hf_checkpoint needs torch and transformers "
                      "(pip install -e '.[test]')") from e
  cfg = tiny_hf_config(arch, tie_embeddings, llama3_rope, **sizes)
  hf = cfg.to_hf_config(arch)
  hf.pop("architectures")
  hf_config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.normal_(0.0, std)
  root = pathlib.Path(path)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.to(getattr(torch, dtype)).save_pretrained(str(root), **kwargs)
  return root


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_bpe_tokenizer(path, vocab_size: int = 1024) -> pathlib.Path:
  """Writes a byte-level BPE tokenizer in the Qwen2 format (tokenizer.json with merges, ByteLevel
  pre-tokenizer and decoder, <|endoftext|> / <|im_start|> / <|im_end|>, a ChatML template in
  tokenizer_config.json), trained by `tokenizers` on generated arithmetic and English text.

  Every byte has a token, so any text round-trips; the vocabulary is far smaller than a real
  model's (the model's embedding table may be larger, as Qwen2.5's 151936 rows are for 151665 tokens).
  """
  import random

  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  from tunixlike.data.tokenizer import Tokenizer
  rng = random.Random(0)
  words = ("the of and to in is that it for was on are as with his they at be this from have or by one had not "
           "but what all were when we there can an your which their said if do will each about how up out them "
           "then she many some so these would other into has more her two like him see time could no make than "
           "first been its who now people my made over did down only way find use may water long little very "
           "after words called just where most know answer number sum plus equals question think step").split()
  lines = [f"{rng.randint(0, 999)}+{rng.randint(0, 999)}={rng.randint(0, 1998)}" for _ in range(2000)]
  lines += [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + "." for _ in range(2000)]
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN_SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  hf.train_from_iterator(lines, trainer)
  tok = Tokenizer(hf, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=QWEN_CHAT_TEMPLATE)
  root = pathlib.Path(path)
  tok.save(str(root))
  return root
