"""`python -m tunixlike.eval` on a real checkpoint: train a tiny run, evaluate it, check the JSON."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
# A short run: 10 warm-start steps (so the weights differ from a fresh init), 1 RL step of 4
# prompts, 16 held-out prompts.
TINY = ["--config", "configs/addition_grpo.py:size=tiny", "--config.rl.num_steps=1", "--config.warm_start.max_steps=10",
        "--config.rl.prompts_per_step=4", "--config.sampler.max_concurrent_decodes=32",
        "--config.data.num_eval_examples=16", "--config.log.progress_bar=false", "--config.log.tensorboard=false"]


def run(module, *args, timeout=300):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                        timeout=timeout)


def one_error_line(out, expected):
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr[-2000:]
  assert lines[0].startswith("tunixlike.eval: error:") and expected in lines[0], lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  out = run("tunixlike.train", *TINY, f"--workdir={workdir}")
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir


@pytest.mark.slow
def test_eval_restores_the_checkpoint_and_reports_accuracy_and_pass_at_k(trained):
  result_path = trained / "eval.json"
  out = run("tunixlike.eval", *TINY, "--checkpoint", str(trained), "--samples=4", "--temperature=1.0",
            f"--out={result_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout)
  saved = json.loads(result_path.read_text())
  assert {k: v for k, v in saved.items() if k != "examples"} == result and len(saved["examples"]) == 16
  assert result["step"] == result["policy_version"] == 1 and result["split"] == "test"
  assert result["num_prompts"] == 16 and result["samples"] == 4
  assert 0.0 <= result["accuracy"] <= 1.0
  assert 0.0 <= result["sampled_accuracy"] <= result["pass@4"] <= 1.0
  # The restored weights are the trained ones: greedy decoding of the same 16 held-out prompts gives
  # what the trainer measured right after saving that checkpoint (a fresh random model would not
  # stop after the same number of tokens).
  final_eval = [json.loads(l) for l in open(trained / "metrics.jsonl") if "eval/accuracy" in l][-1]
  assert final_eval["step"] == 1
  assert result["accuracy"] == final_eval["eval/accuracy"]
  assert result["mean_completion_tokens"] == final_eval["eval/mean_completion_tokens"]


@pytest.mark.slow
def test_best_evaluates_the_checkpoint_with_the_best_held_out_accuracy(trained):
  evals = {r["step"]: r["eval/accuracy"] for r in map(json.loads, open(trained / "metrics.jsonl")) if "eval/accuracy" in r}
  assert set(evals) == {0, 1}  # the run's evals before and after its one RL step, both checkpointed
  best = max(evals.items(), key=lambda item: (item[1], item[0]))[0]  # the newest of equal ones, as orbax keeps
  out = run("tunixlike.eval", "--checkpoint", str(trained), "--best", "--num_examples=16", timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout)
  assert result["step"] == best and result["accuracy"] == evals[best]
  one_error_line(run("tunixlike.eval", "--checkpoint", str(trained), "--best", "--step=0", timeout=60),
                 "--best and --step name two checkpoints")


@pytest.mark.slow
def test_a_missing_step_is_one_clear_line(trained):
  out = run("tunixlike.eval", "--checkpoint", str(trained), "--step=7", timeout=60)
  one_error_line(out, "no complete checkpoint at step 7")


def test_help_explains_every_flag():
  out = run("tunixlike.eval", "--help", timeout=60)
  assert out.returncode == 0, out.stderr
  for flag in ("--config", "--checkpoint", "--step", "--[no]best", "--split", "--num_examples", "--samples", "--temperature",
               "--out", "pass@"):
    assert flag in out.stdout, flag


@pytest.mark.parametrize("args,expected", [
    (["--config", "configs/addition_grpo.py"], "--checkpoint is required"),
    (["--config", "configs/addition_grpo.py", "--checkpoint", "/nonexistent/run"], "/nonexistent/run: no such"),
    (["--config", "configs/addition_grpo.py", "--config.rl.bogus=1", "--checkpoint", "/tmp"],
     "unknown config key 'rl.bogus' in --config.rl.bogus=1"),
    (["--config", "configs/addition_grpo.py", "--config.rl.num_steps=-3", "--checkpoint", "/tmp"],
     "rl.num_steps=-3: must be >= 0"),
    (["--config", "configs/addition_grpo.py", "--split=dev", "--checkpoint", "/tmp"], "--split"),
])
def test_bad_input_is_one_line_and_status_2(args, expected):
  one_error_line(run("tunixlike.eval", *args, timeout=60), expected)


def test_an_empty_checkpoint_directory_is_one_clear_line(tmp_path):
  (tmp_path / "checkpoints").mkdir()  # a workdir whose run never saved
  one_error_line(run("tunixlike.eval", "--checkpoint", str(tmp_path), timeout=60),
                 f"{tmp_path / 'checkpoints'}: no complete checkpoint found")
