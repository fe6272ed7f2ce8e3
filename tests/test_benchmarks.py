"""Smoke tests of the benchmarks: each runs end to end with --quick and writes a sane JSON object,
with the keys every benchmark shares (benchmarks/harness.py)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(name: str, tmp_path, *flags: str, timeout_s: float = 300) -> dict:
  out = tmp_path / f"{name}.json"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join("benchmarks", f"{name}.py"), "--quick", *flags,
                         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = json.loads(proc.stdout)  # stdout is exactly one JSON object
  written = json.loads(out.read_text())
  assert printed == written
  assert_shared_keys(written)
  return written


def assert_shared_keys(r: dict):
  """What `harness.report` adds to every benchmark's report, under one spelling."""
  assert r["quick"] is True and isinstance(r["seed"], int) and len(r["date"]) == 10
  assert {"jax", "xla_flags", "python", "cpus", "host"} <= set(r["environment"])
  assert [len(r["load_average"][k]) for k in ("before", "after")] == [3, 3]


def assert_positive(d: dict, *keys: str):
  for k in keys:
    v = d[k]
    assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (k, v)


@pytest.mark.slow
def test_weight_sync_benchmark(tmp_path):
  r = run_benchmark("weight_sync", tmp_path)
  assert_positive(r, "full_sync_ms", "memcpy_ms", "full_vs_memcpy", "lora_sync_ms", "full_vs_lora", "model_bytes",
                  "delivered_bytes", "lora_bytes", "memcpy_model_bytes_ms", "full_vs_memcpy_model_bytes")
  assert r["full_vs_memcpy"] == pytest.approx(r["full_sync_ms"] / r["memcpy_ms"])
  assert r["full_vs_lora"] == pytest.approx(r["full_sync_ms"] / r["lora_sync_ms"])
  assert r["full_vs_lora_with_pack"] == pytest.approx(r["full_sync_ms"] / r["lora_sync_with_pack_ms"])
  # The default sampler layout replicates the weights on its 4 replicas: 4x the model's bytes arrive.
  assert r["delivered_bytes"] >= 4 * r["model_bytes"] * 0.99
  assert r["lora_bytes"] < r["model_bytes"]
  assert r["environment"]["devices"] == 8
  for layout in r["layouts"].values():
    for method in layout["methods_ms"].values():
      assert_positive(method, "median_ms", "min_ms", "max_ms")


@pytest.mark.slow
def test_async_vs_sync_benchmark(tmp_path):
  r = run_benchmark("async_vs_sync", tmp_path)
  assert_positive(r, "speedup_long_tail", "speedup_slow_reward")
  # Its own layout (1 sampler + 1 learner device by default), whatever XLA_FLAGS said.
  assert r["devices"] == r["mesh"]["sampler_devices"] + r["mesh"]["learner_devices"] == 2
  assert set(r["final_reward_sync"]) == set(r["final_reward_async"]) == {"long_tail", "slow_reward"}
  assert set(r["final_eval_accuracy_sync"]) == set(r["final_eval_accuracy_async"]) == {"long_tail", "slow_reward"}
  for v in [*r["final_reward_sync"].values(), *r["final_reward_async"].values()]:
    assert math.isfinite(v) and 0.0 <= v <= 1.0
  # Sync mode is staleness 0 by construction; async never exceeds its configured bound.
  assert 0 <= r["max_staleness"] <= max(r["async_max_staleness_config"].values()) <= 2
  for name in ("long_tail", "slow_reward"):
    w = r["workloads"][name]
    assert w["speedup"] == pytest.approx(w["sync"]["wall_s"] / w["async"]["wall_s"])
    assert w["sync"]["max_staleness"] == 0
    assert w["async"]["max_staleness"] <= w["async"]["max_staleness_config"] == r["async_max_staleness_config"][name]
    for mode in ("sync", "async"):
      m = w[mode]
      assert_positive(m, "wall_s", "s_per_step", "learner_busy_frac", "sampler_tokens_per_s")
      # 0 when the sampler had sampled every step's groups before the timed window (quick runs).
      assert math.isfinite(m["sampler_busy_frac"]) and m["sampler_busy_frac"] >= 0.0
      assert m["learner_version"] == m["steps"] == w["setup"]["steps"]
      assert m["sampler_programs_compiled_during_run"] == 0  # sampler.warmup compiled them all before
      assert 0.0 <= m["final_eval_accuracy"] <= 1.0 and m["eval_prompts"] > 0
  assert r["workloads"]["long_tail"]["sync"]["completion_length"]["max"] >= 1
  assert isinstance(r["notes"], list) and r["notes"]


