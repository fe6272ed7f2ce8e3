"""Prints the config reference (every key of tunixlike's config tree, its default and its why) as Markdown.

  python scripts/config_reference.py                      # print the table
  python scripts/config_reference.py --check docs/config.md  # exit 1 if the file's copy is stale
  python scripts/config_reference.py --write docs/config.md  # replace the file's copy

The target file holds the table between `<!-- config-reference -->` markers; a test keeps it current.
The rows come from the dataclass fields of `tunixlike.config.Config` (`settings.setting(default, why)`).
"""

from __future__ import annotations

import sys

from tunixlike import config, settings

BEGIN, END = "<!-- config-reference -->", "<!-- /config-reference -->"


def table() -> str:
  rows = ["| key | default | why / what |", "|---|---|---|"]
  for key, field in settings.keys(config.Config):
    rows.append(f"| `{key}` | `{field.default!r}` | {field.metadata['help'].replace('|', '/')} |")
  return "\n".join(rows)


def _split(path: str) -> tuple[str, str | None, str]:
  text = open(path, encoding="utf-8").read()
  if BEGIN not in text or END not in text:
    return text, None, ""
  head, rest = text.split(BEGIN, 1)
  current, tail = rest.split(END, 1)
  return head, current.strip(), tail


def main(argv: list[str]) -> int:
  text = table()
  if len(argv) == 3 and argv[1] in ("--check", "--write"):
    head, current, tail = _split(argv[2])
    if current is None:
      print(f"{argv[2]}: has no {BEGIN} ... {END} markers")
      return 1
    if argv[1] == "--write":
      with open(argv[2], "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
      return 0
    if current != text:
      print(f"{argv[2]}: the config reference is stale; regenerate it with "
            f"python scripts/config_reference.py --write {argv[2]}")
      return 1
    return 0
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
