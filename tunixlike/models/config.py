"""ModelConfig: the one description of a decoder-only transformer, and its Hugging Face mapping.

Supported families (all share one implementation in transformer.py):
  llama  (Llama 3.x, incl. llama3 RoPE scaling; no attention/MLP bias),
  qwen2  (Qwen2 / Qwen2.5: bias on q/k/v projections, tied or untied embeddings),
  qwen3  (Qwen3 dense: RMSNorm on q and k per head, no bias),
  qwen3_moe (Qwen3-MoE: qwen3 attention, every MLP a top-k mixture of experts; moe.py),
  mixtral (Mixtral: llama attention, top-k MoE with renormalised gate weights).
`num_experts=0` (the default) is a dense model; `num_experts>0` makes every layer's MLP an MoE.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tunixlike.settings import DTYPES
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
MOE_ARCHS = ("qwen3_moe", "mixtral")
ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "blockwise", "cudnn", "pallas_tpu")  # attention.py
CONTEXT_PARALLEL_SCHEMES = ("ring", "all_gather")  # context_parallel.py
CONTEXT_PARALLEL_LAYOUTS = ("zigzag", "contiguous")  # context_parallel.py: which tokens each device holds


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1 RoPE frequency scaling (HF rope_type 'llama3')."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
      value = getattr(self, name)
      if not value > 0:
        raise ValueError(f"RopeScaling.{name}={value!r} must be > 0")
    if not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
          f"RopeScaling.high_freq_factor={self.high_freq_factor!r} must exceed "
          f"low_freq_factor={self.low_freq_factor!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. The defaults of rope_theta .. attention are also the run config's
  (model.* keys take them from here: `settings.library_setting`)."""

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rope_theta: float = 10_000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False  # Qwen2: bias on q/k/v (not o)
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  tie_embeddings: bool = True
  rope_scaling: RopeScaling | None = None
  param_dtype: str = "float32"  # storage dtype of the parameters
  dtype: str = "float32"  # compute dtype of activations and matmuls (softmax/norms run in fp32)
  remat: bool = False  # rematerialise each layer in the backward pass (nnx.remat)
  attention: str = "auto"  # the full-sequence attention kernel (attention.IMPLEMENTATIONS)
  context_parallel_attention: str = "ring"  # a row split over devices: how keys reach queries (context_parallel.py)
  context_parallel_layout: str = "zigzag"  # ... and which of its tokens each device holds (balanced causal work)
  max_position_embeddings: int = 4096
  init_std: float = 0.02  # stddev of the normal init of every kernel and embedding
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  # Mixture of experts (moe.py). num_experts=0: dense MLP (every field below is ignored).
  num_experts: int = 0
  num_experts_per_tok: int = 0  # k of the top-k routing
  moe_intermediate_size: int = 0  # hidden width of each expert's SwiGLU MLP
  norm_topk_prob: bool = True  # renormalise the k gate weights to sum to 1 (Mixtral always does)
  router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss; the learner applies it

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    for name in ("rope_theta", "rms_norm_eps", "init_std"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"ModelConfig.{name}={value!r} must be a positive finite number")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}, expected one of {DTYPES}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"ModelConfig.attention={self.attention!r}, expected one of {ATTENTION_IMPLEMENTATIONS}")
    if self.context_parallel_attention not in CONTEXT_PARALLEL_SCHEMES:
      raise ValueError(f"ModelConfig.context_parallel_attention={self.context_parallel_attention!r}, expected one "
                       f"of {CONTEXT_PARALLEL_SCHEMES}")
    if self.context_parallel_layout not in CONTEXT_PARALLEL_LAYOUTS:
      raise ValueError(f"ModelConfig.context_parallel_layout={self.context_parallel_layout!r}, expected one "
                       f"of {CONTEXT_PARALLEL_LAYOUTS}")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling!r} must be a RopeScaling or None")
    if not isinstance(self.eos_token_ids, tuple):
      raise ValueError(f"ModelConfig.eos_token_ids={self.eos_token_ids!r} must be a tuple of ints")
    self._check_moe()

  def _check_moe(self):
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a non-negative int")
    if not (isinstance(self.router_aux_loss_coef, (int, float)) and math.isfinite(self.router_aux_loss_coef)
            and self.router_aux_loss_coef >= 0):
      raise ValueError(f"ModelConfig.router_aux_loss_coef={self.router_aux_loss_coef!r} must be finite and >= 0")
    if self.num_experts == 0:
      return
    if not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok!r} must be in "
                       f"[1, num_experts={self.num_experts}]")
    if self.moe_intermediate_size <= 0:
      raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size!r} must be > 0 "
                       f"when num_experts={self.num_experts}")

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  @property
  def arch(self) -> str:
    """The Hugging Face family this config corresponds to."""
    if self.is_moe:
      if self.qkv_bias:
        raise ValueError("ModelConfig with num_experts>0 and qkv_bias matches no supported HF architecture")
      if self.qk_norm:
        return "qwen3_moe"
      if not self.norm_topk_prob:
        raise ValueError("ModelConfig with num_experts>0, no qk_norm and norm_topk_prob=False matches no "
                         "supported HF architecture (Mixtral always renormalises the top-k gate weights)")
      return "mixtral"
    if self.qk_norm:
      if self.qkv_bias:
        raise ValueError("ModelConfig with both qk_norm and qkv_bias matches no supported HF architecture")
      return "qwen3"
    return "qwen2" if self.qkv_bias else "llama"

  # ---------------------------------------------------------------- Hugging Face config.json

  @classmethod
  def from_hf_config(cls, hf: dict[str, Any], *, source: str = "config.json", **overrides) -> ModelConfig:
    """Reads a transformers config.json dict (4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in ARCHITECTURES:
      raise ValueError(f"{source}: unsupported model_type={model_type!r}; supported: {sorted(ARCHITECTURES)}")
    for a in archs:
      if a not in ARCHITECTURES.values():
        raise ValueError(f"{source}: unsupported architectures entry {a!r}; "
                         f"supported: {sorted(ARCHITECTURES.values())}")

    def need(key):
      if key not in hf:
        raise ValueError(f"{source}: missing required field {key!r}")
      return hf[key]

    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
      raise ValueError(f"{source}: mlp_bias=true is not supported")
    moe = _moe_from_hf(hf, model_type, source)
    if model_type != "qwen2" and hf.get("attention_bias"):
      raise ValueError(f"{source}: attention_bias=true is not supported for {model_type}")
    if hf.get("use_sliding_window"):
      raise ValueError(f"{source}: use_sliding_window=true is not supported")

    rope = hf.get("rope_parameters") or {}
    if "rope_parameters" in hf and not isinstance(rope, dict):
      raise ValueError(f"{source}: rope_parameters={rope!r} must be an object")
    legacy = hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling_src = rope if rope.get("rope_type", "default") != "default" else legacy
    rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default"))
    rope_scaling = None
    if rope_type == "llama3":
      try:
        rope_scaling = RopeScaling(
            factor=float(scaling_src["factor"]),
            low_freq_factor=float(scaling_src["low_freq_factor"]),
            high_freq_factor=float(scaling_src["high_freq_factor"]),
            original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]))
      except KeyError as e:
        raise ValueError(f"{source}: rope_type 'llama3' is missing field {e.args[0]!r}") from None
    elif rope_type != "default":
      raise ValueError(f"{source}: rope_type={rope_type!r} is not supported (only 'default', 'llama3')")

    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    kwargs = dict(
        vocab_size=need("vocab_size"), hidden_size=hidden, num_layers=need("num_hidden_layers"),
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads, intermediate_size=need("intermediate_size"),
        rope_theta=float(theta), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2", qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", model_type in ("qwen2", "qwen3"))),
        rope_scaling=rope_scaling, max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        init_std=float(hf.get("initializer_range", 0.02)), bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids, **moe)
    kwargs.update(overrides)
    try:
      return cls(**kwargs)
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from None

  def to_hf_config(self, arch: str | None = None) -> dict[str, Any]:
    """A transformers 5.x config.json dict (AutoConfig / AutoModelForCausalLM load it)."""
    arch = arch or self.arch
    if arch not in ARCHITECTURES:
      raise ValueError(f"to_hf_config: arch={arch!r}, expected one of {sorted(ARCHITECTURES)}")
    if arch != self.arch:
      raise ValueError(f"to_hf_config: arch={arch!r} but the config (qkv_bias={self.qkv_bias}, "
                       f"qk_norm={self.qk_norm}, num_experts={self.num_experts}) is a {self.arch!r} model")
    rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
    if self.rope_scaling is not None:
      rope.update(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
    eos = list(self.eos_token_ids)
    out = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps, "rope_parameters": rope,
        "tie_word_embeddings": self.tie_embeddings, "max_position_embeddings": self.max_position_embeddings,
        "initializer_range": self.init_std, "bos_token_id": self.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "dtype": self.param_dtype,
    }
    if arch == "llama":
      out.update(attention_bias=False, mlp_bias=False)
    if arch in ("qwen3", "qwen3_moe"):
      out["attention_bias"] = False
    if arch == "qwen3_moe":
      out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                 moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                 router_aux_loss_coef=self.router_aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[],
                 use_sliding_window=False)
    if arch == "mixtral":  # Mixtral's experts use intermediate_size; it has no dense MLP width
      out.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                 intermediate_size=self.moe_intermediate_size, router_aux_loss_coef=self.router_aux_loss_coef,
                 sliding_window=None, router_jitter_noise=0.0)
    return out


def _moe_from_hf(hf: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
  """The ModelConfig MoE fields of a qwen3_moe / mixtral config.json (empty for dense families)."""
  if model_type == "qwen3_moe":
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
      raise ValueError(f"{source}: decoder_sparse_step={hf.get('decoder_sparse_step')!r} / mlp_only_layers="
                       f"{hf.get('mlp_only_layers')!r} are not supported (only every layer an MoE)")
    # Hub configs say num_experts; transformers 5.x writes its attribute_map alias num_local_experts.
    return dict(num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)), num_experts_per_tok=hf.get("num_experts_per_tok", 0),
                moe_intermediate_size=hf.get("moe_intermediate_size", 0),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
  if model_type == "mixtral":
    if hf.get("sliding_window") is not None:
      raise ValueError(f"{source}: sliding_window={hf['sliding_window']!r} is not supported (only null)")
    # router_jitter_noise only perturbs training-mode forwards in transformers; it has no inference meaning.
    return dict(num_experts=hf.get("num_local_experts", 0), num_experts_per_tok=hf.get("num_experts_per_tok", 0),
                moe_intermediate_size=hf.get("intermediate_size", 0), norm_topk_prob=True,
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
  return {}


# ------------------------------------------------------------------ presets

def tiny_config(**overrides) -> ModelConfig:
  """A 2-layer model for tests and CPU demos (GQA 4:2, vocab 256)."""
  kw = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=128, max_position_embeddings=512)
  kw.update(overrides)
  return ModelConfig(**kw)


def qwen2_5_0_5b(**overrides) -> ModelConfig:
  kw = dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
            intermediate_size=4864, rope_theta=1e6, rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
            max_position_embeddings=32768, eos_token_ids=(151645, 151643))
  kw.update(overrides)
  return ModelConfig(**kw)


def qwen3_0_6b(**overrides) -> ModelConfig:
  kw = dict(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
            intermediate_size=3072, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
            max_position_embeddings=40960, eos_token_ids=(151645, 151643))
  kw.update(overrides)
  return ModelConfig(**kw)


def llama3_2_1b(**overrides) -> ModelConfig:
  kw = dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
            intermediate_size=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_embeddings=True,
            rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192),
            max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))
  kw.update(overrides)
  return ModelConfig(**kw)


def tiny_moe_config(**overrides) -> ModelConfig:
  """tiny_config with a Qwen3-MoE MLP: 8 experts, top-2, expert width 32."""
  kw = dict(qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
  kw.update(overrides)
  return tiny_config(**kw)


def qwen3_30b_a3b(**overrides) -> ModelConfig:
  kw = dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
            intermediate_size=6144, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True, tie_embeddings=False,
            max_position_embeddings=40960, eos_token_ids=(151645, 151643), num_experts=128,
            num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
  kw.update(overrides)
  return ModelConfig(**kw)
