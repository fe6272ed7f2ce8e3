"""What a data source holds, in a few numbers, so a resumed run can tell it is reading the same data.

    {"files": {path: {"bytes": N, "sha256": hex}}}         files (JSONL, Parquet, Arrow, a glob of them)
    {"rows": N, "sha256": hex}                              rows given in memory (a list, a MapDataset)

A file is hashed whole up to `WHOLE_FILE_BYTES`; a larger one by its size and `SAMPLES` evenly
spaced chunks (a change that keeps the size and misses every chunk goes unseen: the price of not
reading terabytes at every start). Rows in memory are hashed as canonical JSON, all of them up to
`WHOLE_ROWS`, else `SAMPLES` evenly spaced ones and the count.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from tunixlike.data import sources

WHOLE_FILE_BYTES = 1 << 30
WHOLE_ROWS = 100_000
SAMPLES = 1024
_CHUNK = 1 << 16


def _files(source: sources.RecordSource) -> list[str] | None:
  """The files a source reads, or None for rows given in memory."""
  if isinstance(source, sources.Subset):
    return _files(source.parent)
  if isinstance(source, sources.ConcatSource):
    parts = [_files(p) for p in source.parts]
    return None if any(p is None for p in parts) else [f for p in parts for f in p]
  if isinstance(source, sources.HFDiskSource):
    return sorted(os.path.join(root, f) for root, _, files in os.walk(source.name) for f in files)
  if isinstance(source, sources.ListSource) and source.lines is None:  # rows given in memory, named by their key
    return None
  return [source.name] if os.path.isfile(source.name) else None


def file_digest(path: str) -> dict[str, Any]:
  size = os.path.getsize(path)
  h = hashlib.sha256()
  with open(path, "rb") as f:
    if size <= WHOLE_FILE_BYTES:
      for chunk in iter(lambda: f.read(8 << 20), b""):
        h.update(chunk)
    else:
      for offset in np.linspace(0, size - _CHUNK, SAMPLES, dtype=np.int64):
        f.seek(int(offset))
        h.update(f.read(_CHUNK))
  return {"bytes": size, "sha256": h.hexdigest(), **({"sampled": True} if size > WHOLE_FILE_BYTES else {})}


def rows_digest(source) -> dict[str, Any]:
  n = len(source)
  indices = range(n) if n <= WHOLE_ROWS else np.linspace(0, n - 1, SAMPLES, dtype=np.int64)
  h = hashlib.sha256()
  for i in indices:
    h.update(json.dumps(source[int(i)], sort_keys=True, default=repr).encode())
    h.update(b"\n")
  return {"rows": n, "sha256": h.hexdigest(), **({"sampled": True} if n > WHOLE_ROWS else {})}


def fingerprint(source: sources.RecordSource) -> dict[str, Any]:
  files = _files(source)
  if files is None:
    return rows_digest(source)
  return {"files": {path: file_digest(path) for path in files}}


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
  """What differs between two fingerprints of one source, in words ([] when nothing does)."""
  if "files" in saved and "files" in now:
    out = [f"{p} is gone" for p in saved["files"] if p not in now["files"]]
    out += [f"{p} is new" for p in now["files"] if p not in saved["files"]]
    for p in saved["files"].keys() & now["files"].keys():
      a, b = saved["files"][p], now["files"][p]
      if a["bytes"] != b["bytes"]:
        out.append(f"{p} changed ({a['bytes']:,} -> {b['bytes']:,} bytes)")
      elif a["sha256"] != b["sha256"]:
        out.append(f"{p} changed (the same size, other content)")
    return sorted(out)
  if "rows" in saved and "rows" in now:
    if saved["rows"] != now["rows"]:
      return [f"the rows changed ({saved['rows']:,} -> {now['rows']:,} rows)"]
    return [] if saved["sha256"] == now["sha256"] else ["the rows changed (as many rows, other content)"]
  return ["it was " + ("files" if "files" in saved else "rows in memory") + " and is now "
          + ("files" if "files" in now else "rows in memory")]
