"""What the `python -m tunixlike.*` commands share: config flags parsed into one clear error line.

Bad input never shows a traceback: the command prints `<prog>: error: <what and where>` and exits
with status 2 (an unknown key names the flag, a config file that raised names its own line and error).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Mapping
from typing import Callable

import ml_collections
from absl import flags

from tunixlike import config as config_lib, shipped_configs

HELP_FLAGS = ("--help", "-h", "--helpshort", "-help")


def fail(prog: str, message: str, status: int = 2):
  """One line on stderr and exit: status 2 for bad input, 1 for a run that stopped itself."""
  print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(status)


def exit_now(prog: str, message: str, status: int, before_exit: Callable[[], None] | None = None):
  """One line on stderr, then an immediate exit (a second Ctrl-C). `sys.exit` would unwind through
  the run's cleanup (waits of up to minutes) and then finalize the interpreter while JAX's, orbax's
  and the sampler's native threads still run, which segfaulted (exit 139) in 1 of 3 tries. Nothing
  is lost: the logs are cut back to the last checkpoint on resume, and an unfinished checkpoint is
  a temporary directory that is never read. `before_exit()` runs after the line is out."""
  print(f"{prog}: error: {message}", file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  if before_exit is not None:
    before_exit()
  os._exit(status)


# What ml_collections says of an override it cannot apply: a close key, or a value that is not a section.
_CLOSE_KEY = re.compile(r'Did you mean "([^"]+)" instead of')
_UNDER_A_VALUE = re.compile(r"Attempting to lookup: (\S+)")


def _unknown_key(e: BaseException, argv: list[str]) -> str:
  """One line for a `--config.a.b=v` of a key the config lacks, naming the full key and the flag, e.g.
  `unknown config key 'rl.num_step' in --config.rl.num_step=3 (did you mean 'num_steps'?)`.
  ml_collections puts its suggestion after a newline inside the KeyError's text, nested in an AttributeError."""
  while e.args and isinstance(e.args[0], KeyError):
    e = e.args[0]
  text = str(e.args[0]) if e.args else "?"
  under = _UNDER_A_VALUE.search(text)
  if under:  # --config.rl.num_steps.x=3: a key below a value
    key = under.group(1)
    given = [a for a in argv if a.partition("=")[0] == f"--config.{key}"]
    return (f"unknown config key {key!r} in {' '.join(given) or 'the config file'} "
            f"({key.rpartition('.')[0]} is a value, not a section)")
  name = text.split("\n", 1)[0].strip("'\"")
  close = _CLOSE_KEY.search(text)
  hint = f" (did you mean {close.group(1)!r}?)" if close else ""
  given, key = [], name
  for arg in argv:
    parts = arg.partition("=")[0].removeprefix("--config.").split(".")
    if arg.startswith("--config.") and name in parts:
      given.append(arg)
      key = ".".join(parts[:len(parts) - parts[::-1].index(name)])  # up to the unknown part (its last mention)
  return f"unknown config key {key!r} in {' '.join(given) or 'the config file'}{hint}"


def config_error(e: BaseException, argv: list[str]) -> str:
  """One line for a config that failed to load: the offending key / file, not the loader's traceback."""
  if isinstance(e, (KeyError, AttributeError)):  # ml_collections: an override of a key the config lacks
    return _unknown_key(e, argv)
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  if any(l.startswith("Traceback") for l in lines):  # the config file itself raised
    head = lines[0].split("Error whilst parsing")[0].strip(" :")
    return f"{head}: {lines[-1]}" if head else lines[-1]
  if any("No such file" in l for l in lines):
    return next(l for l in lines if "No such file" in l).lstrip("[]Errno 2 ")
  return " ".join(lines)


def config_path(argv: list[str]) -> str | None:
  """The file of `--config FILE[:variant]` (or of a shipped config's NAME) given on the command line."""
  for i, arg in enumerate(argv):
    name, eq, value = arg.partition("=")
    if name in ("--config", "-config"):
      value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
      path = value.split(":", 1)[0]
      try:
        return shipped_configs.find(path) if path else None
      except FileNotFoundError:
        return path  # the flag's parser says so
  return None


NONE_WORDS = ("None", "none", "null", "")


def none_overrides(argv: list[str]) -> set[str]:
  """Optional keys the command line sets to None: `--config.data.task=None` (or none, null, ''), which
  ml_collections would read as the text 'None' for a key whose default is a string. The last
  `--config.k=v` of a key wins, as in ml_collections."""
  optional, last = config_lib.optional_keys(), {}
  for arg in argv:
    name, eq, value = arg.partition("=")
    if eq and name.startswith("--config.") and name[len("--config."):] in optional:
      last[name[len("--config."):]] = value
  return {k for k, v in last.items() if v in NONE_WORDS}


