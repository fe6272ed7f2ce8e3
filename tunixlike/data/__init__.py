"""Data: tokenizers, built-in tasks, record sources and grain prompt pipelines. Names are imported on
first use (`lazy_exports`): the config imports `data.tasks` without grain and orbax (half a second
of every `--check_only`)."""

from tunixlike.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "pipeline": ("PipelineConfig", "PromptPipeline"),
    "tokenizer": ("Tokenizer",),
})
