"""The supervised stage: its examples (answer columns, chat assistant turns), that it learns, and that
it runs on a user's own data from the config, from `tunixlike.train` and alone (rl.num_steps=0)."""

import json
import os
import pathlib

import numpy as np
import pytest

import tunixlike
from tunixlike import config as config_lib
from tunixlike.data import char_tokenizer, tokenizer as tokenizer_lib
from tunixlike.rl import build, warm_start as warm_start_lib

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TINY = str(CONFIGS / "addition_grpo.py") + ":size=tiny"
# A chat template in the character tokenizer's alphabet; an assistant turn ends with eos (its end of turn).
CHAT = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if m['role'] == 'assistant' %}"
        "{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def _chat_tokenizer():
  base = char_tokenizer.build()
  return tokenizer_lib.Tokenizer(base.hf, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                                 chat_template=CHAT)


def test_an_answer_row_trains_on_the_answer_and_eos_only():
  tok = char_tokenizer.build()
  prompt = tok.encode("1+2=")
  fmt = warm_start_lib.ExampleFormat(answer_field="sum")
  tokens, mask, truncated = warm_start_lib.encode([{"prompt_token_ids": prompt, "sum": 3}], tok, 10, fmt)
  ids = prompt + tok.encode("3", add_special_tokens=False) + [tok.eos_id]
  assert tokens[0, :len(ids)].tolist() == ids and (tokens[0, len(ids):] == tok.pad_id).all()
  # Position t predicts token t+1: the last prompt token predicts "3", "3" predicts eos.
  assert mask[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0] and truncated == 0
  # Too long: cut at the length and counted.
  tokens, mask, truncated = warm_start_lib.encode([{"prompt_token_ids": prompt, "sum": 3}], tok, 5, fmt)
  assert truncated == 1 and mask[0].tolist() == [0, 0, 0, 0, 0]  # the answer token is the last one: nothing predicts past it
  with pytest.raises(warm_start_lib.ExampleError, match="row 'r7' has no column 'sum'.*'other'"):
    warm_start_lib.encode([{"id": "r7", "prompt_token_ids": prompt, "other": 1}], tok, 10, fmt)


def test_chat_messages_train_on_every_assistant_turn_and_nothing_else():
  tok = _chat_tokenizer()
  messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
              {"role": "user", "content": "and 2+2="}, {"role": "assistant", "content": "4"}]
  tokens, targets = warm_start_lib.chat_example(messages, tok, system="Add.")
  full = tok.apply_chat_template([{"role": "system", "content": "Add."}] + messages, add_generation_prompt=False)
  assert tok.decode(tokens, skip_special_tokens=False) == full  # the whole conversation, as the template writes it
  trained = "".join(tok.decode([t], skip_special_tokens=False) for t, m in zip(tokens, targets) if m)
  assert trained == "3<eos>4<eos>"  # the assistant turns, each up to its end of turn
  with pytest.raises(warm_start_lib.ExampleError, match="no assistant turn"):
    warm_start_lib.chat_example(messages[:1], tok)


def test_rl_prompts_from_messages_leave_out_the_last_assistant_turn(tmp_path):
  from tunixlike.data import pipeline, sources
  tok = _chat_tokenizer()
  rows = [{"id": "a", "chat": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}]
  pipe_cfg = pipeline.PipelineConfig.from_config(config_lib.Config(), messages_field="chat", shuffle=False,
                                                 num_epochs=1)
  pipe = pipeline.PromptPipeline(sources.ListSource(rows, "rows"), tok, pipe_cfg)
  assert next(iter(pipe))["prompt_text"] == "user: 1+2=\nassistant: "


def test_a_chat_rows_answer_is_its_last_assistant_turn_and_sizes_an_unset_token_limit():
  from tunixlike.data import tasks
  tok = _chat_tokenizer()

  def row(*turns):
    return {"chat": [{"role": role, "content": content} for role, content in turns]}

  two_turns = row(("user", "1+2="), ("assistant", "3"), ("user", "and 20+99="), ("assistant", "911"))
  fmt = warm_start_lib.ExampleFormat(messages_field="chat")
  assert warm_start_lib.answer_length(two_turns, tok, fmt) == 4  # the last turn, "911" and its end of turn
  assert warm_start_lib.answer_length(row(("user", "1+2=")), tok, fmt) is None  # no answer to learn or fit
  cfg = tunixlike.load_config(TINY, {"data.task": None, "data.train": "chat.jsonl", "data.messages_field": "chat",
                                     "sampler.max_new_tokens": None})
  task = tasks.DatasetTask([two_turns, row(("user", "1+1="), ("assistant", "2"))] * 5)
  assert build.sized_completions(cfg, tok, task) == (
      6, "sampler.max_new_tokens=6: the longest answer in the last assistant turns of data.messages_field 'chat' is "
         "4 tokens with its end, plus room (set sampler.max_new_tokens to choose)")
  with pytest.raises(ValueError, match=r"^sampler.max_new_tokens is not set and the data has no answer column"):
    build.sized_completions(cfg, tok, tasks.DatasetTask([row(("user", "1+2="))] * 10))


