import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tunixlike.data import sources

ROWS = [{"id": f"r{i}", "prompt": f"q{i}", "answer": str(i)} for i in range(5)]


def _table():
  return pa.Table.from_pylist(ROWS)


def test_jsonl_parquet_arrow_read_the_same_rows(tmp_path):
  (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
  pq.write_table(_table(), tmp_path / "d.parquet")
  with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_file(f, _table().schema) as w:
    w.write_table(_table())
  with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, _table().schema) as w:
    w.write_table(_table())
  for name in ("d.jsonl", "d.parquet", "d.arrow", "s.arrow"):
    src = sources.open_source(str(tmp_path / name), skip_bad_lines=False)
    assert len(src) == 5, name
    assert [src[i] for i in range(5)] == ROWS, name
    assert set(src.columns) == {"id", "prompt", "answer"}


def test_jsonl_errors_name_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"a": 1}\n{"a": \xff}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid UTF-8"):
    sources.read_jsonl(str(path), skip_bad_lines=False)
  path.write_text('{"a": 1}\n{"a": \n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
    sources.read_jsonl(str(path), skip_bad_lines=False)
  path.write_text('[1, 2]\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object"):
    sources.read_jsonl(str(path), skip_bad_lines=False)
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    sources.open_source(str(tmp_path / "missing.jsonl"), skip_bad_lines=False)
  with pytest.raises(ValueError, match="cannot infer the format"):
    sources.open_source(str(tmp_path / "x.csv"), skip_bad_lines=False)
  (tmp_path / "broken.parquet").write_text("not parquet")
  with pytest.raises(ValueError, match="broken.parquet"):
    sources.open_source(str(tmp_path / "broken.parquet"), skip_bad_lines=False)


def test_hf_saved_to_disk(tmp_path):
  datasets = pytest.importorskip("datasets")
  datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
  src = sources.open_source(str(tmp_path / "ds"), skip_bad_lines=False)
  assert [src[i] for i in range(5)] == ROWS


def test_hf_disk_without_datasets_gives_clear_error(tmp_path):
  try:
    import datasets  # noqa: F401
    pytest.skip("datasets is installed")
  except ImportError:
    pass
  with pytest.raises(ImportError, match="pip install datasets"):
    sources.open_source(str(tmp_path), skip_bad_lines=False)
