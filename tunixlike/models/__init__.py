"""Decoder-only transformers (Llama 3.x / Qwen2 / Qwen3, Qwen3-MoE / Mixtral) in Flax NNX, KV cache, HF I/O.
Names are imported on first use (`lazy_exports`): the config imports `models.config` without flax."""

from tunixlike.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("ARCHITECTURES", "MOE_ARCHS", "ModelConfig", "RopeScaling", "llama3_2_1b", "qwen2_5_0_5b",
               "qwen3_0_6b", "qwen3_30b_a3b", "tiny_config", "tiny_moe_config"),
    "hf": ("CheckpointError", "from_pretrained", "save_pretrained"),
    "kv_cache": ("KVCache", "cache_shardings"),
    "moe": ("MoeAux", "load_balancing_loss"),
    "sharding": ("logical_axes", "partition_spec", "state_shardings"),
    "transformer": ("Transformer", "create_sharded"),
})