@pytest.mark.slow
def test_the_warm_start_learns_and_its_accuracy_is_the_rl_eval():
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  cfg = config_lib.replace(cfg, data=dict(digits=1, num_eval_examples=64), sampler=dict(max_concurrent_decodes=16),
                           warm_start=dict(max_steps=400, target_accuracy=0.3, eval_every=10))
  setup = build.build(cfg)
  evals = []
  summary = build.warm_start(setup, on_eval=evals.append)
  # 1-digit addition reaches 30% in 100-200 steps; where exactly depends on the machine.
  assert summary["warm_start/accuracy"] >= 0.3 and summary["warm_start/steps"] < 400
  assert evals[0]["warm_start/step"] == 0 and evals[-1]["warm_start/step"] == summary["warm_start/steps"]
  assert evals[-1]["warm_start/eval_loss"] < evals[0]["warm_start/eval_loss"]  # held-out loss fell
  rl = build.build_rl(setup)  # the RL stage's first eval measures the same weights the same way
  assert build.evaluate(setup, rl)["eval/accuracy"] == pytest.approx(summary["warm_start/accuracy"], abs=1e-9)


def _rows(n=120):
  return [{"question": f"{a}+{b}=", "total": str(a + b)[::-1]} for a in range(1, 12) for b in range(1, 12)][:n]


def _reversed_sum(completions, total):
  return [float(c.strip() == t) for c, t in zip(completions, total)]


@pytest.mark.slow
def test_sft_alone_on_rows_from_python_then_rl_continues_from_it(tmp_path):
  overrides = {"data.task": None, "data.prompt_field": "question", "data.answer_field": "total",
               "warm_start.max_steps": 6, "warm_start.eval_every": 3, "warm_start.batch_size": 8,
               "warm_start.target_accuracy": 1.0, "rl.num_steps": 0, "rl.prompts_per_step": 4,
               "data.num_eval_examples": 8, "log.progress_bar": False, "log.tensorboard": False}
  cfg = tunixlike.load_config(TINY, overrides)  # data.task=None: the rows come from train(dataset=...)
  workdir = str(tmp_path / "run")
  summary = tunixlike.train(cfg, workdir, dataset=_rows(), rewards=[_reversed_sum])
  assert os.path.basename(summary["checkpoint"]) == "0"
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in records if "warm_start/step" in r]
  assert [r["warm_start/step"] for r in evals] == [0, 3, 6]
  assert all(np.isfinite(r["warm_start/eval_loss"]) and 0 <= r["warm_start/accuracy"] <= 1 for r in evals)
  assert evals[-1]["warm_start/eval_loss"] < evals[0]["warm_start/eval_loss"]
  assert not any("loss" in r for r in records)  # no RL step
  # The same workdir with RL steps: resumes from the supervised checkpoint (nothing redone).
  cfg = tunixlike.load_config(cfg, {"rl.num_steps": 1})
  summary = tunixlike.train(cfg, workdir, dataset=_rows(), rewards=[_reversed_sum])
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in records if "loss" in r] == [0]
  assert len([r for r in records if "warm_start/steps" in r]) == 1


@pytest.mark.slow
def test_answers_cut_at_the_token_limit_are_counted_and_warned_with_the_limit_that_fits(tmp_path, capsys):
  """2-digit answers (2 tokens and the end) cannot fit in sampler.max_new_tokens=2."""
  overrides = {"data.task": None, "data.prompt_field": "question", "data.answer_field": "total",
               "sampler.max_new_tokens": 2, "warm_start.max_steps": 2, "warm_start.eval_every": 2,
               "warm_start.batch_size": 8, "warm_start.target_accuracy": 1.0, "rl.num_steps": 0,
               "data.num_eval_examples": 8, "log.progress_bar": False, "log.tensorboard": False}
  workdir = str(tmp_path / "run")
  tunixlike.train(tunixlike.load_config(TINY, overrides), workdir, dataset=_rows(), rewards=[_reversed_sum])
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in records if "warm_start/step" in r]
  assert all(r["warm_start/truncated"] > 0.05 and r["warm_start/rows_cut"] >= 0 for r in evals)
  assert [r["eval/truncated"] for r in records if "eval/truncated" in r] == [evals[-1]["warm_start/truncated"]]
  warnings = [line for line in capsys.readouterr().out.splitlines() if "hit sampler.max_new_tokens" in line]
  assert len(warnings) == 1, warnings  # once per run
  assert warnings[0].startswith("warning: ") and "of the held-out answers at step 0 hit" in warnings[0]
  assert "the data's longest answer is 3 tokens with its end: set sampler.max_new_tokens=5" in warnings[0]
