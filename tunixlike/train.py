"""Train with async RL.

  python -m tunixlike.train --config configs/addition_grpo.py --workdir runs/addition
  python -m tunixlike.train --config configs/gsm8k_grpo.py:size=tiny --config.rl.max_staleness=2 --workdir DIR

`--config` is a Python file with `get_config(arg)` (`file.py:arg` selects a variant); any key can be
overridden with `--config.section.key=value`. Running again with the same --workdir resumes.
A bad flag, unknown key, wrong type or invalid value prints one line naming it and exits with status 2.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from tunixlike import cli, config as config_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl, TensorBoard "
                               "events and plots. Reusing it resumes the run.")
_CHECK_ONLY = flags.DEFINE_bool("check_only", False, "Parse and validate the config, then exit.")


PROG = "tunixlike.train"


def parse(argv: list[str]) -> tuple[config_lib.Config, str | None]:
  """Parses flags into a validated Config; exits with status 2 and one clear line on bad input."""
  cfg = cli.parse_config(PROG, argv, _CONFIG)
  if cfg is None:
    cli.fail(PROG, "--config is required (e.g. --config configs/addition_grpo.py)")
  return cfg, _WORKDIR.value


def main(argv: list[str] | None = None):
  argv = list(sys.argv if argv is None else argv)
  if cli.wants_help(argv):
    print(cli.usage(sys.modules[__name__]))
    return
  cfg, workdir = parse(argv)
  if _CHECK_ONLY.value:
    print("config OK")
    return
  if workdir is None:
    cli.fail(PROG, "--workdir is required")
  from tunixlike import checkpoint, mesh
  from tunixlike.rl import trainer  # heavy imports only once the config is known to be good
  try:
    trainer.run(cfg, workdir)
  except (mesh.MeshError, checkpoint.CheckpointError, config_lib.ConfigError, trainer.SetupError) as e:
    cli.fail(PROG, str(e))


if __name__ == "__main__":
  main()
