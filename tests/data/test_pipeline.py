import json

import numpy as np
import pytest

from tunixlike import config as config_lib
from tunixlike.data import pipeline, tasks, tokenizer
from tunixlike.data.pipeline import PipelineConfig


def pipe_config(**changes) -> PipelineConfig:
  """The pipeline settings of a run with the default data.* keys, plus `changes`."""
  return PipelineConfig.from_config(config_lib.Config(), **changes)


def _ids(it, n):
  return [next(it)["id"] for _ in range(n)]


def test_elements_are_tokenized_prompts(char_tok):
  p = pipeline.from_task(tasks.AdditionTask(), char_tok, size=8, config=pipe_config(seed=3))
  e = next(iter(p))
  assert e["prompt_text"] == e["prompt"]  # addition's template is "{prompt}", no chat template
  assert e["prompt_token_ids"].dtype == np.int32
  assert e["prompt_token_ids"].tolist() == char_tok.encode(e["prompt"])
  assert e["num_prompt_tokens"] == len(e["prompt"]) + 1  # chars + <bos>
  assert e["answer"] == tasks.AdditionTask().source("train", size=8, seed=3)[int(e["id"].split("/")[-1])]["answer"]
  assert e["epoch"] == 0


@pytest.mark.parametrize("num_threads", [0, 2])
def test_resume_from_state_gives_identical_following_elements(char_tok, num_threads):
  # Mid-epoch and across the epoch boundary (size 10): the resumed stream must match exactly.
  p = pipeline.from_task(tasks.AdditionTask(), char_tok, size=10,
                         config=pipe_config(seed=1, num_threads=num_threads))
  it = iter(p)
  _ids(it, 7)
  state = it.get_state()
  expected = [next(it) for _ in range(12)]
  resumed = iter(pipeline.from_task(tasks.AdditionTask(), char_tok, size=10,
                                    config=pipe_config(seed=1, num_threads=num_threads)))
  resumed.set_state(json.loads(json.dumps(state)))  # The state survives a JSON round trip (checkpoints).
  got = [next(resumed) for _ in range(12)]
  assert [e["id"] for e in got] == [e["id"] for e in expected]
  assert all(np.array_equal(a["prompt_token_ids"], b["prompt_token_ids"]) for a, b in zip(got, expected))
  assert [e["epoch"] for e in got] == [0, 0, 0] + [1] * 9


def test_shuffle_is_seeded_and_each_epoch_is_a_permutation(char_tok):
  def epochs(seed):
    it = iter(pipeline.from_task(tasks.AdditionTask(), char_tok, size=20, config=pipe_config(seed=seed)))
    return _ids(it, 20), _ids(it, 20)
  e0, e1 = epochs(5)
  assert epochs(5) == (e0, e1)
  assert epochs(6)[0] != e0
  assert sorted(e0) == sorted(e1) and len(set(e0)) == 20 and e0 != e1
  unshuffled = pipeline.from_task(tasks.AdditionTask(), char_tok, size=5, config=pipe_config(shuffle=False,
                                                                                            num_epochs=1))
  assert [e["id"] for e in unshuffled] == [f"addition/train/0/{i}" for i in range(5)]


def test_shards_are_disjoint_equal_and_cover_the_data(char_tok):
  def shard(i):
    cfg = pipe_config(seed=2, shard_index=i, shard_count=3, num_epochs=2)
    return [e["id"] for e in pipeline.from_task(tasks.AdditionTask(), char_tok, size=31, config=cfg)]
  shards = [shard(i) for i in range(3)]
  assert [len(s) for s in shards] == [20, 20, 20]  # 31 -> 30 usable, 10 per shard per epoch
  for epoch in range(2):
    parts = [set(s[epoch * 10 : (epoch + 1) * 10]) for s in shards]
    assert sum(len(p) for p in parts) == 30 and len(set().union(*parts)) == 30


def test_resharded_reads_the_rows_another_shard_reads_without_filtering_again(char_tok, tmp_path):
  rows = [{"prompt": "x" * n, "answer": "a"} for n in (3, 10, 4, 12, 5, 2, 9)]
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  whole = pipeline.from_file(str(path), char_tok, config=pipe_config(max_prompt_tokens=6, seed=4, num_epochs=1))
  for i in range(2):
    fresh = pipeline.from_file(str(path), char_tok, config=pipe_config(max_prompt_tokens=6, seed=4, num_epochs=1,
                                                                       shard_index=i, shard_count=2))
    shard = whole.resharded(shard_index=i, shard_count=2)
    assert [e["id"] for e in shard] == [e["id"] for e in fresh] and len(list(shard)) == 2  # 4 kept over 2 shards
    assert shard.num_filtered == fresh.num_filtered == 3 and shard.num_examples == fresh.num_examples
  assert [e["id"] for e in whole] == [e["id"] for e in whole.resharded()]  # the original is unchanged
  with pytest.raises(ValueError, match=r"not \['max_prompt_tokens'\]"):
    whole.resharded(max_prompt_tokens=20)


