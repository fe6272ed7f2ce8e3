"""A model named by its Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`) or by a local directory.

`resolve(name)` is the local directory the run reads: a directory as given, or a Hub id's snapshot
through `huggingface_hub.snapshot_download`, which keeps huggingface_hub's own cache
(`HF_HOME` / `HF_HUB_CACHE`, laid out `models--org--name/snapshots/<commit>/...` with
`refs/<branch>`), takes a `revision` (branch, tag or commit) and honours `HF_HUB_OFFLINE=1` (then only
the cache is read). Only the files a run reads are fetched: config, weights (safetensors), tokenizer.
The config keeps the name, so a checkpoint's saved config finds the model again on another machine.
"""

from __future__ import annotations

import functools
import os
import re

# What from_pretrained and the tokenizer read; nothing else of a repository is downloaded.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubError(ValueError):
  """A Hub name that cannot be resolved (not cached while offline, no such repository): one line."""


def is_hub_name(value: str) -> bool:
  """`org/name` that is not an existing path (a local directory always wins)."""
  return bool(_REPO_ID.fullmatch(value)) and not os.path.exists(value)


def offline() -> bool:
  from huggingface_hub import constants
  return bool(constants.HF_HUB_OFFLINE)


def _where(value: str, revision: str | None) -> str:
  from huggingface_hub import constants
  at = f" at revision {revision!r}" if revision else ""
  return f"{value!r}{at} is not a local directory, and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"


def not_cached(value: str, revision: str | None, key: str) -> str:
  """The one line for a Hub name that is not cached while offline."""
  return (f"{key}={_where(value, revision)} while HF_HUB_OFFLINE=1: download it where there is network "
          f"(huggingface-cli download {value}) into that cache, or give a local directory")


def cached(value: str, revision: str | None = None) -> str | None:
  """The cached snapshot directory of Hub name `value`, or None when the cache does not have it."""
  from huggingface_hub import snapshot_download
  from huggingface_hub.errors import LocalEntryNotFoundError
  try:
    return snapshot_download(value, revision=revision, allow_patterns=list(MODEL_FILES), local_files_only=True)
  except LocalEntryNotFoundError:
    return None


@functools.lru_cache(maxsize=None)
def resolve(value: str, revision: str | None = None, *, key: str = "model.hf_path") -> str:
  """The local directory of `value`: itself when it is a path, else the Hub snapshot (downloaded
  when online and not cached). Raises HubError, naming `key`, when it cannot be had."""
  if not is_hub_name(value):
    return value
  if offline():
    path = cached(value, revision)
    if path is None:
      raise HubError(not_cached(value, revision, key))
    return path
  from huggingface_hub import snapshot_download
  from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
  try:
    return snapshot_download(value, revision=revision, allow_patterns=list(MODEL_FILES))
  except LocalEntryNotFoundError as e:  # no network, and not cached
    raise HubError(f"{key}={_where(value, revision)}, and the Hub cannot be reached: {e}") from None
  except HfHubHTTPError as e:  # no such repository or revision, gated, ...
    raise HubError(f"{key}={value!r}: {' '.join(str(e).split())}") from None
