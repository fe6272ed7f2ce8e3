"""Prints the config reference (every key of configs/base.py, its default and its comment) as Markdown.

  python scripts/config_reference.py            # print the table
  python scripts/config_reference.py --check docs/config.md   # exit 1 if the docs' copy is stale

docs/config.md holds the output between `<!-- config-reference -->` markers; a test keeps it current.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BEGIN, END = "<!-- config-reference -->", "<!-- /config-reference -->"


def _comments(source: str) -> dict[str, str]:
  """'section.key' -> the comment on its line (sections are bound to short aliases in base.py)."""
  aliases = {"c": ""}
  out = {}
  for line in source.splitlines():
    m = re.match(r"\s*c\.(\w+) = (\w+) = ml_collections\.ConfigDict\(\)", line)
    if m:
      aliases[m.group(2)] = m.group(1) + "."
      continue
    m = re.match(r"\s*c\.(\w+) = ml_collections\.ConfigDict\(\)", line)
    if m:
      aliases[f"c.{m.group(1)}"] = m.group(1) + "."
      continue
    m = re.match(r"\s*((?:c\.\w+)|\w+)\.(\w+) = [^#]*?(?:#\s*(.*))?$", line)
    if m and m.group(1) in aliases:
      out[aliases[m.group(1)] + m.group(2)] = (m.group(3) or "").strip()
    elif m and m.group(1) == "c":
      out[m.group(2)] = (m.group(3) or "").strip()
  return out


def table() -> str:
  from configs import base
  source = open(os.path.join(ROOT, "configs", "base.py"), encoding="utf-8").read()
  notes = _comments(source)

  def flat(d, prefix=""):
    for k, v in d.items():
      if isinstance(v, dict):
        yield from flat(v, f"{prefix}{k}.")
      else:
        yield f"{prefix}{k}", v

  rows = ["| key | default | why / what |", "|---|---|---|"]
  for key, value in flat(base.get_config().to_dict()):
    shown = "None" if value is None else repr(tuple(value) if isinstance(value, list) else value)
    rows.append(f"| `{key}` | `{shown}` | {notes.get(key, '').replace('|', '/')} |")
  return "\n".join(rows)


def main(argv: list[str]) -> int:
  text = table()
  if len(argv) == 3 and argv[1] == "--check":
    readme = open(argv[2], encoding="utf-8").read()
    current = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip() if BEGIN in readme else None
    if current != text:
      print(f"{argv[2]}: the config reference is stale; regenerate it with python scripts/config_reference.py")
      return 1
    return 0
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
