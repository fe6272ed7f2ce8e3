"""One run per workdir: a real lock between real processes, released by the kernel when its holder dies."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tunixlike import workdir

HOLD = textwrap.dedent("""
    import sys, time
    from tunixlike import workdir
    with workdir.WorkdirLock(sys.argv[1]):
      print("locked", flush=True)
      time.sleep(600)
""")


def hold(path):
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_a_second_run_is_refused_and_a_dead_holder_is_taken_over_with_a_warning(tmp_path, caplog):
  holder = hold(tmp_path)
  try:
    with pytest.raises(workdir.WorkdirError, match=rf"--workdir {tmp_path} is in use by process {holder.pid} on "
                       rf"host {os.uname().nodename}"):
      workdir.WorkdirLock(str(tmp_path)).acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
  with workdir.WorkdirLock(str(tmp_path)):  # the kernel released the dead holder's lock
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
  assert f"taking over the lock left by process {holder.pid}" in caplog.text
  assert (tmp_path / ".lock").read_text() == ""  # a clean exit leaves no holder behind
  caplog.clear()
  with workdir.WorkdirLock(str(tmp_path)):
    pass
  assert "taking over" not in caplog.text


def test_a_workdir_that_is_a_file_or_not_writable_is_named(tmp_path):
  f = tmp_path / "f"
  f.write_text("x")
  with pytest.raises(workdir.WorkdirError, match=f"--workdir {f} is a file, not a directory"):
    workdir.prepare(str(f))
  with pytest.raises(workdir.WorkdirError, match=f"--workdir {f}/sub cannot be created"):
    workdir.prepare(str(f / "sub"))
  ro = tmp_path / "ro"
  ro.mkdir(mode=0o500)
  # Root writes through permissions: a read-only filesystem shows it the same failure.
  mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                                                 capture_output=True).returncode == 0
  if os.geteuid() == 0 and not mounted:
    pytest.skip("running as root without mount: no directory is unwritable")
  try:
    with pytest.raises(workdir.WorkdirError, match=f"--workdir {ro} is not writable"):
      workdir.prepare(str(ro))
  finally:
    if mounted:
      subprocess.run(["umount", str(ro)], check=True)


def test_remote_workdirs_keep_logs_in_a_local_mirror():
  local = workdir.local_dir("gs://bucket/runs/a")
  assert "://" not in local and local.endswith("gs_bucket_runs_a")
  assert workdir.local_dir("/tmp/run") == "/tmp/run"
  assert workdir.local_dir("/tmp/run", 2) == "/tmp/run/process_2"
  assert workdir.is_remote("gs://b/w") and not workdir.is_remote("runs/w")
