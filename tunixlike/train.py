"""Train with async RL.

  python -m tunixlike.train --config configs/addition_grpo.py --workdir runs/addition
  python -m tunixlike.train --config configs/gsm8k_grpo.py:size=tiny --config.rl.max_staleness=2 --workdir DIR

`--config` is a Python file with `get_config(arg)` (`file.py:arg` selects a variant); any key can be
overridden with `--config.section.key=value`. Running again with the same --workdir resumes.
A bad flag, unknown key, wrong type or invalid value prints one line naming it and exits with status 2.
"""

from __future__ import annotations

import os
import sys

from absl import flags
from ml_collections import config_flags

from tunixlike import config as config_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl, TensorBoard "
                               "events and plots. Reusing it resumes the run.")
_CHECK_ONLY = flags.DEFINE_bool("check_only", False, "Parse and validate the config, then exit.")


def _fail(message: str):
  print(f"tunixlike.train: error: {message}", file=sys.stderr)
  sys.exit(2)


def parse(argv: list[str]) -> tuple[config_lib.Config, str | None]:
  """Parses flags into a validated Config; exits with status 2 and one clear line on bad input."""
  sys.path.insert(0, os.getcwd())  # config files import `configs.base` from the project root
  try:
    flags.FLAGS(argv)
    raw = _CONFIG.value
    if raw is None:
      _fail("--config is required (e.g. --config configs/addition_grpo.py)")
    return config_lib.from_config_dict(raw), _WORKDIR.value
  except (KeyError, AttributeError) as e:  # ml_collections: an override of a key the config lacks
    while e.args and isinstance(e.args[0], KeyError):
      e = e.args[0]
    key = str(e.args[0]).strip("'\"") if e.args else "?"
    bad = [a for a in argv if a.startswith("--config.") and key in a.split("=")[0].split(".")]
    _fail(f"unknown config key {key!r} in {' '.join(bad) or 'the config file'}")
  except (flags.Error, ValueError, TypeError, OSError) as e:
    _fail(_last_line(str(e)))


def _last_line(message: str) -> str:
  """A config file that raised: keep the file's own error, not the loader's traceback."""
  lines = [l.strip() for l in message.strip().splitlines() if l.strip()]
  if any(l.startswith("Traceback") for l in lines):
    head = lines[0].split("Error whilst parsing")[0].strip(" :")
    return f"{head}: {lines[-1]}" if head else lines[-1]
  if any("No such file" in l for l in lines):
    return next(l for l in lines if "No such file" in l).lstrip("[]Errno 2 ")
  return " ".join(lines)


def main(argv: list[str] | None = None):
  cfg, workdir = parse(list(sys.argv if argv is None else argv))
  if _CHECK_ONLY.value:
    print("config OK")
    return
  if workdir is None:
    _fail("--workdir is required")
  from tunixlike import checkpoint, mesh
  from tunixlike.rl import trainer  # heavy imports only once the config is known to be good
  try:
    trainer.run(cfg, workdir)
  except (mesh.MeshError, checkpoint.CheckpointError, config_lib.ConfigError, trainer.SetupError) as e:
    _fail(str(e))


if __name__ == "__main__":
  main()
