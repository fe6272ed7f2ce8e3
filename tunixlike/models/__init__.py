"""Decoder-only transformers (Llama 3.x / Qwen2 / Qwen3, Qwen3-MoE / Mixtral) in Flax NNX, KV cache, HF I/O."""

from tunixlike.models.config import (ARCHITECTURES, MOE_ARCHS, ModelConfig, RopeScaling, llama3_2_1b,
                                     qwen2_5_0_5b, qwen3_0_6b, qwen3_30b_a3b, tiny_config, tiny_moe_config)
from tunixlike.models.hf import CheckpointError, from_pretrained, save_pretrained
from tunixlike.models.kv_cache import KVCache, cache_shardings
from tunixlike.models.moe import MoeAux, load_balancing_loss
from tunixlike.models.sharding import logical_axes, partition_spec, state_shardings
from tunixlike.models.transformer import Transformer, create_sharded

__all__ = [
    "ARCHITECTURES", "MOE_ARCHS", "CheckpointError", "KVCache", "from_pretrained", "save_pretrained", "ModelConfig", "MoeAux", "RopeScaling", "Transformer",
    "cache_shardings", "create_sharded", "llama3_2_1b", "load_balancing_loss", "logical_axes", "partition_spec",
    "qwen2_5_0_5b", "qwen3_0_6b", "qwen3_30b_a3b", "state_shardings", "tiny_config", "tiny_moe_config",
]
