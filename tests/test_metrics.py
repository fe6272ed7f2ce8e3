"""Metrics logs: a full disk raises LogWriteError instead of hanging the run, TensorBoard events are
well-formed, and JSONL logs survive a torn last line (read, cut back on resume, wall clock)."""

import contextlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time

import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from tunixlike import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_TIMEOUT_S = 60  # the scripts finish in seconds; a hang fails the test instead of pytest
LIMIT_BYTES = 256 * 1024  # RLIMIT_FSIZE of the fallback: smaller than what the scripts write


def logger_at(workdir, **on):
  """A MetricsLogger writing to `workdir` with the logs in `on` (the others off)."""
  return metrics.MetricsLogger(workdir, **{"tensorboard": False, "progress_bar": False, "wandb": False,
                                           "wandb_project": "tunixlike", **on})


@contextlib.contextmanager
def small_disk(path):
  """A 2 MB tmpfs mounted at `path` (True), or False where mounting is not allowed (not root, CI).

  On False the scripts set RLIMIT_FSIZE instead: writes past the limit fail with EFBIG ("File too
  large") rather than ENOSPC, through the same kernel write path; the test names which one ran.
  """
  os.makedirs(path, exist_ok=True)
  mount = shutil.which("mount")
  mounted = mount is not None and subprocess.run(
      [mount, "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)], capture_output=True).returncode == 0
  try:
    yield mounted
  finally:
    if mounted:
      subprocess.run(["umount", str(path)], check=True)


def run_script(body: str, *args, limit: bool) -> dict:
  """Runs `body` in a fresh interpreter; it prints one JSON line last. A hang fails the test."""
  prologue = "import resource, signal\n"
  if limit:  # the fallback: a file size limit instead of a full disk (SIGXFSZ would kill the process)
    prologue += (f"signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                 f"resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT_BYTES}, {LIMIT_BYTES}))\n")
  source = textwrap.dedent(body).replace("# LIMIT\n", prologue)
  try:
    done = subprocess.run([sys.executable, "-c", source, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=HANG_TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the log writer hung for {HANG_TIMEOUT_S} s instead of raising; stderr:\n{e.stderr}")
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.strip().splitlines()[-1])


WRITE_UNTIL_FULL = """
import json, sys
from tunixlike import metrics
workdir, want = sys.argv[1], sys.argv[2].split(",")
logger = metrics.MetricsLogger(workdir, progress_bar=False, tensorboard=True, wandb=False, wandb_project="tunixlike")
# LIMIT
errors, steps = [], 0
while steps < 20_000 and not all(any(w in e for e in errors) for w in want):
  try:
    logger.write(steps, {f"loss/part_{i}": 0.5 + i for i in range(30)})
  except metrics.LogWriteError as e:
    errors.append(str(e))
  steps += 1
try:
  logger.close()
  closed = "ok"
except metrics.LogWriteError as e:
  closed = str(e)
print(json.dumps({"errors": errors, "steps": steps, "closed": closed}))
"""


def _os_error(mounted: bool) -> str:
  return "[Errno 28] No space left on device" if mounted else "[Errno 27] File too large"


def test_full_tensorboard_disk_raises_once_and_metrics_go_on(tmp_path):
  """The default config's hang: tensorboardX's writer thread died on ENOSPC and the next `put` into
  its bounded queue blocked forever. Here only WORKDIR/tensorboard is full (a tmpfs mounted there)."""
  workdir = tmp_path / "run"
  with small_disk(workdir / "tensorboard") as mounted:
    out = run_script(WRITE_UNTIL_FULL, workdir, "tensorboard", limit=not mounted)
  print("small disk:", "2 MB tmpfs" if mounted else f"RLIMIT_FSIZE={LIMIT_BYTES}")
  # One clear error, raised once: the failed writer is not retried at every later step.
  assert out["errors"] == [f"{workdir}/tensorboard: TensorBoard writer failed: {_os_error(mounted)}"]
  assert out["closed"] == "ok"
  if mounted:  # the JSONL (on the real disk) kept every step, before and after the failure
    assert [r["step"] for r in metrics.read_jsonl(workdir / "metrics.jsonl")] == list(range(out["steps"]))


def test_full_workdir_names_every_failed_log(tmp_path):
  workdir = tmp_path / "run"
  with small_disk(workdir) as mounted:
    out = run_script(WRITE_UNTIL_FULL, workdir, "metrics.jsonl,tensorboard", limit=not mounted)
    print("small disk:", "2 MB tmpfs" if mounted else f"RLIMIT_FSIZE={LIMIT_BYTES}")
    reported = "; ".join(out["errors"])
    assert f"{workdir}/metrics.jsonl: metrics writer failed: {_os_error(mounted)}" in reported
    assert f"{workdir}/tensorboard: TensorBoard writer failed: {_os_error(mounted)}" in reported
    assert len(out["errors"]) <= 2 and out["steps"] < 20_000
    assert out["closed"] == "ok"  # both failures were already raised: close has nothing new
    # What did reach the disk is readable: at most a torn last line, dropped with a warning.
    assert metrics.read_jsonl(workdir / "metrics.jsonl")


TRACE_UNTIL_FULL = """
import json, os, sys
from tunixlike import metrics, trace
path = sys.argv[1]
tracer = trace.Tracer(path)
with tracer.span("first"):
  pass
tracer.save()  # small: fits
# LIMIT
for i in range(100_000):
  tracer.instant("step", i=i, note="x" * 40)
try:
  tracer.close()
  error = None
except metrics.LogWriteError as e:
  error = str(e)
again = tracer.close()  # stopped: not retried
print(json.dumps({"error": error, "again": again, "files": sorted(os.listdir(os.path.dirname(path)))}))
"""


def test_trace_on_a_full_disk_raises_and_keeps_the_last_good_file(tmp_path):
  directory = tmp_path / "traces"
  path = directory / "trace.json"
  with small_disk(directory) as mounted:
    out = run_script(TRACE_UNTIL_FULL, path, limit=not mounted)
    print("small disk:", "2 MB tmpfs" if mounted else f"RLIMIT_FSIZE={LIMIT_BYTES}")
    assert out["error"] == f"{path}: trace writer failed: {_os_error(mounted)}"
    assert out["again"] is None
    assert out["files"] == ["trace.json"]  # no temp file left behind
    with open(path) as f:  # the earlier save, whole
      assert [e["name"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"] == ["first"]


def _events(logdir):
  """The events of the one TFRecord file in `logdir`, checking each length and data checksum."""
  (name,) = os.listdir(logdir)
  with open(os.path.join(logdir, name), "rb") as f:
    data = f.read()
  events, at = [], 0
  while at < len(data):
    header = data[at:at + 8]
    (length,) = struct.unpack("Q", header)
    assert struct.unpack("I", data[at + 8:at + 12])[0] == masked_crc32c(header)
    body = data[at + 12:at + 12 + length]
    assert struct.unpack("I", data[at + 12 + length:at + 16 + length])[0] == masked_crc32c(body)
    events.append(event_pb2.Event.FromString(body))
    at += 16 + length
  return events


def test_tensorboard_events_hold_every_scalar(tmp_path):
  logger = logger_at(str(tmp_path), tensorboard=True)
  logger.write(1, {"reward/mean": 0.25, "accuracy": 1, "done": True, "note": "text"})
  logger.write(2, {"reward/mean": float("nan")})
  logger.close()
  events = _events(tmp_path / "tensorboard")
  assert events[0].file_version == "brain.Event:2"
  scalars = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
  assert [(s, t) for s, t, _ in scalars] == [(1, "time_s"), (1, "reward/mean"), (1, "accuracy"), (2, "time_s")]
  assert scalars[1][2] == 0.25 and scalars[2][2] == 1.0


def _strict_json(text: str):
  def reject(token):
    raise ValueError(f"{token} is not JSON")
  return json.loads(text, parse_constant=reject)


def test_a_nan_metric_is_null_and_every_reader_takes_it(tmp_path):
  """JSON has no NaN: a metric with no value (the warm start's loss before its first step) is null,
  which strict JSON readers and pandas read, and so do the run's own readers (resume, plot)."""
  import numpy as np
  import pandas as pd
  from tunixlike.rl import resume

  logger = logger_at(str(tmp_path), tensorboard=True)
  logger.write(0, {"warm_start/loss": float("nan"), "warm_start/accuracy": 0.25}, advance=False)
  logger.write(0, {"eval/accuracy": 0.25}, advance=False)
  logger.write(1, {"loss": np.float32("nan"), "reward/mean": float("inf"), "kl": np.array([0.5, np.nan])})
  logger.write(2, {"loss": 0.5, "reward/mean": 0.75})
  logger.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  records = [_strict_json(line) for line in lines]
  assert '"warm_start/loss": null' in lines[0] and records[0]["warm_start/loss"] is None
  assert (records[2]["loss"], records[2]["reward/mean"], records[2]["kl"]) == (None, None, [0.5, None])
  assert metrics.read_jsonl(tmp_path / "metrics.jsonl") == records
  frame = pd.read_json(tmp_path / "metrics.jsonl", lines=True)
  assert frame["warm_start/loss"].isna().all() and frame["loss"].isna().tolist() == [True, True, True, False]
  assert frame["loss"].dtype == frame["reward/mean"].dtype == np.float64
  # TensorBoard gets the numbers only (no value is no event), as it did for NaN before.
  scalars = [(e.step, v.tag) for e in _events(tmp_path / "tensorboard")[1:] for v in e.summary.value]
  assert (0, "warm_start/loss") not in scalars and (1, "loss") not in scalars and (1, "reward/mean") not in scalars
  assert (0, "warm_start/accuracy") in scalars and (2, "loss") in scalars

  out = metrics.plot(tmp_path / "metrics.jsonl", tmp_path / "reward.png")
  assert os.path.getsize(out) > 0
  assert resume.cut_logs(str(tmp_path), 2) == records[2]["time_s"]  # a resume to step 2 keeps the null records
  assert metrics.read_jsonl(tmp_path / "metrics.jsonl") == records[:3]


def _write_lines(path, *lines: str, end: str = "\n"):
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + end)


def _records(*steps):
  return [json.dumps({"step": s, "time_s": 10.0 * s}) for s in steps]


def test_read_jsonl_drops_a_torn_last_line_with_a_warning(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  _write_lines(path, *_records(0, 1, 2), '{"step": 3, "ti', end="")
  with caplog.at_level(logging.WARNING):
    assert [r["step"] for r in metrics.read_jsonl(path)] == [0, 1, 2]
  assert str(path) in caplog.text and "torn" in caplog.text
  # A multi-byte character cut in half, and a torn line followed by blank lines.
  with open(path, "ab") as f:
    f.write(b'\n{"step": 4, "text": "caf\xc3')
  _write_lines(path, *_records(0, 1), '{"step": 2, "te', "", "")
  assert [r["step"] for r in metrics.read_jsonl(path)] == [0, 1]
  # A whole last record that only lacks its newline is kept.
  _write_lines(path, *_records(0, 1), end="")
  assert [r["step"] for r in metrics.read_jsonl(path)] == [0, 1]


def test_read_jsonl_rejects_a_bad_line_before_the_last(tmp_path):
  path = tmp_path / "metrics.jsonl"
  _write_lines(path, _records(0)[0], '{"step": 1, "ti', *_records(2, 3))
  with pytest.raises(ValueError, match=rf"{path}: line 2 is not a JSON record"):
    metrics.read_jsonl(path)
  _write_lines(path, _records(0)[0], "[1, 2]", _records(2)[0])  # JSON, but not a record
  with pytest.raises(ValueError, match="line 2"):
    metrics.read_jsonl(path)


def test_truncate_jsonl_cuts_back_to_a_step_atomically(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  warm = json.dumps({"step": 0, "warm_start/loss": 1.0})
  lines = [warm, *_records(1, 2), json.dumps({"step": 2, "eval/accuracy": 0.5}), *_records(3, 4)]
  _write_lines(path, *lines, '{"step": 5, "ti', end="")
  os.chmod(path, 0o644)
  with caplog.at_level(logging.WARNING):
    assert metrics.truncate_jsonl(str(path), 3) == 2  # steps 3 and 4; the torn line is no record
  assert str(path) in caplog.text
  with open(path, encoding="utf-8") as f:
    assert f.read() == "\n".join(lines[:4]) + "\n"  # kept lines unchanged, ending in a newline
  assert os.listdir(tmp_path) == ["metrics.jsonl"] and os.stat(path).st_mode & 0o777 == 0o644
  # Records are kept iff step < below_step, or `keep` says so (e.g. a finished warm start's step 0).
  assert metrics.truncate_jsonl(path, 0, keep=lambda r: "warm_start/loss" in r) == 3
  assert metrics.read_jsonl(path) == [json.loads(warm)]
  # Nothing to drop: the file is left alone (the same inode), and a missing file is no error.
  inode = os.stat(path).st_ino
  assert metrics.truncate_jsonl(path, 1) == 0 and os.stat(path).st_ino == inode
  assert metrics.truncate_jsonl(tmp_path / "absent.jsonl", 1) == 0
  # Another key, as prompts.jsonl could use; a record without it is corruption.
  _write_lines(path, json.dumps({"version": 1}), json.dumps({"version": 4}))
  assert metrics.truncate_jsonl(path, 2, key="version") == 1
  with pytest.raises(ValueError, match="record 1 has no numeric 'step'"):
    metrics.truncate_jsonl(path, 2)


def test_logger_appends_after_a_torn_line_and_continues_the_clock(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  _write_lines(path, *_records(0, 1, 2), '{"step": 3, "time_s": 3', end="")
  assert metrics.last_time_s(path) == 20.0
  before = time.monotonic()
  logger = logger_at(str(tmp_path), time_offset_s=metrics.last_time_s(path))
  with caplog.at_level(logging.WARNING):
    record = logger.write(3, {"reward/mean": 0.5})
  logger.close()
  since = time.monotonic() - before  # the logger's clock went on from 20 s by at most this much
  assert "torn last line" in caplog.text
  records = metrics.read_jsonl(path)  # the new record starts its own line
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  assert records[-1] == record and 20.0 <= record["time_s"] <= 20.0 + since
  # A whole last record lacking its newline gets one before the next record.
  _write_lines(path, *_records(0, 1), end="")
  logger = logger_at(str(tmp_path))
  logger.write(2, {})
  logger.close()
  assert [r["step"] for r in metrics.read_jsonl(path)] == [0, 1, 2]


def test_last_time_s_without_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  assert metrics.last_time_s(path) == 0.0
  _write_lines(path, json.dumps({"step": 1, "trained": [3]}), '{"time_s": 9', end="")
  assert metrics.last_time_s(path) == 0.0


def test_each_stage_has_its_own_progress_bar(tmp_path, capsys):
  logger = logger_at(str(tmp_path), progress_bar=True)
  logger.info("before any stage")  # no bar yet: a plain line
  assert capsys.readouterr().err == ""
  logger.progress("warm start", total=4, initial=1)
  logger.progress_to(3)
  logger.info("warm start step 3")
  logger.progress("rl", total=2)  # closes the warm start's bar where it stood
  warm = capsys.readouterr().err
  assert "warm start:  75%" in warm and "3/4" in warm and "rl:" in warm and "rl:   0%" in warm
  logger.write(0, {"reward/mean": 0.5})
  logger.write(1, {"eval/accuracy": 0.25}, advance=False)  # an eval does not advance the bar
  logger.end_progress()
  rl = capsys.readouterr().err
  assert "1/2" in rl and "2/2" not in rl and "warm start" not in rl and "held_out=0.25" in rl
  logger.progress("rl", total=3, initial=1)
  logger.write(1, {"reward/mean": 0.75, "staleness/max": 1})  # the last eval stays beside the step's reward
  logger.write(2, {"eval/accuracy": 0.5}, advance=False)
  logger.write(2, {"reward/mean": 0.25})
  logger.end_progress()
  bar = capsys.readouterr().err.splitlines()[-1]
  assert "reward=0.25" in bar and "held_out=0.5" in bar and "max" not in bar, bar
  logger.close()


BLOCK_BYTES = 32 * 1024  # W&B's transaction log: LevelDB's log format


def _close_and_read_wandb(logger):
  """Closes `logger`; the records of its W&B run (the run-ID.wandb file in its run directory):
  wandb's own protobuf `Record`s in LevelDB log blocks of chunks behind 7-byte headers (checksum,
  length, type)."""
  import wandb
  from wandb.proto import wandb_internal_pb2
  logger.close()
  wandb.teardown()  # `finish` leaves the file's last writes to W&B's service: it is whole once that stops
  run_dir = logger.outputs["wandb"]
  (path,) = [os.path.join(run_dir, n) for n in os.listdir(run_dir) if n.endswith(".wandb")]
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  records, at, pending = [], 7, b""
  while at + 7 <= len(data):
    if BLOCK_BYTES - at % BLOCK_BYTES < 7:  # a block's tail too short for a header is padding
      at += BLOCK_BYTES - at % BLOCK_BYTES
      continue
    _, length, kind = struct.unpack("<IHB", data[at:at + 7])
    pending += data[at + 7:at + 7 + length]
    at += 7 + length
    if kind in (1, 4):  # a whole record, or the last chunk of one
      records.append(wandb_internal_pb2.Record.FromString(pending))
      pending = b""
  return records


def _items(items):
  return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_wandb_gets_every_record_and_a_resumed_logger_continues_its_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: the run stays in WORKDIR/wandb
  workdir = str(tmp_path)
  logger = logger_at(workdir, wandb=True, config={"rl": {"num_steps": 3}})
  for step in range(3):
    logger.write(step, {"reward/mean": 0.25 * step, "note": "not a scalar"})
  logger.write(2, {"eval/accuracy": 0.5}, advance=False)  # the same step: one W&B row
  first = _close_and_read_wandb(logger)
  assert os.path.dirname(logger.outputs["wandb"]) == os.path.join(workdir, "wandb")
  history = [_items(r.history.item) for r in first if r.HasField("history")]
  assert [h["_step"] for h in history] == [0, 1, 2]
  assert [h["reward/mean"] for h in history] == [0.0, 0.25, 0.5] and "note" not in history[0]
  assert history[-1]["eval/accuracy"] == 0.5
  summary = {}
  for r in first:
    if r.HasField("summary"):
      summary.update(_items(r.summary.update))
  assert summary["reward/mean"] == 0.5 and summary["eval/accuracy"] == 0.5
  (run,) = [r.run for r in first if r.HasField("run")]
  assert _items(run.config.update)["rl"] == {"num_steps": 3}

  # metrics.jsonl goes on: the same W&B run goes on.
  logger = logger_at(workdir, wandb=True)
  logger.write(3, {"reward/mean": 1.0})
  again = _close_and_read_wandb(logger)
  assert [r.run.run_id for r in again if r.HasField("run")] == [run.run_id]
  assert [_items(r.history.item)["reward/mean"] for r in again if r.HasField("history")] == [1.0]

  # A fresh start (no records kept in metrics.jsonl) is a new W&B run.
  os.remove(logger.path)
  logger = logger_at(workdir, wandb=True)
  assert [r.run.run_id for r in _close_and_read_wandb(logger) if r.HasField("run")] != [run.run_id]


def test_wandb_without_the_package_is_named_in_one_line(tmp_path, monkeypatch):
  from tunixlike import config as config_lib
  monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.LogSection(wandb=True)
  assert str(error.value) == "log.wandb=True: needs the wandb package: pip install wandb"
  with pytest.raises(ImportError, match="^log.wandb=True needs the wandb package: pip install wandb$"):
    logger_at(str(tmp_path), wandb=True)
  config_lib.LogSection(wandb=False)  # off: never looked for


def test_completions_go_to_their_jsonl_a_tensorboard_text_and_a_wandb_table(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  logger = logger_at(str(tmp_path), tensorboard=True, wandb=True)
  rows = [{"step": 4, "prompt": "1+2=", "completion": "3", "reward": 1.0, "rewards": {"correct": 1.0}},
          {"step": 4, "prompt": "1+2=", "completion": "4", "reward": 0.0, "rewards": {"correct": 0.0}}]
  logger.write(4, {"reward/mean": 0.5})
  logger.write_completions(4, rows, "| prompt | completion |\n|---|---|\n| 1+2= | 3 |")
  records = _close_and_read_wandb(logger)
  assert [json.loads(line) for line in open(tmp_path / "completions.jsonl")] == rows
  texts = [(e.step, v.tag, v.tensor.string_val[0].decode()) for e in _events(tmp_path / "tensorboard")[1:]
           for v in e.summary.value if v.tag.startswith("completions")]
  assert texts == [(4, "completions/text_summary", "| prompt | completion |\n|---|---|\n| 1+2= | 3 |")]
  (row,) = [_items(r.history.item) for r in records if r.HasField("history")]  # one W&B row for step 4
  assert row["_step"] == 4 and row["reward/mean"] == 0.5
  assert row["completions/_type"] == "table-file" and row["completions/nrows"] == 2
  assert [r.artifact.type for r in records if r.HasField("artifact")] == ["run_table"]
