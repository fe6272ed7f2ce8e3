"""Bring your own task: a user dataset, user reward functions and the public API, end to end."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import tunixlike
from tunixlike import checkpoint as ckpt_lib
from tunixlike.rl import build as build_lib
from tunixlike.rl.trainer import SetupError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "addition_grpo.py:size=tiny")
FAST = {"rl.num_steps": 2, "rl.prompts_per_step": 4, "warm_start.max_steps": 0, "data.num_eval_examples": 8,
        "log.progress_bar": False, "log.tensorboard": False}


def _rows(n=120):
  return [{"question": f"{a}+{b}=", "total": a + b, "level": "easy"} for a in range(1, 12) for b in range(1, 12)][:n]


def _metrics(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def test_python_api_trains_on_rows_in_memory_with_async_and_none_rewards(tmp_path):
  calls = []

  async def correct(completions, total):  # names only the columns it wants
    calls.append(len(completions))
    return [float(c.strip().startswith(str(t)[::-1])) for c, t in zip(completions, total)]

  def only_some(completions, prompt_ids, level):  # None: does not apply to this completion (skipped)
    return [None if i % 2 else 0.5 for i in range(len(completions))]

  cfg = tunixlike.load_config(TINY, {**FAST, "data.prompt_field": "question", "log.completions_every": 1,
                                     "log.completions_groups": 2})
  summary = tunixlike.train(cfg, str(tmp_path / "run"), dataset=_rows(),
                            rewards=[correct, dict(fn=only_some, weight=0.5)])
  assert 0.0 <= summary["eval/accuracy_before"] <= 1.0 and 0.0 <= summary["eval/accuracy_after"] <= 1.0
  assert calls, "the async reward was never called"
  steps = [m for m in _metrics(tmp_path / "run") if "rewards/correct" in m and "eval/accuracy" not in m]
  assert len(steps) == 2
  for m in steps:
    assert m["rewards/only_some/skipped"] > 0 and m["rewards/only_some"] == 0.5
    assert m["rewards/correct/failures"] == 0
    assert 0.0 <= m["frac_reward_zero_std"] <= 1.0 and 0 <= m["groups/all_zero_reward"] <= 4
  # Completions to look at: every step (log.completions_every=1), 2 groups of 8.
  rows = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
  assert [r["step"] for r in rows] == [0] * 16 + [1] * 16
  assert all(set(r["rewards"]) == {"correct", "only_some"} and r["finish_reason"] in ("eos", "length") for r in rows)
  assert all(r["prompt"].endswith("=") and r["versions"][0] <= r["step"] for r in rows)
  # The checkpoint's saved config says what was trained on: in-memory rows, the functions' import paths.
  with ckpt_lib.Checkpointer(ckpt_lib.workdir_checkpoints(tmp_path / "run"), read_only=True) as ck:
    saved = ck.read_meta(ck.latest_step())["config"]
  assert saved["data"]["train"] == "<in memory: 120 rows>"
  assert [t["fn"] for t in saved["rewards"]] == ["<in memory: test_python_api_trains_on_rows_in_memory_with_async_and_"
                                                 "none_rewards.<locals>.correct>", "<in memory: test_python_api_trains_on_"
                                                 "rows_in_memory_with_async_and_none_rewards.<locals>.only_some>"]
  assert [t["weight"] for t in saved["rewards"]] == [1.0, 0.5]
  from tunixlike import eval as eval_lib
  with pytest.raises(eval_lib.EvalError, match=r"trained on objects given to tunixlike.train in memory \(data.train="
                     r"'<in memory: 120 rows>', rewards\[0\].fn=.*pass --config"):
    eval_lib.evaluate_checkpoint(None, str(tmp_path / "run"))


def test_cli_trains_on_a_user_dataset_file_and_reward_module_from_another_directory(tmp_path):
  task = tmp_path / "my_task"
  task.mkdir()
  with open(task / "train.jsonl", "w") as f:
    for r in _rows():
      f.write(json.dumps(r) + "\n")
  (task / "my_rewards.py").write_text(textwrap.dedent('''
      def reversed_sum(completions, total):
        return [float(c.strip().startswith(str(t)[::-1])) for c, t in zip(completions, total)]
  '''))
  (task / "config.py").write_text(textwrap.dedent(f'''
      from tunixlike import config

      def get_config(arg=None):
        c = config.load({TINY.split(":")[0]!r}, "size=tiny")
        c.data.task = None
        c.data.train = "./train.jsonl"  # beside this file
        c.data.prompt_field = "question"
        c.rewards = [dict(fn="./my_rewards.py:reversed_sum", weight=1.0), dict(fn="stopped", weight=0.1)]
        c.warm_start.max_steps = 0
        c.rl.num_steps = 2
        c.rl.prompts_per_step = 4
        c.data.num_eval_examples = 8
        c.log.progress_bar = False
        return c
  '''))
  env = {**os.environ}
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config", str(task / "config.py"),
                        "--workdir", str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  steps = [m for m in _metrics(tmp_path / "run") if "rewards/reversed_sum" in m]
  assert len(steps) >= 2 and all(m["rewards/stopped/failures"] == 0 for m in steps)
  # The eval scores with the first reward: its columns reach the held-out prompts too.
  assert any("eval/accuracy" in m for m in _metrics(tmp_path / "run"))


# ---- bad input: one line naming the key and the file ---------------------------------------------
def _build(tmp_path, rows=None, rewards=None, **data):
  overrides = {**FAST, "data.task": None, "data.prompt_field": "question"}
  overrides.update({f"data.{k}": v for k, v in data.items()})
  if "data.train" not in overrides:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows if rows is not None else _rows())))
    overrides["data.train"] = str(path)
  if rewards is not None:
    overrides["rewards"] = tuple(rewards)
  return build_lib.build(tunixlike.load_config(TINY, overrides))


def test_rewards_that_do_not_load_or_do_not_fit_the_batch_are_named(tmp_path):
  (tmp_path / "r.py").write_text("def ok(completions, total):\n  return [0.0] * len(completions)\n"
                                 "def wants(completions, solution):\n  return [0.0] * len(completions)\n"
                                 "def one(completions):\n  return [1.0]\n"
                                 "def nothing(completions):\n  return None\n"
                                 "raise_at_import = None\n")
  (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
  cases = [
      ([dict(fn="no_such_module.x:fn")], r"rewards\[0\]\.fn='no_such_module.x:fn': importing no_such_module.x failed"),
      ([dict(fn=f"{tmp_path}/broken.py:fn")], r"rewards\[0\]\.fn=.*broken.py failed \(ModuleNotFoundError"),
      ([dict(fn=f"{tmp_path}/missing.py:fn")], r"rewards\[0\]\.fn=.*no such file"),
      ([dict(fn=f"{tmp_path}/r.py:nope")], r"rewards\[0\]\.fn=.*r.py has no 'nope'"),
      ([dict(fn=f"{tmp_path}/r.py:ok"), dict(fn=f"{tmp_path}/r.py:wants")],
       r"rewards\[1\]\.fn: wants\(completions, solution\) needs \['solution'\].*columns are \['level', 'question', 'total'\]"),
      ([dict(fn="not_registered")], r"rewards\[0\]\.fn='not_registered': not a registered name"),
      ([dict(fn=f"{tmp_path}/r.py:ok", kwargs={"scale": 2})], r"rewards\[0\]\.fn: kwargs \['scale'\] are not parameters"),
      ([dict(fn=f"{tmp_path}/r.py:ok"), dict(fn=f"{tmp_path}/r.py:one")],
       r"rewards\[1\]\.fn: one returned 1 scores for 2 completions: return one float \(or None\) per completion"),
      ([dict(fn=f"{tmp_path}/r.py:nothing")],
       r"rewards\[0\]\.fn: nothing returned None instead of a list of 2 scores: return one float \(or None\) per"),
  ]
  for rewards, expected in cases:
    with pytest.raises(ValueError, match=expected):
      _build(tmp_path, rewards=rewards)
  with pytest.raises(ValueError, match=r"rewards: a dataset without data.task needs reward functions"):
    _build(tmp_path)


def test_bad_datasets_are_named_with_file_and_line(tmp_path):
  ok = [dict(fn="stopped")]
  with pytest.raises(ValueError, match=r"train.jsonl:3: prompt_template '\{question\}' needs column\(s\) \['question'\]"):
    _build(tmp_path, rows=_rows(2) + [{"total": 1}], rewards=ok)
  # A prompt column the file does not have: named plainly, with the columns it does have.
  with pytest.raises(ValueError, match=r"^data.prompt_field='prompt': data.train='.*train.jsonl' has no such column; "
                     r"its columns are \['question', 'total', 'level'\]$"):
    _build(tmp_path, rewards=ok, prompt_field="prompt")
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(_rows(1)[0]) + "\n{not json\n" + "".join(json.dumps(r) + "\n" for r in _rows(40)))
  with pytest.raises(ValueError, match=r"data.train=.*bad.jsonl:2: invalid JSON.*data.skip_bad_lines"):
    _build(tmp_path, rewards=ok, train=str(bad))
  setup = _build(tmp_path, rewards=ok, train=str(bad), skip_bad_lines=True)
  assert setup.train_pipe.source.skipped == 1
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(ValueError, match=r"data.train=.*empty.jsonl.*no rows"):
    _build(tmp_path, rewards=ok, train=str(empty))
  with pytest.raises(ValueError, match=r"data.eval=.*empty.jsonl.*no rows"):
    _build(tmp_path, rewards=ok, eval=str(empty))
  with pytest.raises(ValueError, match=r"data.train=.*nothing\*.jsonl.*no data file matches"):
    _build(tmp_path, rewards=ok, train=str(tmp_path / "nothing*.jsonl"))


@pytest.mark.parametrize("prompt", [None, 12345, ["a list"]])
def test_a_prompt_that_is_not_text_is_named_by_its_line_or_skipped_and_counted(tmp_path, prompt):
  ok = [dict(fn="stopped")]
  rows = _rows(40) + [{"question": prompt, "total": 1, "level": "easy"}] + _rows(9)
  type_name = type(prompt).__name__
  with pytest.raises(ValueError, match=rf"train.jsonl:41: column 'question' is {type_name} .*, not text "
                                       r"\(fix the row, or set data.skip_bad_lines"):
    _build(tmp_path, rows=rows, rewards=ok)
  setup = _build(tmp_path, rows=rows, rewards=ok, skip_bad_lines=True)
  train_prompts = [r["question"] for r in setup.task.source("train", seed=0)]
  assert setup.train_pipe.num_bad_rows == int(prompt in train_prompts) and setup.train_pipe.num_filtered == 0
  assert setup.train_pipe.num_examples == len(train_prompts) - setup.train_pipe.num_bad_rows
  assert all(isinstance(r["prompt_text"], str) and r["question"] is not None for r in setup.eval_records)


def test_held_out_split_is_carved_from_train_and_globs_concatenate(tmp_path):
  rows = _rows()
  for i in range(2):
    (tmp_path / f"part{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[i * 60:(i + 1) * 60]))
  setup = _build(tmp_path, rewards=[dict(fn="stopped")], train=str(tmp_path / "part*.jsonl"))
  train = {r["question"] for r in setup.task.source("train", seed=0)}
  test = {r["question"] for r in setup.task.source("test", seed=0)}
  assert len(test) == 8 and len(train) == 112 and not train & test  # min(num_eval_examples, 10%) held out
  assert test == {r["question"] for r in setup.task.source("test", seed=0)}  # seeded: the same every time
  assert test != {r["question"] for r in setup.task.source("test", seed=1)}


def test_cli_bad_reward_path_is_one_line_and_status_2(tmp_path):
  env = {**os.environ}
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config", TINY,
                        f"--config.data.train={data}", "--config.data.prompt_field=question",
                        "--config.warm_start.max_steps=0", "--config.rewards=({'fn': 'nowhere.mod:f'},)",
                        "--workdir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
  assert "rewards[0].fn='nowhere.mod:f': importing nowhere.mod failed" in lines[-1]
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_an_environment_from_an_import_path_or_in_memory(tmp_path):
  (tmp_path / "my_env.py").write_text("from tunixlike.rewards.envs import CalculatorEnv\n\n"
                                      "class MyEnv(CalculatorEnv):\n  pass\n")
  cfg = tunixlike.load_config(TINY, {"rl.env": f"{tmp_path}/my_env.py:MyEnv"})
  make_env = build_lib.env_factory(cfg)
  assert make_env.__name__ == "MyEnv" and isinstance(make_env(), tunixlike.Env)
  assert build_lib.env_factory(tunixlike.load_config(TINY), env=make_env) is make_env
  assert build_lib.env_factory(tunixlike.load_config(TINY)) is None
  with pytest.raises(ValueError, match=r"rl.env='nowhere:Env': importing nowhere failed"):
    build_lib.env_factory(tunixlike.load_config(TINY, {"rl.env": "nowhere:Env"}))
  with pytest.raises(ValueError, match=r"rl.env='gym': must be 'calculator' or an import path"):
    tunixlike.load_config(TINY, {"rl.env": "gym"})


def test_a_process_reward_from_an_import_path(tmp_path):
  (tmp_path / "prm.py").write_text("def prm(prefix):\n  return float(len(prefix.token_ids))\n")
  steps = {"algo.step_delimiter": "", "algo.step_every_tokens": 1}
  setup = build_lib.build(tunixlike.load_config(TINY, {**FAST, **steps, "algo.process_reward": f"{tmp_path}/prm.py:prm"}))
  rl = build_lib.build_rl(setup)
  try:
    assert rl.scorer.process.fn.__name__ == "prm"
  finally:
    rl.close()
  with pytest.raises(ValueError, match=r"algo.process_reward='nowhere:prm': importing nowhere failed"):
    build_lib.build_rl(build_lib.build(tunixlike.load_config(TINY, {**FAST, **steps,
                                                                     "algo.process_reward": "nowhere:prm"})))


def test_the_data_may_come_from_python_and_must_come_from_somewhere(tmp_path):
  cfg = tunixlike.load_config(TINY, {**FAST, "data.task": None, "data.prompt_field": "question"})  # accepted
  with pytest.raises(ValueError, match=r"^data.task=None: needs a dataset instead: set data.train"):
    build_lib.build(cfg)
  assert build_lib.build(cfg, dataset=_rows(), rewards=[dict(fn="stopped")]).task.columns() == ("question", "total",
                                                                                                  "level")
  # The supervised stage needs the answers of your own data.
  with pytest.raises(tunixlike.ConfigError, match=r"warm_start.max_steps=5: .*set data.answer_field"):
    tunixlike.load_config(TINY, {"data.task": None, "data.train": "x.jsonl", "warm_start.max_steps": 5})
  with pytest.raises(ValueError, match=r"warm_start.max_steps=5: .*set data.answer_field"):
    build_lib.build(tunixlike.load_config(cfg, {"warm_start.max_steps": 5}), dataset=_rows())


# ---- sampler.max_new_tokens left unset: sized from the data's answers --------------------------------
def _worked(n=120):
  """Rows whose answer is worked out: "11+11=22" is 8 tokens, 9 with its end."""
  return [{**r, "solution": f"{r['question']}{r['total']}"} for r in _rows(n)]


def _solved(completions, solution):
  return [float(c.strip() == s) for c, s in zip(completions, solution)]


SIZED = ("sampler.max_new_tokens=11: the longest answer in data.answer_field 'solution' is 9 tokens with its end, "
         "plus room (set sampler.max_new_tokens to choose)")


def test_an_unset_token_limit_is_sized_from_the_answers_said_and_saved_and_a_resume_agrees(tmp_path, capsys):
  overrides = {**FAST, "data.task": None, "data.prompt_field": "question", "data.answer_field": "solution",
               "sampler.max_new_tokens": None, "rl.num_steps": 0}
  cfg = tunixlike.load_config(TINY, overrides)
  workdir = str(tmp_path / "run")
  tunixlike.train(cfg, workdir, dataset=_worked(), rewards=[_solved])
  assert SIZED in capsys.readouterr().out.splitlines()
  with ckpt_lib.Checkpointer(ckpt_lib.workdir_checkpoints(workdir), read_only=True) as ck:
    assert ck.read_meta(ck.latest_step())["config"]["sampler"]["max_new_tokens"] == 11
  # Again on the same workdir: sized alike, so the resume's config check finds nothing changed.
  tunixlike.train(cfg, workdir, dataset=_worked(), rewards=[_solved])
  assert "is finished" in capsys.readouterr().out


def test_data_without_answers_refuses_an_unset_token_limit(tmp_path):
  cfg = tunixlike.load_config(TINY, {**FAST, "data.task": None, "data.prompt_field": "question",
                                     "sampler.max_new_tokens": None})
  refusal = ("sampler.max_new_tokens is not set and the data has no answer column to size it from: set "
             "sampler.max_new_tokens (or data.answer_field)")
  with pytest.raises(ValueError) as e:  # the rows have 'total', no answer column
    build_lib.build(cfg, dataset=_rows(), rewards=[dict(fn="stopped")])
  assert str(e.value) == refusal
  with pytest.raises(SetupError) as e:
    tunixlike.train(cfg, str(tmp_path / "run"), dataset=_rows(), rewards=[dict(fn="stopped")])
  assert str(e.value) == refusal
  # The limit set, or an answer column named, and the same data builds.
  sized = build_lib.build(tunixlike.load_config(cfg, {"data.answer_field": "total"}), dataset=_rows(),
                          rewards=[dict(fn="stopped")])
  assert sized.cfg.sampler.max_new_tokens == 5  # "22" and its end, plus 2


@pytest.mark.slow
def test_a_reward_sees_the_completion_text_without_its_end_of_sequence_token(tmp_path):
  """What docs/own_data.md says of `completions`: decoded with the special tokens skipped, the
  end-of-sequence token counted in `completion_lengths` only."""
  from tunixlike.data import char_tokenizer
  seen = []

  def record(completions, finish_reasons, completion_lengths):
    seen.extend(zip(completions, finish_reasons, completion_lengths))
    return [0.0] * len(completions)

  # Random weights, 32 tokens each: some completions sample <eos> (and other special tokens).
  cfg = tunixlike.load_config(TINY, {**FAST, "data.prompt_field": "question", "rl.num_steps": 1,
                                     "sampler.max_new_tokens": 32})
  tunixlike.train(cfg, str(tmp_path / "run"), dataset=_rows(), rewards=[dict(fn=record)])
  tok = char_tokenizer.build()
  sampled = [s for s in seen if s[2] > 0]  # not the start-up check's empty completions
  assert any(finish == "eos" for _, finish, _ in sampled)
  for text, finish, length in sampled:
    assert not any(special in text for special in char_tokenizer.SPECIAL_TOKENS), text
    assert len(tok.encode(text, add_special_tokens=False)) <= length - (finish == "eos")


def test_the_page_loads_configs_as_the_readme_does_and_names_each_variant_with_its_file():
  """docs/own_data.md runs a config the README's way (the command, or tunixlike.load_config from
  Python), and a variant such as `:size=tiny` only with the file that defines it."""
  import re
  page = open(os.path.join(ROOT, "docs", "own_data.md"), encoding="utf-8").read()
  for other_way in ("config_lib.load(", "from_config_dict("):
    assert other_way not in page, other_way
  assert "python -m tunixlike.train --config path/to/config.py --workdir DIR" in page
  for prefix in re.findall(r"(\S*):size=", page):
    assert prefix.strip("`\"'").endswith(".py"), f"a variant without its config file: {prefix!r}:size="
  specs = re.findall(r"--config (\S+\.py(?::[\w=,]+)?)", page) + re.findall(r'load_config\("([^"]+)"', page)
  assert "examples/countdown/config.py:size=tiny" in specs
  for spec in specs:  # each names a file, and a variant that file defines
    if spec.startswith(("examples/", "configs/")):
      tunixlike.load_config(os.path.join(ROOT, spec))