@pytest.mark.slow
def test_group_by_length_benchmark(tmp_path):
  # 2 length groups: each is a branch of the compiled step (8 took ~50 s to compile)
  r = run_benchmark("group_by_length", tmp_path, "--groups", "2")
  assert_positive(r, "padded_ms", "micro_ms", "grouped_ms", "grouped_vs_padded", "grouped_vs_micro")
  assert r["grouped_vs_padded"] == pytest.approx(r["padded_ms"] / r["grouped_ms"])
  s = r["settings"]
  assert (s["grouped"]["micro_batches"], s["grouped"]["group_by_length"]) == (16, 2)
  # the three settings train the same objective: the same loss on the same batch
  for name in ("micro", "grouped"):
    assert s[name]["first_batch_loss"] == pytest.approx(s["padded"]["first_batch_loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_sampler_throughput_benchmark(tmp_path):
  # One timed run of each kind and 2 attention windows (4 + 4 decode and move programs to compile, not 9 + 9).
  r = run_benchmark("sampler_throughput", tmp_path, "--repeats", "1", "--repeats-fixed", "1", "--attend-bucket", "64")
  assert_positive(r, "tunixlike_tok_s", "transformers_tok_s", "speedup_vs_transformers", "continuous_tok_s",
                  "static_tok_s", "continuous_vs_static", "slot_occupancy")
  assert r["speedup_vs_transformers"] == pytest.approx(r["tunixlike_tok_s"] / r["transformers_tok_s"], rel=5e-3)  # both rounded to 0.1 tokens/s
  assert len(r["runs"]["tunixlike_tok_s"]) == len(r["runs"]["transformers_tok_s"]) == r["setup"]["repeats_fixed"]
  # Both systems load the same checkpoint: their logits agree.
  assert r["logits_max_abs_diff"] < 1e-3
  # Continuous batching never decodes more steps than static batching on the same requests.
  assert r["decode_steps"]["continuous"] <= r["decode_steps"]["static"]
  assert 0 < r["slot_occupancy"] <= 1 and r["slot_occupancy"] >= r["static_slot_occupancy"]


@pytest.mark.slow
def test_sampler_admission_benchmark(tmp_path):
  r = run_benchmark("sampler_admission", tmp_path)
  assert_positive(r, "wall_ms_per_step", "busy_ms_per_step", "prefill_calls_per_step", "insert_calls_per_step",
                  "generate_calls_per_step")
  w = r["workload"]
  assert (w["prompts_per_step"], w["group_size"], w["slots"], w["sampler_devices"]) == (32, 8, 128, 4)
  assert r["prefills_per_step"] == w["prompts_per_step"]  # one prefill per group (one weight version)
  # Groups admitted together share program calls: far fewer than one prefill and insert per group.
  assert max(r["prefill_calls_per_step"], r["insert_calls_per_step"]) < w["prompts_per_step"] / 4
  assert r["programs_compiled_after_warmup"] == 0
  assert_positive(r["blocking"], "prefill_ms_per_call", "insert_ms_per_call", "generate_ms_per_call")


@pytest.mark.slow
def test_agent_endpoint_benchmark(tmp_path):
  r = run_benchmark("agent_endpoint", tmp_path)
  assert_positive(r, "endpoint_tok_s", "inprocess_tok_s", "endpoint_vs_inprocess")
  assert r["endpoint_vs_inprocess"] == pytest.approx(r["inprocess_tok_s"] / r["endpoint_tok_s"], rel=1e-2)
  assert r["workload"]["requests_per_run"] == r["workload"]["prompts"] * 8


@pytest.mark.slow
def test_learner_step_benchmark(tmp_path):
  r = run_benchmark("learner_step", tmp_path, "--devices", "2")
  assert r["devices"] == r["environment"]["devices"] == 2
  assert_positive(r, "tokens_per_s", "model_flops_per_s", "peak_matmul_flops_per_s", "mfu")
  for m in r["models"].values():
    assert m["loss_finite"] and m["tokens_per_step"] == m["batch"] * m["seq"] == 4 * 64
    assert m["model_flops_per_s"] == pytest.approx(m["model_flops_per_token"] * m["tokens_per_s"], rel=1e-6)
  assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / r["peak_matmul_flops_per_s"], rel=1e-6)


@pytest.mark.slow
def test_rl_step_benchmark(tmp_path):
  # No warm start and 8 held-out prompts: the runs' figures are not what this checks, and they are two
  # CLI runs of their own (about half of their CPU time was the warm start's steps and greedy evals).
  r = run_benchmark("rl_step", tmp_path, "--steps", "5", "--skip-steps", "1", "--repeats", "2",
                    "--set", "warm_start.max_steps=0", "--set", "data.num_eval_examples=8", timeout_s=600)
  split = r["layouts"]["split"]
  # Two rounds: the faster of the middle two, with its own figures.
  assert len(r["rounds"]) == 2 and split == min((x["split"] for x in r["rounds"]), key=lambda s: s["s_per_step"])
  assert_positive(split, "s_per_step", "learner_busy", "sampler_busy", "sync_ms", "learner_step_s")
  assert r["s_per_step"] == {"split": split["s_per_step"]} and r["fastest_layout"] == "split"
  # Busy time is counted when a call ends: over a 3-step window a side that is always busy can
  # read above 1 (a call that began before the window counts in full: 1.09 seen while the rest of
  # the suite ran beside it); counting a side twice would read about 2.
  assert r["split_busy_max"] == max(split["learner_busy"], split["sampler_busy"]) <= 1.25
  assert 0 <= split["overhead_s"] < split["s_per_step"] and split["timed_steps"] == 3
  assert r["workload"]["settings"] == ["warm_start.max_steps=0", "data.num_eval_examples=8"]  # --set reached the runs


def test_rl_step_grid_points_are_valid_configs_of_the_main_job(monkeypatch):
  """Each --grid point (and each layout) is a config the CLI accepts, with the size it names."""
  import importlib.util
  import pathlib

  from tunixlike import config as config_lib
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # rl_step imports harness, beside it
  spec = importlib.util.spec_from_file_location("rl_step", os.path.join(ROOT, "benchmarks", "rl_step.py"))
  rl_step = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rl_step)
  base = pathlib.Path(ROOT) / "configs" / "addition_grpo.py"
  for axis, points in rl_step.GRID.items():
    for value, flags in points:
      for layout in ("split", "colocated"):
        raw = config_lib.load(base)
        for flag in rl_step.GRID_COMMON + flags + rl_step._layout_flags(layout):
          key, text = flag.removeprefix("--config.").split("=")
          section, name = key.split(".")
          with raw.unlocked():
            raw[section][name] = type(raw[section][name])(text)
        cfg = config_lib.from_config_dict(raw)
        assert cfg.mesh.layout == layout
        if axis == "completion_tokens":
          assert cfg.sampler.max_new_tokens == value
        if axis == "prompts_per_step":
          assert cfg.rl.prompts_per_step * cfg.algo.group_size == rl_step._rows_per_step(flags)