def test_long_prompts_are_filtered_and_counted(char_tok, tmp_path):
  rows = [{"prompt": "x" * n, "answer": "a"} for n in (3, 10, 4, 12, 5)]
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  p = pipeline.from_file(str(path), char_tok, config=pipe_config(max_prompt_tokens=6, num_epochs=1,
                                                                     shuffle=False))
  assert p.num_filtered == 2  # 10 and 12 chars (+ <bos>) exceed 6 tokens
  out = list(p)
  assert [e["prompt"] for e in out] == ["xxx", "xxxx", "xxxxx"]
  assert [e["id"] for e in out] == [f"{path}#0", f"{path}#2", f"{path}#4"]  # stable ids: row index in the file
  assert max(e["num_prompt_tokens"] for e in out) <= 6
  with pytest.raises(ValueError, match=r"0 prompts left after dropping 5 .*max_prompt_tokens=2"):
    pipeline.from_file(str(path), char_tok, config=pipe_config(max_prompt_tokens=2))


def test_prompt_template_and_chat_template(char_tok, tmp_path, gsm8k_dir):
  p = pipeline.from_task(tasks.get("gsm8k", path=gsm8k_dir), char_tok, split="test", size=3,
                         config=pipe_config(shuffle=False, max_prompt_tokens=None))
  e = next(iter(p))
  assert e["prompt_text"] == tasks.GSM8K_TEMPLATE.format(prompt=e["prompt"])
  assert e["answer"] == "18"
  tok = tokenizer.Tokenizer(char_tok.hf, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                            chat_template="{{ bos_token }}{% for m in messages %}U:{{ m['content'] }}\n{% endfor %}"
                                          "{% if add_generation_prompt %}A:{% endif %}")
  cfg = pipe_config(prompt_template="Q {prompt} ({answer})", shuffle=False)
  e = next(iter(pipeline.from_task(tasks.AdditionTask(), tok, size=2, config=cfg)))
  assert e["prompt_text"] == f"<bos>U:Q {e['prompt']} ({e['answer']})\nA:"
  # The template already holds <bos>: exactly one <bos> in the tokens.
  assert e["prompt_token_ids"].tolist().count(tok.bos_id) == 1
  assert e["prompt_token_ids"][0] == tok.bos_id
  e = next(iter(pipeline.from_task(tasks.AdditionTask(), tok, size=2,
                                   config=pipe_config(use_chat_template=False, shuffle=False))))
  assert e["prompt_text"] == e["prompt"]


def test_build_entry_point(char_tok):
  p = pipeline.build("reverse", char_tok, task_kwargs={"min_length": 2, "max_length": 2}, size=4,
                     config=pipe_config())
  assert len(next(iter(p))["prompt"]) == len("reverse ab=")
  assert p.num_examples == 4 and p.num_filtered == 0


def test_bad_config_and_columns(char_tok, tmp_path):
  with pytest.raises(ValueError, match="shard_index=3"):
    pipe_config(shard_index=3, shard_count=2)
  with pytest.raises(ValueError, match="prompt_template="):
    pipe_config(prompt_template="{unclosed")
  path = tmp_path / "d.jsonl"
  path.write_text('{"question": "q"}\n')
  with pytest.raises(ValueError, match=r"d.jsonl:1: prompt_template '\{prompt\}' needs column\(s\) \['prompt'\]"):
    pipeline.from_file(str(path), char_tok, config=pipe_config())
  # A later record lacking the column is named by its 1-based line (the blank line counts).
  path.write_text('{"prompt": "p"}\n\n{"question": "q"}\n')
  with pytest.raises(ValueError, match=r"d.jsonl:3: prompt_template '\{prompt\}' needs column\(s\) \['prompt'\]"):
    pipeline.from_file(str(path), char_tok, config=pipe_config())
  path.write_text("\n")
  with pytest.raises(ValueError, match="d.jsonl: the dataset is empty"):
    pipeline.from_file(str(path), char_tok, config=pipe_config())
