"""A config key is one dataclass field: its default, its one-line why and its check are written there.

    max_new_tokens: int = setting(8, "completion length limit (finish_reason 'length')", check=positive)

Sections are frozen dataclasses with a `SECTION` name and `__post_init__ = check_fields` (plus
their own checks across fields). `run_value` marks a field the run fills in from elsewhere (the
tokenizer, another section): it is not a config key. Errors name the key and the value,
e.g. `rl.max_staleness=-1: must be >= 0`. A leaf module: no tunixlike or JAX imports.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

Check = Callable[[Any], "str | None"]  # a complaint about the value, or None when it is fine


class ConfigError(ValueError):
  """A config key that is unknown, of the wrong type or has an invalid value."""


def setting(default: Any, why: str, *, check: Check | None = None, resumable: bool = False) -> Any:
  """A config key: `--config.<section>.<name>=...` sets it; `why` is its line in the reference.

  `resumable`: a resumed run may change it (it decides how long, how fast or how visibly the run
  goes on, not what it trains). A section whose every key is so sets `RESUMABLE = True` instead.
  """
  return dataclasses.field(default=default, metadata={"help": why, "check": check, "resumable": resumable})


def library_setting(cls, name: str, why: str, *, check: Check | None = None) -> Any:
  """A config key whose default is the field `name` of the library class `cls`, written there once:
  for a class that describes more than a run's keys (`ModelConfig`: every model, from a Hugging Face
  config.json too) and that a config section can import without loading the engine."""
  default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
  return dataclasses.field(default=default, metadata={"help": why, "check": check, "resumable": False,
                                                      "default_of": (cls, name)})


def run_value(default: Any, why: str, *, check: Check | None = None) -> Any:
  """Filled in by the run (`dataclasses.replace`) from the tokenizer or another key; not a config key."""
  return dataclasses.field(default=default, metadata={"help": why, "check": check, "run_value": True})


def tree_key(key: str) -> Any:
  """A library config's field that is the config key `key` (e.g. 'rl.collapse_spike_factor'): it has no
  default of its own; `from_config(cfg)` reads it from the run's config, so a library user gets the
  default and the check a CLI user gets."""
  return dataclasses.field(metadata={"tree_key": key})


class FromConfig:
  """A library config (frozen dataclass) whose `tree_key` fields are keys of the run's config tree."""

  @classmethod
  def from_config(cls, cfg, **values):
    """`cls` with each `tree_key` field read from `cfg` (the run's `Config`, or the section holding the
    keys, e.g. `cfg.rl`) and the other fields from `values` (or their own defaults). A key in `values`
    replaces the config's value (a test's or a benchmark's own setting)."""
    for f in dataclasses.fields(cls):
      key = f.metadata.get("tree_key")
      if key is None or f.name in values:
        continue
      *path, name = key.split(".")
      holder = cfg
      if path and getattr(cfg, "SECTION", None) != path[0]:
        holder = getattr(cfg, path[0])
      values[f.name] = getattr(holder, name)
    return cls(**values)


def require(ok: bool, key: str, value: Any, why: str):
  if not ok:
    raise ConfigError(f"{key}={value!r}: {why}")


def check_fields(section):
  """Runs every field's check; the error names `SECTION.field` and the value (a run value, which is
  no config key, by its class: `AlgoConfig.sampling_temperature`)."""
  prefix = f"{section.SECTION}." if section.SECTION else ""
  for f in dataclasses.fields(section):
    check = f.metadata.get("check")
    value = getattr(section, f.name)
    complaint = check(value) if check is not None else None
    if complaint:
      name = f"{prefix}{f.name}" if is_key(f) else f"{type(section).__name__}.{f.name}"
      raise ConfigError(f"{name}={value!r}: {complaint}")


def is_key(f: dataclasses.Field) -> bool:
  return not f.metadata.get("run_value", False)


def resumable_keys(cls, prefix: str = "", section_resumable: bool = False) -> Iterator[str]:
  """The keys of the dataclass tree `cls` that a resumed run may change."""
  for f in dataclasses.fields(cls):
    if is_key(f) and dataclasses.is_dataclass(f.default):
      sub = type(f.default)
      yield from resumable_keys(sub, f"{prefix}{f.name}.", getattr(sub, "RESUMABLE", False))
    elif is_key(f) and (section_resumable or f.metadata.get("resumable", False)):
      yield f"{prefix}{f.name}"


def keys(cls, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
  """('section.name', field) for every config key of the dataclass tree `cls`, in declaration order."""
  for f in dataclasses.fields(cls):
    if not is_key(f):
      continue
    if dataclasses.is_dataclass(f.default):
      yield from keys(type(f.default), f"{prefix}{f.name}.")
    else:
      yield f"{prefix}{f.name}", f


# ---- checks ---------------------------------------------------------------------------------------
def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def positive(v) -> str | None:
  return None if _number(v) and v > 0 else "must be > 0"


def non_negative(v) -> str | None:
  return None if _number(v) and v >= 0 else "must be >= 0"


def positive_int(v) -> str | None:
  return None if _is_int(v) and v >= 1 else "must be an int >= 1"


def an_int(v) -> str | None:
  return None if _is_int(v) else "must be an int"


def one_of(*choices) -> Check:
  return lambda v: None if v in choices else f"must be one of {list(choices)}"


def optional(check: Check) -> Check:
  """None is allowed (the key is unset); any other value must pass `check`."""
  return lambda v: None if v is None else check(v)


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Check:
  """`in_range(0, 1, low_open=True)` accepts (0, 1]."""
  def check(v):
    ok = _number(v) and (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
    return None if ok else f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
  return check


def ints_at_least(low: int) -> Check:
  return lambda v: None if _is_int(v) and v >= low else f"must be an int >= {low}"


DTYPES = ("float32", "bfloat16", "float16")
