"""Tokenizers: a thin wrapper over Hugging Face `tokenizers` plus the model's chat template.

`load(path)` reads a local HF directory (tokenizer.json, tokenizer_config.json and, when present,
chat_template.jinja / generation_config.json) or a bare tokenizer.json file. The wrapper exposes
what the trainer needs and nothing else: encode / decode, the special ids, the vocabulary size
and `format_prompt`, which applies the chat template when the model has one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import tokenizers

from tunixlike.data import chat_template

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_content(value: Any) -> str | None:
  """tokenizer_config.json stores special tokens as a string or as a serialized AddedToken dict."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and "content" in value:
    return value["content"]
  raise ValueError(f"cannot read special token {value!r}")


class Tokenizer:
  """A `tokenizers.Tokenizer` with named special tokens and an optional chat template."""

  def __init__(self, hf: tokenizers.Tokenizer, *, eos_token: str, pad_token: str | None = None,
               bos_token: str | None = None, unk_token: str | None = None, chat_template: str | None = None,
               extra_stop_ids: Sequence[int] = ()):
    self.hf = hf
    self.chat_template = chat_template
    self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token,
                           "unk_token": unk_token}
    self.eos_id = self._id_of("eos_token", eos_token)
    # Models without a pad token pad with eos; padding positions are masked out anyway.
    self.pad_id = self._id_of("pad_token", pad_token) if pad_token is not None else self.eos_id
    self.bos_id = self._id_of("bos_token", bos_token) if bos_token is not None else None
    self.stop_ids = tuple(dict.fromkeys([self.eos_id, *extra_stop_ids]))

  def _id_of(self, key: str, token: str) -> int:
    token_id = self.hf.token_to_id(token)
    if token_id is None:
      raise ValueError(f"tokenizer {key}={token!r} is not in the vocabulary")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self.hf.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
    return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_batch(self, ids: Sequence[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
    return self.hf.decode_batch([[int(i) for i in row] for row in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                          **variables: Any) -> str:
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template')")
    tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
    return chat_template.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                **{**tokens, **variables})

  def format_prompt(self, text: str, *, system: str | None = None, use_chat_template: bool = True) -> str:
    """The text the sampler continues: the chat template around one user turn, or `text` as is."""
    if not (use_chat_template and self.chat_template):
      return text
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return self.apply_chat_template(messages, add_generation_prompt=True)

  def encode_prompt(self, formatted: str, *, templated: bool) -> list[int]:
    # A rendered chat template already contains every special token it wants (as transformers'
    # apply_chat_template(tokenize=True) assumes), so the post-processor must not add a second bos.
    return self.encode(formatted, add_special_tokens=not templated)

  def save(self, directory: str) -> None:
    """Writes tokenizer.json and tokenizer_config.json so that `load` (and transformers) can read them."""
    os.makedirs(directory, exist_ok=True)
    self.hf.save(os.path.join(directory, "tokenizer.json"))
    config: dict[str, Any] = {k: v for k, v in self.special_tokens.items() if v is not None}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=2)


def _read_json(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {path}: {e}") from e


def _chat_template(directory: str, config: dict[str, Any]) -> str | None:
  jinja_path = os.path.join(directory, "chat_template.jinja")  # transformers >= 4.50 saves it here
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read()
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    by_name = {t["name"]: t["template"] for t in template}
    template = by_name.get("default", next(iter(by_name.values()), None))
  return template


def load(path: str) -> Tokenizer:
  """Loads a tokenizer from a local HF directory or a tokenizer.json file."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such directory or tokenizer.json file")
  if os.path.isdir(path) and not os.listdir(path):
    raise FileNotFoundError(f"{path}: directory is empty (no tokenizer.json)")
  if os.path.isdir(path):
    directory, json_path = path, os.path.join(path, "tokenizer.json")
  else:
    directory, json_path = os.path.dirname(path), path
  if not os.path.exists(json_path):
    raise FileNotFoundError(f"no tokenizer.json at {json_path}")
  try:
    hf = tokenizers.Tokenizer.from_file(json_path)
  except Exception as e:  # tokenizers raises a bare Exception on malformed files.
    raise ValueError(f"cannot parse tokenizer {json_path}: {e}") from e
  config_path = os.path.join(directory, "tokenizer_config.json")
  config = _read_json(config_path) if os.path.exists(config_path) else {}
  special = {k: _token_content(config.get(k)) for k in _SPECIAL_KEYS}
  gen_path = os.path.join(directory, "generation_config.json")
  stop_ids: list[int] = []
  if os.path.exists(gen_path):
    eos = _read_json(gen_path).get("eos_token_id")
    stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
  if special["eos_token"] is None:
    if not stop_ids:
      raise ValueError(f"no eos_token in {config_path} and no eos_token_id in {gen_path}")
    special["eos_token"] = hf.id_to_token(stop_ids[0])
  return Tokenizer(hf, **special, chat_template=_chat_template(directory, config), extra_stop_ids=stop_ids)
