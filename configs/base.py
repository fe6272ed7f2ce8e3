"""Every key of tunixlike at its default, generated from the dataclass tree in tunixlike/config.py
(a default, its one-line why and its check live on the field: see docs/config.md).

Other configs start from `config.default_config_dict()` and change keys.
Run: python -m tunixlike.train --config configs/addition_grpo.py --workdir runs/addition
Override any key: --config.rl.max_staleness=2 ; variants: --config configs/x.py:size=tiny
"""

from tunixlike import config


def get_config(arg: str | None = None):
  config.parse_arg(arg)  # no variants
  return config.default_config_dict()
