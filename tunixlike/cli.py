"""What the `python -m tunixlike.*` commands share: config flags parsed into one clear error line.

Bad input never shows a traceback: the command prints `<prog>: error: <what and where>` and exits
with status 2 (an unknown key names the flag, a config file that raised names its own error).
"""

from __future__ import annotations

import os
import sys

from absl import flags

from tunixlike import config as config_lib

HELP_FLAGS = ("--help", "-h", "--helpshort", "-help")


def fail(prog: str, message: str):
  print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(2)


def config_error(e: BaseException, argv: list[str]) -> str:
  """One line for a config that failed to load: the offending key / file, not the loader's traceback."""
  if isinstance(e, (KeyError, AttributeError)):  # ml_collections: an override of a key the config lacks
    while e.args and isinstance(e.args[0], KeyError):
      e = e.args[0]
    key = str(e.args[0]).strip("'\"") if e.args else "?"
    bad = [a for a in argv if a.startswith("--config.") and key in a.split("=")[0].split(".")]
    return f"unknown config key {key!r} in {' '.join(bad) or 'the config file'}"
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  if any(l.startswith("Traceback") for l in lines):  # the config file itself raised
    head = lines[0].split("Error whilst parsing")[0].strip(" :")
    return f"{head}: {lines[-1]}" if head else lines[-1]
  if any("No such file" in l for l in lines):
    return next(l for l in lines if "No such file" in l).lstrip("[]Errno 2 ")
  return " ".join(lines)


def parse_config(prog: str, argv: list[str], config_flag) -> config_lib.Config | None:
  """Parses every flag and validates the config (None when --config was not given)."""
  sys.path.insert(0, os.getcwd())  # config files import `configs.base` from the project root
  try:
    flags.FLAGS(argv)
    raw = config_flag.value
    return None if raw is None else config_lib.from_config_dict(raw)
  except (KeyError, AttributeError, flags.Error, ValueError, TypeError, OSError) as e:
    fail(prog, config_error(e, argv))


def wants_help(argv: list[str]) -> bool:
  return any(a in HELP_FLAGS for a in argv[1:])


def usage(module) -> str:
  """The module's docstring followed by its flags."""
  flag_help = flags.FLAGS.module_help(module) or flags.FLAGS.main_module_help()
  return f"{module.__doc__}\nflags:\n{flag_help}\n"
