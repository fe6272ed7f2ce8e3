"""Render Hugging Face chat templates (jinja2) the way transformers does.

Chat templates come from model repositories and are untrusted code, so they run in jinja's
immutable sandbox with the same environment transformers builds (`trim_blocks`, `lstrip_blocks`,
loop controls, a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`).
Rendering ourselves keeps the data layer free of a transformers import; tests check the output
matches `transformers` on the same template.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2  # Lazy: only needed for HF tokenizers that ship a chat template.
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(template)


def render(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
           **variables: Any) -> str:
  """Renders `messages` ([{"role", "content"}, ...]) with a jinja chat template.

  `variables` carries what transformers passes as well: the special tokens (`bos_token`,
  `eos_token`, ...) and template options such as `enable_thinking`.
  """
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or "role" not in message:
      raise ValueError(f"chat message {i} must be a dict with a 'role', got {message!r}")
  return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
