"""Decoder-only transformers (Llama 3.x / Qwen2 / Qwen3) in Flax NNX, KV cache, HF checkpoint I/O."""

from tunixlike.models.config import (ARCHITECTURES, PRESETS, ModelConfig, RopeScaling, llama3_2_1b,
                                     qwen2_5_0_5b, qwen3_0_6b, tiny_config)
from tunixlike.models.kv_cache import KVCache, cache_shardings
from tunixlike.models.sharding import logical_axes, partition_spec, state_shardings
from tunixlike.models.transformer import Transformer, create_sharded

__all__ = [
    "ARCHITECTURES", "PRESETS", "KVCache", "ModelConfig", "RopeScaling", "Transformer", "cache_shardings",
    "create_sharded", "llama3_2_1b", "logical_axes", "partition_spec", "qwen2_5_0_5b", "qwen3_0_6b",
    "state_shardings", "tiny_config",
]
