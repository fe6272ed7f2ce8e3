"""Random-access record sources over local files: JSONL, Parquet, Arrow, HF `datasets` on disk.

Every source is a sequence of dicts (`len`, `source[i]`), which is what `grain.MapDataset.source`
needs for index-based shuffling, sharding and exact resume. Parquet and Arrow stay in Arrow
memory (one row is turned into a dict only when read); JSONL is parsed up front so that a bad
line fails at start-up with its line number rather than hours into a run.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Sequence

import numpy as np


class RecordSource(Sequence[dict[str, Any]]):
  """Base class: a named, random-access sequence of records with known column names."""

  name: str
  columns: tuple[str, ...]

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.name!r}, n={len(self)})"

  def where(self, index: int) -> str:
    """Record `index` for an error message: its 0-based row (as pyarrow and datasets count them)."""
    return f"{self.name}: row {index} (counted from 0)"


class ListSource(RecordSource):
  """`lines`: the 1-based line of each record in its file, which error messages then name."""

  skipped: int = 0  # lines that were not records (read_jsonl with skip_bad_lines)

  def __init__(self, records: list[dict[str, Any]], name: str, lines: Sequence[int] | None = None):
    self.records, self.name, self.lines = records, name, lines
    self.columns = tuple(records[0]) if records else ()

  def where(self, index: int) -> str:
    return f"{self.name}:{self.lines[index]}" if self.lines is not None else super().where(index)

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index):
    return self.records[index]


class ArrowSource(RecordSource):
  """Rows of a pyarrow Table, converted to a dict one at a time."""

  def __init__(self, table, name: str):
    self.table, self.name = table, name
    self.columns = tuple(table.column_names)

  def __len__(self) -> int:
    return self.table.num_rows

  def __getitem__(self, index):
    if not -len(self) <= index < len(self):
      raise IndexError(f"{self.name}: row {index} out of range ({len(self)} rows)")
    return self.table.slice(index % len(self), 1).to_pylist()[0]


class HFDiskSource(RecordSource):
  """A Hugging Face `datasets.Dataset` saved with `save_to_disk`."""

  def __init__(self, dataset, name: str):
    self.dataset, self.name = dataset, name
    self.columns = tuple(dataset.column_names)

  def __len__(self) -> int:
    return len(self.dataset)

  def __getitem__(self, index):
    return dict(self.dataset[int(index)])


def read_jsonl(path: str, *, skip_bad_lines: bool) -> ListSource:
  """Reads a JSONL file of objects; errors name the file and the 1-based line. With `skip_bad_lines`
  a line that is not a JSON object is skipped and counted (`ListSource.skipped`) instead."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such data file: {path}")
  records, lines, skipped = [], [], 0
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      record, problem = None, None
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        problem = f"not valid UTF-8 ({e})"
      else:
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          problem = f"invalid JSON ({e})"
        else:
          if not isinstance(record, dict):
            problem = f"expected a JSON object, got {type(record).__name__}"
      if problem is not None:
        if skip_bad_lines:
          skipped += 1
          continue
        raise ValueError(f"{path}:{line_no}: {problem} (or set data.skip_bad_lines to skip such lines)")
      records.append(record)
      lines.append(line_no)  # blank lines are skipped: a record's index is not its line
  source = ListSource(records, path, lines)
  source.skipped = skipped
  return source


def read_parquet(path: str) -> ArrowSource:
  import pyarrow.parquet as pq
  if not os.path.exists(path):
    raise FileNotFoundError(f"no such data file: {path}")
  try:
    return ArrowSource(pq.read_table(path), path)
  except Exception as e:  # pyarrow raises ArrowInvalid and friends.
    raise ValueError(f"cannot read Parquet {path}: {e}") from e


def read_arrow(path: str) -> ArrowSource:
  """Reads an Arrow IPC file (random-access "file" format or the "stream" format HF datasets writes)."""
  import pyarrow as pa
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such data file: {path}")
  try:
    with pa.memory_map(path, "r") as source:
      try:
        table = pa.ipc.open_file(source).read_all()
      except pa.ArrowInvalid:
        source.seek(0)
        table = pa.ipc.open_stream(source).read_all()
  except Exception as e:
    raise ValueError(f"cannot read Arrow {path}: {e}") from e
  return ArrowSource(table, path)


