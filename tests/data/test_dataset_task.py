"""A user's dataset as a task: chat messages, in-memory rows (lists and grain datasets), held-out splits."""

import grain
import pytest

from tunixlike import config as config_lib
from tunixlike.data import pipeline, tasks, tokenizer
from tunixlike.data.pipeline import PipelineConfig


def pipe_config(**changes) -> PipelineConfig:
  """The pipeline settings of a run with the default data.* keys, plus `changes`."""
  return PipelineConfig.from_config(config_lib.Config(), **changes)


TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}A:{% endif %}")


def _chat_tok(char_tok):
  return tokenizer.Tokenizer(char_tok.hf, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                             chat_template=TEMPLATE)


def test_messages_are_rendered_with_the_chat_template_and_a_system_prompt(char_tok):
  rows = [{"messages": [{"role": "user", "content": f"{i}+1="}], "total": i + 1} for i in range(20)]
  task = tasks.DatasetTask(rows, prompt_field="unused")
  cfg = pipe_config(shuffle=False, messages_field="messages", system_prompt="add")
  e = next(iter(pipeline.PromptPipeline(task.source("train", seed=0), _chat_tok(char_tok), cfg)))
  assert e["prompt_text"].startswith("<bos>S:add\nU:") and e["prompt_text"].endswith("+1=\nA:")
  assert e["prompt_token_ids"].tolist().count(_chat_tok(char_tok).bos_id) == 1
  with pytest.raises(ValueError, match=r"data.messages_field='messages' needs a tokenizer with a chat template"):
    pipeline.PromptPipeline(task.source("train", seed=0), char_tok, cfg)
  bad = tasks.DatasetTask(rows[:10] + [{"messages": "hi", "total": 0}] + rows[10:])
  with pytest.raises(ValueError, match=r"column 'messages' \(data.messages_field\) must be a non-empty list"):
    pipeline.PromptPipeline(bad.source("train", seed=0), _chat_tok(char_tok), pipe_config(
        shuffle=False, messages_field="messages", max_prompt_tokens=64))


def test_rows_in_memory_from_a_list_or_a_grain_dataset(char_tok):
  rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)]
  for data in (rows, grain.MapDataset.source(rows)):
    task = tasks.DatasetTask(data)
    train, test = task.source("train", seed=3), task.source("test", seed=3)
    assert len(train) == 27 and len(test) == 3
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    first = task.source("train", size=5, seed=3)  # data.train_size: the first rows, the held-out split unchanged
    assert [r["prompt"] for r in first] == [r["prompt"] for r in train][:5]
    e = next(iter(pipeline.PromptPipeline(train, char_tok, pipe_config(shuffle=False))))
    assert e["prompt_text"] == e["prompt"] and "answer" in e
  with pytest.raises(ValueError, match=r"data.train: expected a path, a RecordSource or a sequence of dicts"):
    tasks.DatasetTask([1, 2, 3]).source("train", seed=0)
