"""Data fingerprints: a change of content is seen whatever keeps the path, the size or the row count."""

import json

from tunixlike.data import fingerprint, sources


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_file_changed_in_size_or_only_in_content_is_named(tmp_path):
  path = tmp_path / "train.jsonl"
  rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(400)]
  _write(path, rows)
  before = fingerprint.fingerprint(sources.open_path(str(path), skip_bad_lines=False))
  assert fingerprint.changes(before, fingerprint.fingerprint(sources.open_path(str(path), skip_bad_lines=False))) == []
  _write(path, rows[::-1])  # shuffled: the same bytes in another order
  assert fingerprint.changes(before, fingerprint.fingerprint(sources.open_path(str(path), skip_bad_lines=False))) == [
      f"{path} changed (the same size, other content)"]
  _write(path, rows[:150])
  size = path.stat().st_size
  (change,) = fingerprint.changes(before, fingerprint.fingerprint(sources.open_path(str(path), skip_bad_lines=False)))
  assert change.startswith(f"{path} changed (") and change.endswith(f" -> {size:,} bytes)")


def test_a_glob_names_a_new_file_and_rows_in_memory_are_hashed(tmp_path):
  _write(tmp_path / "a.jsonl", [{"prompt": "x"}])
  before = fingerprint.fingerprint(sources.open_path(str(tmp_path / "*.jsonl"), skip_bad_lines=False))
  _write(tmp_path / "b.jsonl", [{"prompt": "y"}])
  after = fingerprint.fingerprint(sources.open_path(str(tmp_path / "*.jsonl"), skip_bad_lines=False))
  assert fingerprint.changes(before, after) == [f"{tmp_path / 'b.jsonl'} is new"]
  rows = [{"prompt": str(i)} for i in range(10)]
  mem = lambda r: fingerprint.fingerprint(sources.ListSource(r, "data.train"))
  assert fingerprint.changes(mem(rows), mem(list(rows))) == []
  assert fingerprint.changes(mem(rows), mem(rows[:9])) == ["the rows changed (10 -> 9 rows)"]
  assert fingerprint.changes(mem(rows), mem(rows[::-1])) == ["the rows changed (as many rows, other content)"]


def test_a_huge_file_is_sampled_not_read_whole(tmp_path, monkeypatch):
  monkeypatch.setattr(fingerprint, "WHOLE_FILE_BYTES", 1 << 12)
  path = tmp_path / "big.jsonl"
  path.write_bytes(b"x" * (1 << 20))
  digest = fingerprint.file_digest(str(path))
  assert digest["sampled"] and digest["bytes"] == 1 << 20
  data = bytearray(path.read_bytes())
  data[0] = ord("y")  # the first chunk is always sampled
  path.write_bytes(bytes(data))
  assert fingerprint.file_digest(str(path))["sha256"] != digest["sha256"]
