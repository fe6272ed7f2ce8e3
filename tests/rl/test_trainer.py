"""Where a run writes: local workdirs as they are; gs:// workdirs keep checkpoints remote, logs local."""

from tunixlike.rl import trainer


def test_remote_workdirs_keep_logs_in_a_local_mirror():
  local = trainer.local_dir("gs://bucket/runs/a")
  assert "://" not in local and local.endswith("gs_bucket_runs_a")
  assert trainer.local_dir("/tmp/run") == "/tmp/run"
  assert trainer.is_remote("gs://b/w") and not trainer.is_remote("runs/w")
