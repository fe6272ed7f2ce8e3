"""A package's public names imported on first use (PEP 562 module `__getattr__`).

Importing the config imports a few leaf modules of `tunixlike.learner` and `tunixlike.sampler`
(their config sections); with eager `__init__`s that would import the train step, the engine,
flax and optax too. `from tunixlike.learner import Learner` still works: the name is looked up,
and its module imported, at that moment.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> tuple[Callable, Callable, list[str]]:
  """`(__getattr__, __dir__, __all__)` for the `__init__` of `package`; `exports` maps each module
  (relative to the package) to the public names it defines."""
  where = {name: f"{package}.{module}" for module, names in exports.items() for name in names}

  def __getattr__(name: str):
    if name not in where:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where[name]), name)
    setattr(sys.modules[package], name, value)  # later lookups skip this function
    return value

  def __dir__() -> list[str]:
    return sorted(set(vars(sys.modules[package])) | set(where))

  return __getattr__, __dir__, sorted(where)
