"""The configs that ship with tunixlike, by name: `--config addition_grpo:size=tiny` from any directory.

A checkout keeps them where a reader finds them: `configs/*.py` and `examples/<name>/config.py` (with the
example's data, rewards and agent beside it). setup.py maps those two folders into the package, so an
installed tunixlike has them as `tunixlike/configs/` and `tunixlike/examples/`. A config's name is its
file's stem (`configs/addition_grpo.py`: addition_grpo) or its example's folder (`examples/countdown/`:
countdown). A file path names a config as before; a name is looked up here only when no such file exists.
"""

from __future__ import annotations

import ast
import os
import re

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def folders() -> tuple[str, str] | None:
  """(configs, examples): the installed package's, else those of the checkout this package sits in
  (on PYTHONPATH, or installed editable); None when neither exists."""
  checkout = os.path.dirname(_PACKAGE)
  for root, found in ((_PACKAGE, True), (checkout, os.path.isfile(os.path.join(checkout, "setup.py")))):
    if found and os.path.isdir(os.path.join(root, "configs")):
      return os.path.join(root, "configs"), os.path.join(root, "examples")
  return None


def paths() -> dict[str, str]:
  """{name: config file} of every shipped config, by name."""
  where = folders()
  if where is None:
    return {}
  configs, examples = where
  found = {f[:-3]: os.path.join(configs, f) for f in os.listdir(configs) if f.endswith(".py") and not f.startswith("_")}
  if os.path.isdir(examples):
    for name in os.listdir(examples):
      if os.path.isfile(os.path.join(examples, name, "config.py")):
        assert name not in found, f"examples/{name} and configs/{name}.py would share the name {name!r}"
        found[name] = os.path.join(examples, name, "config.py")
  return dict(sorted(found.items()))


def find(path: str) -> str:
  """The file of a config given by file or by shipped name (without its `:variant`): `path` itself when
  it is a file or not a bare name (`configs/x.py`, `x.py`), else the shipped config of that name."""
  if os.path.isfile(path) or not _NAME.fullmatch(path):
    return path
  shipped = paths()
  if path not in shipped:
    raise FileNotFoundError(f"--config {path}: no such file, and no config of that name ships with tunixlike "
                            f"(shipped: {', '.join(shipped) or 'none'}; python -m tunixlike.train --list_configs)")
  return shipped[path]


def summary(path: str) -> str:
  """The first paragraph of a config file's docstring, on one line (the file is read, not run)."""
  with open(path, encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  return " ".join(doc.strip().split("\n\n", 1)[0].split())


def table() -> str:
  """What `--list_configs` prints: every shipped name with its summary, and where the files are."""
  shipped = paths()
  if not shipped:
    return "no configs ship with this tunixlike (neither tunixlike/configs/ nor a checkout's configs/ was found)"
  width = max(map(len, shipped))
  lines = [f"  {name:<{width}}  {summary(path)}" for name, path in shipped.items()]
  configs, examples = folders()
  return "\n".join([f"Configs that ship with tunixlike: --config NAME[:variant] from any directory "
                    f"(files in {configs} and {examples}/NAME/config.py)", *lines])
