"""Bad input through the CLI: a clear line naming the problem and exit status 2, or a counted fallback."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "configs/addition_grpo.py:size=tiny", "--config.warm_start.max_steps=0",
        "--config.log.progress_bar=false", "--config.log.tensorboard=false", "--config.data.num_eval_examples=8",
        "--config.checkpoint.every_steps=1"]


def train(*args):
  env = dict(os.environ)
  return subprocess.run([sys.executable, "-m", "tunixlike.train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_unreadable_data_names_the_file(tmp_path):
  (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\nnot json\n')
  (tmp_path / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
  out = train("--config", "configs/addition_grpo.py", "--config.data.task=gsm8k", f"--config.data.path={tmp_path}",
              f"--workdir={tmp_path / 'run'}")
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith("tunixlike.train: error: ")
  assert "train.jsonl:2" in out.stderr


def test_a_bad_record_is_named_by_its_line_in_the_file(tmp_path):
  good = '{"question": "1+1?", "answer": "#### 2"}\n'
  (tmp_path / "train.jsonl").write_text(good + "\n" + '{"question": "2+2?"}\n')  # a blank line 2
  (tmp_path / "test.jsonl").write_text(good)
  out = train("--config", "configs/addition_grpo.py", "--config.data.task=gsm8k", f"--config.data.path={tmp_path}",
              f"--workdir={tmp_path / 'run'}")
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (f"tunixlike.train: error: {tmp_path / 'train.jsonl'}:3: lacks "
                                                "'question' or 'answer' (has ['question'])")


@pytest.mark.slow
def test_held_out_set_of_any_size_on_four_learner_devices(tmp_path):
  # 3 held-out pairs over 4 fsdp devices: the warm start's accuracy pads them with rows that do not count.
  out = train("--config", "configs/addition_grpo.py:size=tiny", "--config.data.num_eval_examples=3",
              "--config.warm_start.max_steps=2", "--config.rl.num_steps=1",
              "--config.log.tensorboard=false", f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert any(r.get("warm_start/steps") == 2 for r in records)
  assert [r["eval/num_prompts"] for r in records if "eval/num_prompts" in r] == [3, 3]
  # The warm start has its own progress bar (on stderr), finished before the RL bar starts.
  bars = [line.split(":")[0] for line in out.stderr.splitlines() if line.startswith(("warm start:", "rl:"))]
  assert bars == ["warm start"] * bars.count("warm start") + ["rl"] * bars.count("rl") and "rl" in bars
  assert "warm start: 100%" in out.stderr
  # The run ends by naming its outputs.
  lines = out.stdout.splitlines()
  evals = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
  best = max(evals.items(), key=lambda item: (item[1], item[0]))[0]
  assert lines[lines.index("outputs:") + 1:] == [f"  checkpoint  {tmp_path}/checkpoints/1",
                                                 f"  best        {tmp_path}/checkpoints/{best}",
                                                 f"  metrics     {tmp_path}/metrics.jsonl",
                                                 f"  plot        {tmp_path}/reward.png"]


@pytest.mark.slow
def test_damaged_checkpoint_falls_back_and_incompatible_model_is_named(tmp_path):
  workdir = tmp_path / "run"
  out = train(*TINY, "--config.rl.num_steps=2", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  steps = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
  assert steps == [0, 1, 2]  # the latest two, and step 0 where a replay starts (log.schedule)
  # Damage the newest checkpoint's arrays: the run resumes from the previous one.
  for root, _, files in os.walk(workdir / "checkpoints" / "2" / "state"):
    for f in files:
      if not f.startswith("_"):
        os.remove(os.path.join(root, f))
  out = train(*TINY, "--config.rl.num_steps=3", f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from" in out.stderr + out.stdout and "at step 1" in out.stderr + out.stdout
  # A model of another shape on the same workdir: the key and both sizes are named.
  out = train(*TINY, "--config.rl.num_steps=5", "--config.model.hidden_size=32", f"--workdir={workdir}")
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert "model.hidden_size: 64 -> 32" in last


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_clear_line(tmp_path):
  """The default config (TensorBoard on) on a 2 MB disk: a clear error and exit 1, never a hang.

  The disk is a real tmpfs where this machine lets the test mount one; elsewhere the run gets a
  2 MB file-size limit (RLIMIT_FSIZE), which fails its writes with EFBIG instead of ENOSPC."""
  import resource
  disk = tmp_path / "disk"
  disk.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                           capture_output=True).returncode == 0
  limit = None if mounted else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20)))
  print("full disk by", "tmpfs" if mounted else "RLIMIT_FSIZE")
  env = dict(os.environ)
  args = [a for a in TINY if "tensorboard" not in a] + ["--config.checkpoint.every_steps=2",
                                                         "--config.rl.num_steps=200"]
  try:
    out = subprocess.run([sys.executable, "-m", "tunixlike.train", *args, f"--workdir={disk / 'run'}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600, preexec_fn=limit)
  finally:
    if mounted:
      subprocess.run(["umount", str(disk)], check=True)
  assert out.returncode == 1, out.stderr[-3000:]
  # The run's verdict is one line of ours.
  ours = [l for l in out.stderr.splitlines() if l.startswith("tunixlike.train: error: ")]
  assert len(ours) == 1 and ("No space left on device" in ours[0] or "File too large" in ours[0]), ours
  # orbax's writer threads' own tracebacks (about 25 on a full disk) are not repeated on top of it.
  assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr, out.stderr[-3000:]


def _one_line(out) -> str:
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("tunixlike.train: error: "), out.stderr[-3000:]
  return lines[0].removeprefix("tunixlike.train: error: ")


@pytest.mark.parametrize("args,expected", [
    (["--config.seed=99999999999999999999"], "seed=99999999999999999999: must be in [0, 2**32)"),
    (["--config.seed=-1"], "seed=-1: must be in [0, 2**32)"),
    (["--config.data.shuffle_seed=-1"], "data.shuffle_seed=-1: must be in [0, 2**32)"),
    (["--config.algo.reward_clip=(1.0, -1.0)"], "algo.reward_clip=(1.0, -1.0): must be two finite numbers"),
    (["--config.rl.agent_host="], "rl.agent_host='': must be an address to listen on"),
    # An optional key set to None from the command line reaches the config as None (here data.task,
    # which then needs data.train), in each spelling the docs and users write.
    (["--config.data.task=None"], "data.task=None: needs a dataset instead"),
    (["--config.data.task=none"], "data.task=None: needs a dataset instead"),
    (["--config.data.task=null"], "data.task=None: needs a dataset instead"),
    (["--config.data.task="], "data.task=None: needs a dataset instead"),
])
def test_values_out_of_range_are_named_before_the_run(args, expected):
  line = _one_line(train("--config", "configs/addition_grpo.py", *args, "--check_only"))
  assert line.startswith(expected), line


def test_a_reward_weight_that_is_not_finite_is_named(tmp_path):
  path = tmp_path / "nan_weight.py"
  path.write_text("from tunixlike import config\n\ndef get_config(arg=None):\n  c = config.default_config_dict()\n"
                  "  c.rewards = ({'fn': 'exact_match', 'weight': float('nan')},)\n  return c\n")
  line = _one_line(train("--config", str(path), "--check_only"))
  assert line == "rewards=({'fn': 'exact_match', 'weight': nan},): item 0: weight=nan must be a finite number", line


def test_an_attention_kernel_of_another_backend_is_refused_when_the_run_starts(tmp_path):
  import jax  # noqa: PLC0415 (the backend this test's runs get: the same as the subprocess's)
  if jax.default_backend() == "gpu":
    pytest.skip("cudnn runs here")
  line = _one_line(train(*TINY, "--config.model.attention=cudnn", f"--workdir={tmp_path / 'run'}"))
  assert line == (f"model.attention='cudnn' runs on GPU only and this run's JAX backend is {jax.default_backend()}: "
                  "use 'auto' (the fastest correct kernel on any backend) or 'blockwise'")


def test_a_model_too_large_for_memory_is_refused_before_allocating(tmp_path):
  out = train(*TINY, "--config.model.hidden_size=1000000000", f"--workdir={tmp_path / 'run'}")
  line = _one_line(out)
  assert line.startswith("model.hidden_size=1000000000, ") and " parameters (" in line and "GiB of" in line, line


@pytest.mark.slow
def test_a_huge_finite_reward_is_clipped_not_fatal_and_the_eval_is_logged_once(tmp_path):
  (tmp_path / "huge.py").write_text("def huge(completions, **_):\n  return [3e38 if i % 8 < 3 else 0.0 for i in "
                                    "range(len(completions))]\n")
  out = train(*TINY, "--config.rl.num_steps=2", f"--config.rewards=({{'fn': '{tmp_path}/huge.py:huge'}},)",
              f"--workdir={tmp_path / 'run'}")
  assert out.returncode == 0, out.stderr[-3000:]
  records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r for r in records if "loss" in r]
  assert len(steps) == 2 and all(r["nonfinite_in_a_row"] == 0 and r["reward/clipped"] > 0 for r in steps)
  assert all(abs(r["reward/mean"]) <= 1e4 for r in steps)
  assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]