def read_hf_disk(path: str) -> HFDiskSource:
  try:
    import datasets  # Optional dependency: only this source needs it.
  except ImportError as e:
    raise ImportError(f"reading {path} (saved with datasets.save_to_disk) needs `pip install datasets`") from e
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no such dataset directory: {path}")
  dataset = datasets.load_from_disk(path)
  if isinstance(dataset, datasets.DatasetDict):
    raise ValueError(f"{path} holds a DatasetDict with splits {list(dataset)}; pass {path}/<split>")
  return HFDiskSource(dataset, path)


_READERS = {"jsonl": read_jsonl, "parquet": read_parquet, "arrow": read_arrow, "hf_disk": read_hf_disk}
_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow",
               ".ipc": "arrow"}


class Subset(RecordSource):
  """The records of `parent` at `indices`; a record without an `id` gets its row in `parent`."""

  def __init__(self, parent: RecordSource, indices: np.ndarray):
    self.parent, self.indices = parent, np.asarray(indices)
    self.name, self.columns = parent.name, parent.columns
    self.skipped = getattr(parent, "skipped", 0)

  def __len__(self) -> int:
    return len(self.indices)

  def where(self, index: int) -> str:
    return self.parent.where(int(self.indices[index]))

  def __getitem__(self, index):
    i = int(self.indices[index])
    record = dict(self.parent[i])
    record.setdefault("id", f"{self.name}#{i}")  # Stable: the row index in the source.
    return record


class ConcatSource(RecordSource):
  """The records of several sources, one after the other (the files of a glob, in sorted order)."""

  def __init__(self, parts: Sequence[RecordSource], name: str):
    self.parts, self.name = list(parts), name
    self.columns = parts[0].columns
    self._starts = np.cumsum([0] + [len(p) for p in parts])
    self.skipped = sum(getattr(p, "skipped", 0) for p in parts)

  def __len__(self) -> int:
    return int(self._starts[-1])

  def _locate(self, index: int) -> tuple[RecordSource, int]:
    if not 0 <= index < len(self):
      raise IndexError(f"{self.name}: row {index} out of range ({len(self)} rows)")
    part = int(np.searchsorted(self._starts, index, side="right")) - 1
    return self.parts[part], index - int(self._starts[part])

  def where(self, index: int) -> str:
    part, i = self._locate(index)
    return part.where(i)

  def __getitem__(self, index):
    part, i = self._locate(int(index))
    return part[i]


def open_path(path: str, *, skip_bad_lines: bool) -> RecordSource:
  """A file, a Hugging Face save_to_disk directory, or a glob of files (their records in file order)."""
  if not glob.has_magic(path):
    return open_source(path, skip_bad_lines=skip_bad_lines)
  files = sorted(glob.glob(path))
  if not files:
    raise FileNotFoundError(f"no data file matches {path}")
  parts = [open_source(f, skip_bad_lines=skip_bad_lines) for f in files]
  return parts[0] if len(parts) == 1 else ConcatSource(parts, path)


def open_source(path: str, format: str | None = None, *, skip_bad_lines: bool) -> RecordSource:
  """Opens `path` as a record source; `format` is one of jsonl/parquet/arrow/hf_disk or inferred."""
  if format is None:
    if os.path.isdir(path):
      format = "hf_disk"
    else:
      format = _EXTENSIONS.get(os.path.splitext(path)[1].lower())
      if format is None:
        raise ValueError(f"cannot infer the format of {path}; pass format= one of {sorted(_READERS)}")
  if format not in _READERS:
    raise ValueError(f"format={format!r} for {path}; expected one of {sorted(_READERS)}")
  if format == "jsonl":
    return read_jsonl(path, skip_bad_lines=skip_bad_lines)
  return _READERS[format](path)