@pytest.mark.slow
def test_determinism_benchmark(tmp_path):
  r = run_benchmark("determinism", tmp_path)
  assert r["deterministic_runs_equal"] is True and r["first_difference"]["deterministic"] is None
  assert isinstance(r["free_running_runs_equal"], bool)  # false on the full main job; the tiny one may agree
  assert set(r["modes"]) == set(r["runs"]) == {"free_running", "deterministic"}
  assert all(len(runs) == 2 for runs in r["runs"].values())  # two of each, alternated
  for m in r["modes"].values():
    assert_positive(m, "s_per_step", "s_per_step_median", "wall_s", "slot_occupancy")
    assert 0 <= m["accuracy_before"] <= 1 and 0 <= m["accuracy_after"] <= 1
  ratio = r["modes"]["deterministic"]["s_per_step"] / r["modes"]["free_running"]["s_per_step"]
  assert r["ratio_s_per_step"] == pytest.approx(ratio, abs=1e-3)
  assert r["target_met"] == (r["ratio_s_per_step"] <= r["target"] == 1.15)


@pytest.mark.slow
def test_long_rollouts_benchmark(tmp_path):
  r = run_benchmark("long_rollouts", tmp_path, "--skip-short")
  assert_positive(r, "paged_tok_s", "contiguous_tok_s", "paged_vs_contiguous", "concurrent_paged",
                  "concurrent_contiguous")
  assert r["paged_vs_contiguous"] == pytest.approx(r["paged_tok_s"] / r["contiguous_tok_s"], rel=1e-2)
  # A budget of 2 contiguous slots: contiguous never decodes more at once; paged shares the pool, so
  # more sequences decode at once and the workload takes fewer decode steps (counts, not times).
  assert r["concurrent_contiguous"] <= 2 < r["concurrent_paged"] and isinstance(r["preemptions"], int)
  assert r["decode_steps"]["paged"] < r["decode_steps"]["contiguous"]
  # G = 8 samples of one (256-token) prompt hold its full blocks once and 8 partly filled blocks.
  assert r["prompt_blocks_shared"] == r["prompt_blocks_one_sample"] - 1 + 8


