"""Data: tokenizers, built-in tasks, record sources and grain prompt pipelines."""

from tunixlike.data import char_tokenizer, pipeline, sources, tasks, tokenizer
from tunixlike.data.pipeline import PipelineConfig, PromptPipeline
from tunixlike.data.tokenizer import Tokenizer

__all__ = ["char_tokenizer", "pipeline", "sources", "tasks", "tokenizer", "PipelineConfig", "PromptPipeline",
           "Tokenizer"]
