"""The sampler: a JetStream-shaped decode engine, token sampling and the rollout driver. Names are
imported on first use (`lazy_exports`): the config imports `sampler.config` without the engine."""

from tunixlike.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("SamplerConfig",),
    "driver": ("DriverError", "DriverStats", "PromptRequest", "RolloutDriver"),
    "engine": ("DecodeState", "Engine", "GenerateResult", "Prefix", "PromptError"),
    "paged": ("PagedEngine", "make_engine"),
    "sampling": ("Sample", "SamplingParams", "process_logits", "sample", "sample_with_uniform", "unpack_mask"),
})
