"""The sampler: a JetStream-shaped decode engine, token sampling and the rollout driver."""

from tunixlike.sampler.config import SamplerConfig
from tunixlike.sampler.driver import DriverError, DriverStats, PromptRequest, RolloutDriver
from tunixlike.sampler.engine import DecodeState, Engine, GenerateResult, Prefix, PromptError
from tunixlike.sampler.paged import PagedEngine, make_engine
from tunixlike.sampler.sampling import Sample, SamplingParams, process_logits, sample, sample_with_uniform, unpack_mask

__all__ = [
    "DecodeState", "DriverError", "DriverStats", "Engine", "GenerateResult", "PagedEngine", "Prefix", "PromptError",
    "PromptRequest", "RolloutDriver", "Sample", "SamplerConfig", "SamplingParams", "process_logits", "sample",
    "sample_with_uniform", "unpack_mask", "make_engine",
]