@pytest.mark.slow
def test_multi_agent_benchmark(tmp_path):
  r = run_benchmark("multi_agent", tmp_path, "--seed", "1")
  modes = r["modes"]
  assert set(modes) == {"sync", "group", "episode"} and r["setup"]["seed"] == 1
  for m in modes.values():
    assert_positive(m, "s_per_episode", "episode_wait_p90_over_median", "trained_episode_tokens", "s_per_step",
                    "learner_s_per_step", "sampler_busy_s_per_step")
    assert m["s_per_step"] == pytest.approx(m["s_per_episode"] * r["setup"]["episodes_per_step"], rel=1e-2)
    assert all(1 <= v <= r["setup"]["steps"] for v in m["versions"].values())  # at most one step per batch
  assert r["episode_async_vs_sync"] == pytest.approx(modes["sync"]["s_per_episode"] / modes["episode"]["s_per_episode"],
                                                     rel=1e-2)
  assert r["episode_async_vs_group_async"] == pytest.approx(
      modes["group"]["s_per_episode"] / modes["episode"]["s_per_episode"], rel=1e-2)


@pytest.mark.slow
def test_long_context_benchmark(tmp_path):
  r = run_benchmark("long_context", tmp_path, "--run-max", "128", timeout_s=600)  # five fresh processes
  runs = {(x["attention"], x["length"]): x for x in r["runs"]}
  assert set(runs) == {("reference", 128), ("blockwise", 128), ("blockwise", 256), ("ring_zigzag_4", 128),
                       ("all_gather_zigzag_4", 128)}
  for key in (("reference", 128), ("blockwise", 128), ("ring_zigzag_4", 128), ("all_gather_zigzag_4", 128)):
    assert_positive(runs[key], "step_s", "peak_rss_gb")
  assert runs[("blockwise", 256)]["compile_only"] and runs[("blockwise", 256)]["compiled_gb"]["temp"] > 0
  # the same step: both kernels give the same loss
  assert r["blockwise_vs_reference_128"]["loss_abs_diff"] < 1e-5
  for scheme in ("ring", "all_gather"):  # the row split over 4 devices
    assert r[f"{scheme}_zigzag_4_128"]["loss_abs_diff"] < 1e-5
  side = r["ring_zigzag_4_vs_all_gather_zigzag_4_128"]
  assert side["temp_gb_per_device"]["ring_zigzag_4"] > 0 and side["loss_abs_diff"] < 1e-5
  assert r["block_pairs_per_device_zigzag_4_128"]["busiest_to_mean"] == 1  # every device as much causal work
  for layout in ("zigzag", "contiguous"):  # each device's ring attention, timed alone
    work = r[f"ring_work_per_device_{layout}_4_512"]
    assert len(work["seconds"]) == 4 and min(work["seconds"]) > 0
  assert len(set(r["ring_work_per_device_zigzag_4_512"]["block_pairs"])) == 1


@pytest.mark.slow
def test_defaults_benchmark_runs_a_config_of_data_answer_and_reward_only(tmp_path):
  r = run_benchmark("defaults", tmp_path, "--tasks", "sort", "--workdir-root", str(tmp_path / "tasks"))
  sort = r["tasks"]["sort"]
  assert sort["stopped_by"] == "end" and sort["final_step"] == 2, sort
  assert 0 <= sort["supervised_accuracy"] <= 1 and [s for s, _ in sort["evals"]] == [0, 2]
  assert [line.split("=")[0] for line in sort["chosen"]] == ["optim.learning_rate", "sampler.temperature",
                                                             "sampler.max_new_tokens"]
  config_text = (tmp_path / "tasks" / "sort" / "config.py").read_text()
  keys = {line.split("=")[0].strip() for line in config_text.splitlines() if line.strip().startswith("c.")}
  assert keys == {"c.data.task", "c.data.train", "c.data.eval", "c.data.prompt_field", "c.data.answer_field",
                  "c.data.num_eval_examples", "c.rewards"}


@pytest.mark.slow
def test_speculative_benchmark(tmp_path):
  r = run_benchmark("speculative", tmp_path, timeout_s=900)
  for name in ("trained", "random"):
    b = r["batch"][name]
    assert b["identical_tokens"] is True and b["max_logprob_difference"] < 1e-4
    assert_positive(b["plain"], "batch_s", "tokens_per_s", "forwards", "positions")
    assert_positive(b["speculative"], "batch_s", "tokens_per_s", "tokens_per_decode_step", "forwards", "positions")
    assert b["plain"]["tokens"] == b["speculative"]["tokens"] == b["completion_tokens"]["total"]
    assert b["ratio_batch_s"] == pytest.approx(b["speculative"]["batch_s"] / b["plain"]["batch_s"], abs=1e-3)
    assert b["target_met"] == (b["ratio_batch_s"] <= b["target"])
    assert all(len(runs) == 2 for runs in b["runs"].values())
