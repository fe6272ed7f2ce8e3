"""Supervised fine-tuning alone: the run's supervised stage, with no RL after it.

  python -m tunixlike.sft --config examples/countdown/config.py --workdir runs/countdown_sft
  python -m tunixlike.sft --config my_config.py --config.data.answer_field=solution \
      --config.warm_start.max_steps=500 --config.warm_start.target_accuracy=1.0 --workdir runs/sft

This is `python -m tunixlike.train` with `--config.rl.num_steps=0` (also how a config file or
`tunixlike.train` asks for it): the supervised stage (warm_start.*: from data.answer_field or the
assistant turns of data.messages_field, docs/own_data.md#supervised-fine-tuning) trains the model,
then held-out accuracy is measured and the result is saved as the checkpoint at step 0, which
`tunixlike.eval` and `tunixlike.export` read. Running `python -m tunixlike.train` later with the same
config and --workdir continues with RL from these weights. warm_start.target_accuracy (default 0.2)
still stops the stage early: set it to 1.0 to train all of warm_start.max_steps.
"""

from __future__ import annotations

import sys

from tunixlike import cli
from tunixlike.rl import starting_point
from tunixlike.train import main as train_main  # the module (tunixlike.train is also the function)

PROG = "tunixlike.sft"


def _check(cfg) -> str | None:
  steps, why = ((cfg.warm_start.max_steps, "") if cfg.warm_start.max_steps is not None
                else starting_point.supervised_steps(cfg))
  if not steps:
    return (f"warm_start.max_steps=0{f' ({why})' if why else ''}: nothing to train; set "
            "--config.warm_start.max_steps to the supervised steps")
  return None


def main(argv: list[str] | None = None):
  # Last, so it wins over the config file and any flag before it. ml_collections finds `--config.*`
  # overrides in sys.argv itself, so the flag goes there; with no --config (--list_configs, or the
  # missing flag's error) there is nothing to override.
  sys.argv = list(sys.argv if argv is None else argv)
  if cli.config_path(sys.argv) is not None:
    sys.argv.append("--config.rl.num_steps=0")
  train_main(sys.argv, prog=PROG, module=sys.modules[__name__], check=_check)


if __name__ == "__main__":
  main()
