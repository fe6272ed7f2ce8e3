"""benchmarks/resume_chaos.py --quick: the tiny run killed 3 times loses nothing against an uninterrupted one
(and, deterministic, ends with the same parameters and metrics)."""

import pytest

from test_benchmarks import run_benchmark

AUDIT_KEYS = ("prompts_lost", "prompts_trained_twice", "stale_drops", "duplicate_metric_steps",
              "duplicate_eval_steps", "final_step", "final_checkpoint_step", "time_s_monotonic")


@pytest.mark.slow
def test_resume_chaos_benchmark(tmp_path):
  r = run_benchmark("resume_chaos", tmp_path, timeout_s=400)
  for key in ("kills", "kills_by_signal", "kills_by_phase", "kills_planned_by_phase", "sigterm_exit_codes",
              "extra_stale_drops", "missing_eval_steps", "wall_s_chaos", "wall_s_uninterrupted", "restarts",
              "failures", "command", *AUDIT_KEYS):
    assert key in r, key
  for run in ("chaos", "uninterrupted"):
    assert set(AUDIT_KEYS) <= set(r[run]), run
  assert r["kills"] == r["kills_requested"] == 3
  assert sum(r["kills_by_signal"].values()) == sum(r["kills_by_phase"].values()) == 3
  assert set(r["kills_by_signal"]) == {"SIGKILL", "SIGTERM"}  # mixed, in equal numbers give or take one
  assert r["restarts"] >= 3 and r["finished"]
  assert r["final_step"] == r["num_steps"] == r["uninterrupted"]["final_step"]
  assert r["wall_s_chaos"] > 0 and r["wall_s_uninterrupted"] > 0
  assert "tunixlike.train" in r["command"]
  # The resume guarantees: nothing lost, trained twice, dropped because of a restart, or logged twice.
  assert r["failures"] == [] and set(r["sigterm_exit_codes"]) <= {"0"}
  for key in ("prompts_lost", "prompts_trained_twice", "extra_stale_drops", "duplicate_metric_steps",
              "duplicate_eval_steps"):
    assert r[key] == 0, (key, r[key])
  assert r["missing_eval_steps"] in ([], 0) and r["time_s_monotonic"]


@pytest.mark.slow
def test_resume_chaos_benchmark_deterministic(tmp_path):
  """With rl.deterministic the killed run ends where the uninterrupted one did, bit for bit."""
  r = run_benchmark("resume_chaos", tmp_path, "--deterministic", timeout_s=400)
  assert r["settings"]["deterministic"] and "--config.rl.deterministic=true" in r["command"]
  assert r["kills"] == 3 and r["finished"] and r["failures"] == []
  assert r["final_params_equal"] and r["final_state"]["arrays"] > 0
  assert r["metrics_equal"] and r["metrics_first_difference"] is None
  # The groups the final checkpoint carries over count as outstanding, not lost.
  assert r["prompts_lost"] == 0 and r["uninterrupted"]["carried"] > 0 and r["targets_met"]