def _causes(e: BaseException | None) -> list[BaseException]:
  """`e` and what it was raised from, innermost last (ml_collections and absl re-raise a file's error)."""
  out: list[BaseException] = []
  while e is not None and e not in out:
    out.append(e)
    e = e.__cause__ or e.__context__
  return out


def config_file_error(e: BaseException, path: str | None) -> str | None:
  """One line for an error of the config file itself (syntax, a raising get_config, no get_config);
  None when the error is not the file's."""
  if path is None:
    return None
  here = os.path.realpath(path)
  for cause in reversed(_causes(e)):
    if isinstance(cause, SyntaxError) and cause.filename and os.path.realpath(cause.filename) == here:
      return f"{path}:{cause.lineno}: {type(cause).__name__}: {cause.msg}"
    frames = [f for f in traceback.extract_tb(cause.__traceback__) if os.path.realpath(f.filename) == here]
    if frames:
      what = "get_config raised" if frames[0].name == "get_config" else "loading it raised"
      message = str(cause).removeprefix(f"{path}: ")  # configs often name themselves already
      return f"{path}:{frames[-1].lineno}: {what} {type(cause).__name__}: {message}"
  if isinstance(e, AttributeError) and e.name == "get_config":
    return f"{path}: has no get_config function"
  return None


class NoConfigError(Exception):
  """No config: an unknown shipped name, or a get_config that returned None. Not a ValueError: absl would
  fold it into an opaque flag value error."""


@contextlib.contextmanager
def _quiet_absl():
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def refuse_none(holder: flags.FlagHolder) -> flags.FlagHolder:
  """Makes a `config_flags.DEFINE_config_file` flag take a shipped config's name as well as a file, and
  refuse a get_config that returns None or anything but a ConfigDict (a plain dict), before any override
  is applied to it (ml_collections only logs a warning, then fails on the first override as if the key
  were unknown)."""
  parser = flags.FLAGS[holder.name].parser
  load = parser.parse

  def parse(argument):
    path, colon, variant = argument.partition(":")
    try:
      path = shipped_configs.find(path)  # a shipped config's name: its file
    except FileNotFoundError as e:
      raise NoConfigError(str(e)) from None
    with _quiet_absl():  # the warning would be a second line next to the error
      config = load(path + colon + variant)
    if config is None or not isinstance(config, ml_collections.ConfigDict):
      got = "None" if config is None else f"a {type(config).__name__}"
      raise NoConfigError(f"get_config of {path} returned {got} instead of a ConfigDict (start from "
                          "tunixlike.config.default_config_dict(): every key with its default, and overrides work)")
    return config_lib.resolve_beside(config, os.path.dirname(os.path.abspath(path)))

  parser.parse = parse
  return holder


def parse_config(prog: str, argv: list[str], config_flag,
                 first_check: Callable[[Mapping], str | None] | None = None) -> config_lib.Config | None:
  """Parses every flag and validates the config (None when --config was not given).

  `first_check(raw)` runs when the config is invalid; a message it returns is reported instead of
  the validation error (a run-time fact, such as the device count, that the config cannot know).
  """
  path = config_path(argv)
  try:
    flags.FLAGS(argv)
    raw = config_flag.value
  except NoConfigError as e:
    fail(prog, str(e))
  except Exception as e:  # the config file runs here: any error it raises is reported as its own
    message = config_file_error(e, path)
    if message is None and not isinstance(e, (KeyError, AttributeError, flags.Error, ValueError, TypeError,
                                               OSError)):
      raise
    fail(prog, message or config_error(e, argv))
  if raw is None:
    return None
  try:
    if not isinstance(raw, Mapping) and not hasattr(raw, "to_dict"):
      fail(prog, f"get_config of {path} returned {raw!r} instead of a ConfigDict")
    values = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
    for key in none_overrides(argv):
      section, _, name = key.rpartition(".")
      (values[section] if section else values)[name] = None
    cfg = config_lib.from_config_dict(values)
    config_lib.check_paths(cfg)
  except config_lib.ConfigError as e:
    fail(prog, (first_check and first_check(raw)) or str(e))
  except (ValueError, TypeError, OSError) as e:  # a config file that failed to load surfaces on first access
    fail(prog, config_file_error(e, path) or config_error(e, argv))
  return cfg


def wants_help(argv: list[str]) -> bool:
  return any(a in HELP_FLAGS for a in argv[1:])


def usage(module) -> str:
  """The module's docstring followed by its flags."""
  flag_help = flags.FLAGS.module_help(module) or flags.FLAGS.main_module_help()
  return f"{module.__doc__}\nflags:\n{flag_help}\n"
