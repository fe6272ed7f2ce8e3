"""`--check_only` checks the run's inputs, not only the config tree: a user's data file, its columns, its
prompts' lengths and the reward functions, each mistake one line and status 2 (`tunixlike.preflight`).

Every run here has JAX_PLATFORMS set to a platform that does not exist: a check that started a JAX backend
would fail on it, so passing proves that none starts (and no model is built), which keeps these runs at
seconds each.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tunixlike import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "tunixlike.train: error: "
CALL_LIMIT_S = 120  # one check: ~2 s alone; a hang, not a slow machine, should fail it


def check(*args):
  env = {**os.environ, "JAX_PLATFORMS": "no_such_platform"}
  return subprocess.run([sys.executable, "-m", "tunixlike.train", *args, "--check_only"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=CALL_LIMIT_S)


def error_line(out) -> str:
  assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(PREFIX), out.stderr
  return lines[0].removeprefix(PREFIX)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  """A user's task as docs/own_data.md describes it: a JSONL file, a rewards file and a config beside them."""
  d = tmp_path_factory.mktemp("my_task")
  rows = [{"question": f"{a}+{b}=", "total": a + b, "level": "easy"} for a in range(1, 10) for b in range(1, 10)]
  (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (d / "long.jsonl").write_text("".join(json.dumps({**r, "question": r["question"] * 4}) + "\n" for r in rows[:5]))
  (d / "rewards.py").write_text(textwrap.dedent('''
      def reversed_sum(completions, total):
        return [float(c.strip() == str(t)[::-1]) for c, t in zip(completions, total)]

      def wants_solution(completions, solution):  # the data has no 'solution' column
        return [0.0] * len(completions)

      def one_score(completions):  # one score for the whole batch
        return [1.0]

      def not_finite(completions, **_):
        return [float("nan")] * len(completions)

      def text_total(completions, total):  # 'total' holds numbers, not text
        return [float(c.strip() == t.strip()) for c, t in zip(completions, total)]
  '''))
  (d / "config.py").write_text(textwrap.dedent('''
      from tunixlike import config

      def get_config(arg=None):
        variant = config.parse_arg(arg, reward="reversed_sum")
        c = config.default_config_dict()
        c.data.task = None
        c.data.train = "./train.jsonl"
        c.data.prompt_field = "question"
        c.data.answer_field = "total"
        c.data.max_prompt_length = 8  # "9+9=" is 5 tokens with <bos>
        c.sampler.max_prefill_length = 8
        c.rewards = [dict(fn="./rewards.py:" + variant.reward), dict(fn="stopped", weight=0.1)]
        return c
  '''))
  return d


def test_a_good_own_data_config_passes_and_says_what_it_checked(task):
  out = check("--config", str(task / "config.py"))
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == ("config OK; data.train: 81 rows read (first 8 checked); prompts 5 tokens "
                                "(data.max_prompt_length=8); rewards: reversed_sum=1, stopped=1 called on one row's "
                                "'total'; sampler.max_new_tokens=5: the longest answer in data.answer_field 'total' "
                                "is 3 tokens with its end, plus room (set sampler.max_new_tokens to choose); "
                                "optim.learning_rate=0.0002: the built-in model, trained from random weights (set "
                                "optim.learning_rate to choose); sampler.temperature=0.7: the built-in model: its "
                                "samples at 1.0 rarely end right after a supervised stage (set sampler.temperature to "
                                "choose); warm_start.max_steps=2000: the built-in model starts "
                                "from random weights: a supervised stage on 'total' until held-out accuracy reaches "
                                "warm_start.target_accuracy=0.2 (set warm_start.max_steps to choose)")


def test_the_countdown_example_passes_and_says_what_it_checked():
  out = check("--config", "examples/countdown/config.py")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == ("config OK; data.train: 1725 rows read (first 8 checked); data.eval: 200 rows read "
                                "(first 8 checked); prompts 12 to 13 tokens (data.max_prompt_length=24); rewards: "
                                "correct=1, well_formed=1 called on one row's 'solution'; sampler.max_new_tokens=20")


def test_data_without_answers_leaves_nothing_to_size_the_completions_from(task):
  line = error_line(check("--config", str(task / "config.py"), "--config.data.answer_field=None"))
  assert line == ("sampler.max_new_tokens is not set and the data has no answer column to size it from: set "
                  "sampler.max_new_tokens (or data.answer_field)")
  out = check("--config", str(task / "config.py"), "--config.data.answer_field=None",
              "--config.sampler.max_new_tokens=6", "--config.optim.learning_rate=1e-3",
              "--config.sampler.temperature=1.0")
  assert out.returncode == 0 and out.stdout.strip().endswith(
      "; sampler.max_new_tokens=6; warm_start.max_steps=0: no data.answer_field or data.messages_field to learn from "
      "(set warm_start.max_steps to choose)"), out.stderr


def test_a_prompt_column_the_data_does_not_have(task):
  line = error_line(check("--config", str(task / "config.py"), "--config.data.prompt_field=prompt"))
  assert line == (f"data.prompt_field='prompt': data.train has no such column ({task}/train.jsonl:1 has "
                  "['question', 'total', 'level'])")


def test_a_reward_file_that_does_not_exist(task):
  line = error_line(check("--config", str(task / "config.py"),
                          f"--config.rewards=({{'fn': '{task}/my_rewards.py:score'}},)"))
  assert line == f"rewards[0].fn='{task}/my_rewards.py:score': no such file {task}/my_rewards.py"


def test_a_reward_whose_signature_does_not_fit_the_columns(task):
  line = error_line(check("--config", f"{task}/config.py:reward=wants_solution"))
  assert line == ("rewards[0].fn: wants_solution(completions, solution) needs ['solution'], which the batch does not "
                  "have: the dataset's columns are ['level', 'question', 'total'], the rollout's fields ['prompts', "
                  "'completions', 'completion_lengths', 'finish_reasons', 'prompt_ids']")


@pytest.mark.parametrize("reward,expected", [
    ("one_score", "rewards[0].fn: one_score returned 1 scores for 2 completions: return one float (or None) per "
                  "completion"),
    ("not_finite", "rewards[0].fn: not_finite returned nan for the completion '2' of {task}/train.jsonl:1: return "
                   "a finite float (or None) per completion"),
    ("text_total", "rewards[0].fn: text_total raised AttributeError: 'int' object has no attribute 'strip' (called "
                   "on {task}/train.jsonl:1 with its 'total' '2' as the completion)"),
], ids=["too_few", "nan", "raises"])
def test_a_reward_that_does_not_return_one_finite_score_per_completion(task, reward, expected):
  line = error_line(check("--config", f"{task}/config.py:reward={reward}"))
  assert line == expected.format(task=task)


def test_prompts_longer_than_data_max_prompt_length(task):
  line = error_line(check("--config", str(task / "config.py"), f"--config.data.train={task}/long.jsonl"))
  assert line == (f"data.max_prompt_length=8: all 5 prompts checked in data.train are longer (the shortest, "
                  f"{task}/long.jsonl:1, has 17 tokens); the run drops longer prompts")


@pytest.mark.parametrize("flag,expected", [
    ("--config.warm_start.max_step=3",
     "unknown config key 'warm_start.max_step' in --config.warm_start.max_step=3 (did you mean 'max_steps'?)"),
    ("--config.rl.max_step=3", "unknown config key 'rl.max_step' in --config.rl.max_step=3"),  # nothing close in rl
], ids=["close_key", "no_close_key"])
def test_a_key_typo_names_the_flag_and_the_key_it_resembles(flag, expected):
  assert error_line(check("--config", "configs/addition_grpo.py", flag)) == expected


@pytest.mark.parametrize("flag,expected", [
    # each passed the check, then crashed or hung the run (issue 56, finding 6)
    ("--config.model.attention=pallas_tpu", "model.attention='pallas_tpu' runs on TPU only and JAX_PLATFORMS="
                                            "no_such_platform leaves it out: use 'auto'"),
    ("--config.model.attention=cudnn", "model.attention='cudnn' runs on GPU only and JAX_PLATFORMS=no_such_platform "
                                       "leaves it out: use 'auto'"),
    ("--config.optim.updates_per_batch=1000000000", "optim.updates_per_batch=1000000000: must be <= 64: each update "
                                                    "is a full pass over the batch"),
    ("--config.data.train_size=1000000000", "data.train_size=1000000000: data.task='addition' generates at most "
                                            "1,000,000 rows"),
    ("--config.algo.reward_clip=(nan,1)", "algo.reward_clip=(nan,1): must be 2 finite numbers, e.g. (-1.0, 1.0) "
                                          "(nan and inf are not numbers a run can use)"),
    ("--config.algo.reward_clip=(-3e38,3e38)", "algo.reward_clip=(-3e+38, 3e+38): must lie within +-1e+15: wider "
                                               "bounds let the squares and sums of rewards"),
], ids=["pallas_tpu", "cudnn", "updates_per_batch", "train_size", "nan_bound", "f32_bound"])
def test_values_that_passed_the_check_then_crashed_or_hung_are_refused_in_one_line(flag, expected):
  line = error_line(check("--config", "configs/addition_grpo.py", flag))
  assert line.startswith(expected), line


def test_a_backend_kernel_without_its_backend_installed_is_refused_without_starting_jax():
  if any(preflight._installed(m) for m in preflight.BACKEND_PLUGINS["tpu"]):
    pytest.skip("this machine's JAX has a TPU backend")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config", "configs/addition_grpo.py",
                        "--config.model.attention=pallas_tpu", "--check_only"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=CALL_LIMIT_S)
  assert error_line(out) == ("model.attention='pallas_tpu' runs on TPU only and this machine's JAX has no TPU "
                             "backend (libtpu is not installed): use 'auto' (the fastest correct kernel on any "
                             "backend)")


def test_an_agent_server_connection_limit_the_file_descriptors_cannot_hold_is_refused():
  import resource  # noqa: PLC0415
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft == resource.RLIM_INFINITY:
    pytest.skip("no file descriptor limit here")
  line = error_line(check("--config", "examples/calculator_agent/config.py",
                          f"--config.rl.agent_max_connections={soft}"))
  assert line.startswith(f"rl.agent_max_connections={soft}: the agent server's connections and listen backlog "
                         f"({soft + 128} file descriptors) must fit in half of this process's file descriptor "
                         f"limit (ulimit -n = {soft})"), line
