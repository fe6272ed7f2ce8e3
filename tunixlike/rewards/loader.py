"""User code named in a config: a registered name, `package.module:name`, or `path/to/file.py:name`.

    load("exact_match", key="rewards[0].fn", registry=registry.registered())   # a registered reward
    load("my_pkg.rewards:score", key="rewards[0].fn")                           # an import path
    load("/abs/dir/my_rewards.py:score", key="rewards[0].fn")                   # a file

A config file's `./x.py:fn` is made absolute beside the config by `config.load`. Every error
names the config key and says what went wrong in one line (`LoadError`, a ValueError).

`batch_reward(fn, ...)` adapts a user's reward function to the batch interface the reward stage
calls, `fn(prompts, completions, **columns)`: the function receives only the arguments it names
(or everything with `**kwargs`), may be `async def`, and is checked against the available columns
before the run starts.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Iterable, Mapping

ROLLOUT_FIELDS = ("prompts", "completions", "completion_lengths", "finish_reasons", "prompt_ids")
# A prompt record's fields that are no reward columns: the request carries them itself (`rl.prompts`).
NOT_COLUMNS = ("prompt_token_ids", "prompt_text", "id", "prompt")


class LoadError(ValueError):
  """User code named in a config that cannot be loaded or called as asked."""


def is_import_path(spec: str) -> bool:
  return isinstance(spec, str) and ":" in spec


def load(spec: Any, *, key: str, registry: Mapping[str, Any] | None = None) -> Any:
  """The object `spec` names (a non-string `spec` is returned as it is: Python callers pass objects)."""
  if not isinstance(spec, str):
    return spec
  if registry is not None and spec in registry:
    return registry[spec]
  if not is_import_path(spec):
    known = f"a registered name ({', '.join(sorted(registry))}), " if registry is not None else ""
    raise LoadError(f"{key}={spec!r}: not {known}an import path 'package.module:name' or a file 'file.py:name'")
  where, _, attr = spec.rpartition(":")
  module = _import_file(where, spec, key) if where.endswith(".py") else _import_module(where, spec, key)
  try:
    return getattr(module, attr)
  except AttributeError:
    raise LoadError(f"{key}={spec!r}: {where} has no {attr!r}") from None


def _import_module(name: str, spec: str, key: str):
  try:
    return importlib.import_module(name)
  except Exception as e:  # an ImportError, or the module's own error while it runs
    raise LoadError(f"{key}={spec!r}: importing {name} failed ({type(e).__name__}: {e})") from None


def _import_file(path: str, spec: str, key: str):
  if not os.path.isfile(path):
    raise LoadError(f"{key}={spec!r}: no such file {path}")
  path = os.path.abspath(path)
  # One module per file, whatever key names it: a file's functions are the same objects everywhere.
  name = f"tunixlike_user.{os.path.splitext(os.path.basename(path))[0]}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
  if name in sys.modules:
    return sys.modules[name]
  module_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:
    del sys.modules[name]
    raise LoadError(f"{key}={spec!r}: importing {path} failed ({type(e).__name__}: {e})") from None
  return module


def name_of(fn: Any, spec: Any) -> str:
  """The metric name of a reward: its registered name, else its function name."""
  if isinstance(spec, str) and not is_import_path(spec):
    return spec
  fn = fn.func if isinstance(fn, functools.partial) else fn
  return getattr(fn, "__name__", type(fn).__name__)


def batch_reward(fn: Callable, *, key: str, bound: Mapping[str, Any] = {},
                 columns: Iterable[str] | None = None) -> Callable[..., Any]:
  """`fn` as `call(prompts, completions, **columns)`, passing it only the arguments it names.

  `bound`: keyword arguments from the config (`kwargs`). `columns`: the dataset columns the batch
  will carry (None: unknown, not checked); a parameter without a default that is neither a column,
  a rollout field nor bound is refused here, naming `key`.
  """
  if not callable(fn):
    raise LoadError(f"{key}: {fn!r} is not callable")
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # a builtin without a signature: the plain batch interface
    params = None
  is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
  takes_all = params is None or any(p.kind is p.VAR_KEYWORD for p in params.values())
  named = {} if params is None else {n: p for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL,
                                                                                          p.VAR_KEYWORD)}
  positional_only = [n for n, p in named.items() if p.kind is p.POSITIONAL_ONLY]
  if positional_only:
    raise LoadError(f"{key}: {name_of(fn, None)} has positional-only parameters {positional_only}; "
                    "a reward function takes its arguments by name")
  unknown = [n for n in bound if n not in named and not takes_all]
  if unknown:
    raise LoadError(f"{key}: kwargs {unknown} are not parameters of {name_of(fn, None)}{inspect.signature(fn)}")
  if columns is not None:
    available = set(ROLLOUT_FIELDS) | set(columns) | set(bound)
    missing = [n for n, p in named.items() if p.default is p.empty and n not in available]
    if missing:
      raise LoadError(f"{key}: {name_of(fn, None)}{inspect.signature(fn)} needs {missing}, which the batch does "
                      f"not have: the dataset's columns are {sorted(columns)}, the rollout's fields "
                      f"{list(ROLLOUT_FIELDS)}")
  names = None if takes_all else list(named)

  def call(prompts, completions, **batch):
    batch = {"prompts": prompts, "completions": completions, **batch, **bound}
    if names is not None:
      batch = {n: batch[n] for n in names if n in batch}
    out = fn(**batch)
    return asyncio.run(_wait(out)) if is_async or inspect.isawaitable(out) else out

  return call


async def _wait(awaitable):
  return await awaitable  # the reward worker thread has no event loop of its own: asyncio.run makes one
