import pytest

from tunixlike.data import tasks
from tunixlike import rewards


def test_addition_records_are_reversed_sums_and_deterministic():
  task = tasks.AdditionTask(digits=3)
  src = task.source("train", size=200, seed=7)
  for i in range(200):
    r = src[i]
    a, b = (int(x) for x in r["prompt"].rstrip("=").split("+"))
    assert 100 <= a < 1000 and 100 <= b < 1000
    assert r["answer"] == str(a + b)[::-1]
    assert r["id"] == f"addition/train/7/{i}"
  assert task.source("train", size=200, seed=7)[123] == src[123]
  assert task.source("train", size=200, seed=8)[123] != src[123]
  assert tasks.AdditionTask(digits=5).source("train", size=3, seed=0)[0]["prompt"].index("+") == 5
  assert task.default_rewards == ("exact_match",)


def test_addition_example_from_the_docstring():
  # "123+456=" -> 579 written least-significant digit first.
  assert rewards.get("exact_match")(["123+456="], ["975"], answer=["975"]) == [1.0]


@pytest.mark.parametrize("task", [tasks.AdditionTask(digits=2), tasks.AdditionTask(digits=1),
                                  tasks.ReverseTask(min_length=2, max_length=3, alphabet="abc")])
def test_test_split_never_overlaps_train(task):
  train = {task.source("train", size=2000, seed=0)[i]["prompt"] for i in range(2000)}
  test = {task.source("test", size=200, seed=0)[i]["prompt"] for i in range(200)}
  assert train and test and not train & test
  assert all(tasks.split_of(p, task.test_fraction) == "test" for p in test)


def test_reverse_task_difficulty():
  task = tasks.ReverseTask(min_length=4, max_length=6, alphabet="xyz")
  src = task.source("train", size=100, seed=0)
  lengths = set()
  for i in range(100):
    r = src[i]
    s = r["prompt"].removeprefix("reverse ").removesuffix("=")
    assert set(s) <= set("xyz") and r["answer"] == s[::-1]
    lengths.add(len(s))
  assert lengths == {4, 5, 6}


def test_task_validation():
  with pytest.raises(ValueError, match="digits=0"):
    tasks.AdditionTask(digits=0)
  with pytest.raises(ValueError, match="test_fraction=1.5"):
    tasks.AdditionTask(test_fraction=1.5)
  with pytest.raises(ValueError, match="min_length"):
    tasks.ReverseTask(min_length=5, max_length=2)
  with pytest.raises(ValueError, match="split='dev'"):
    tasks.AdditionTask().source("dev", seed=0)
  with pytest.raises(ValueError, match="unknown task 'nope'"):
    tasks.get("nope")
  with pytest.raises(FileNotFoundError, match="/no/such/dir"):
    tasks.get("gsm8k", path="/no/such/dir")


def test_gsm8k_records(gsm8k_dir):
  task = tasks.get("gsm8k", path=gsm8k_dir)
  test = task.source("test", seed=0)
  assert len(test) == 1319
  first = test[0]
  assert first["id"] == "gsm8k/test/0"
  assert first["answer"] == "18"  # Janet's ducks.
  assert first["prompt"].startswith("Janet")
  assert first["solution"].endswith("#### 18")
  assert len(task.source("train", size=5, seed=0)) == 5
  assert task.default_rewards == ("gsm8k_accuracy", "answer_format")
  assert tasks.gsm8k_final_answer("x\n#### 1,234") == "1234"


def test_gsm8k_bad_files(tmp_path):
  (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "no marker"}\n')
  with pytest.raises(ValueError, match=r"train.jsonl:1: .*'####'"):
    tasks.get("gsm8k", path=str(tmp_path)).source("train", seed=0)
  (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n\n{"q": 1}\n')
  with pytest.raises(ValueError, match=r"test.jsonl:3: lacks 'question'"):
    tasks.get("gsm8k", path=str(tmp_path)).source("test", seed=0)
