"""Built-in tasks: record sources with a prompt template and default reward functions.

Records are `{"id", "prompt", "answer", ...}`. Synthetic records are generated on demand from
(seed, split, index), so a task of any size costs no memory and every run sees the same data.
Held-out splits never overlap train: a problem belongs to "test" iff a stable hash of its text
falls below `test_fraction`, and each split only keeps the problems it owns.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import zlib
from typing import Any, ClassVar

import numpy as np

from tunixlike.data import sources

SPLITS = ("train", "test")
_MAX_DRAWS = 10_000


def split_of(problem: str, test_fraction: float) -> str:
  """The split that owns `problem` (stable across processes and Python versions: crc32)."""
  return "test" if zlib.crc32(problem.encode()) % 1_000_000 < test_fraction * 1_000_000 else "train"


class SyntheticSource(sources.RecordSource):
  """Record `i` of a split is the first draw from rng(seed, split, i) that belongs to that split."""

  def __init__(self, task: "SyntheticTask", split: str, size: int, seed: int):
    if split not in SPLITS:
      raise ValueError(f"split={split!r}, expected one of {SPLITS}")
    if size <= 0:
      raise ValueError(f"size={size} must be positive")
    self.task, self.split, self.size, self.seed = task, split, size, seed
    self.name = f"{task.name}/{split}"
    self.columns = ("id", "prompt", "answer")

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index):
    if not 0 <= index < self.size:
      raise IndexError(f"{self.name}: index {index} out of range ({self.size})")
    rng = np.random.default_rng([self.seed, SPLITS.index(self.split), int(index)])
    for _ in range(_MAX_DRAWS):
      prompt, answer = self.task.sample(rng)
      if split_of(prompt, self.task.test_fraction) == self.split:
        return {"id": f"{self.name}/{self.seed}/{index}", "prompt": prompt, "answer": answer}
    raise ValueError(f"{self.task}: no {self.split} problem in {_MAX_DRAWS} draws; raise the difficulty "
                     f"or change test_fraction={self.task.test_fraction}")


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """Base for generated tasks; subclasses define `sample(rng) -> (prompt, answer)`."""

  test_fraction: float = 0.1
  name: ClassVar[str]
  prompt_template: ClassVar[str] = "{prompt}"  # The prompt already says what to do.
  # data.train_size's cap: start-up formats and length-checks every row (~50 us apiece, a minute for a
  # million); the stream reshuffles every epoch, so more distinct generated rows teach no more.
  MAX_ROWS: ClassVar[int] = 1_000_000
  default_rewards: ClassVar[tuple[str, ...]] = ("exact_match",)

  def __post_init__(self):
    if not 0.0 < self.test_fraction < 1.0:
      raise ValueError(f"{type(self).__name__}.test_fraction={self.test_fraction} must be in (0, 1)")

  def sample(self, rng: np.random.Generator) -> tuple[str, str]:
    raise NotImplementedError

  def source(self, split: str = "train", *, size: int | None = None, seed: int) -> SyntheticSource:
    default = 50_000 if split == "train" else 500
    return SyntheticSource(self, split, size or default, seed)


@dataclasses.dataclass(frozen=True)
class AdditionTask(SyntheticTask):
  """`a+b=` with n-digit operands; the answer is written least-significant digit first.

  Reversed output lets a small causal model compute each digit from the carry it just wrote,
  which is why RL on it learns within minutes on a CPU: "123+456=" -> "975" (579 reversed).
  """

  digits: int = 3
  name: ClassVar[str] = "addition"

  def __post_init__(self):
    super().__post_init__()
    if not 1 <= self.digits <= 18:
      raise ValueError(f"AdditionTask.digits={self.digits} must be in [1, 18]")

  def sample(self, rng):
    low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
    a, b = (int(x) for x in rng.integers(low, 10**self.digits, size=2))
    return f"{a}+{b}=", str(a + b)[::-1]


@dataclasses.dataclass(frozen=True)
class ReverseTask(SyntheticTask):
  """`reverse abc=` -> `cba`; difficulty is the string length range and the alphabet size."""

  min_length: int = 3
  max_length: int = 8
  alphabet: str = "abcdefghijklmnopqrstuvwxyz"
  name: ClassVar[str] = "reverse"

  def __post_init__(self):
    super().__post_init__()
    if not 1 <= self.min_length <= self.max_length:
      raise ValueError(f"ReverseTask needs 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}")
    if len(set(self.alphabet)) < 2 or re.search(r"[\s=]", self.alphabet):
      raise ValueError(f"ReverseTask.alphabet={self.alphabet!r} needs >= 2 distinct non-space chars, no '='")

  def sample(self, rng):
    n = int(rng.integers(self.min_length, self.max_length + 1))
    s = "".join(self.alphabet[i] for i in rng.integers(0, len(self.alphabet), size=n))
    return f"reverse {s}=", s[::-1]


GSM8K_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer after \"####\"."


def gsm8k_final_answer(solution: str) -> str:
  """The gold number after '####' in a GSM8K solution, commas removed ("1,000" -> "1000")."""
  if "####" not in solution:
    raise ValueError(f"GSM8K solution has no '####' line: {solution[-80:]!r}")
  return solution.rsplit("####", 1)[1].strip().replace(",", "")


# openai/grade-school-math (MIT licence, in the same directory), shipped with the package.
GSM8K_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gsm8k")


@dataclasses.dataclass(frozen=True)
class Gsm8kTask:
  """GSM8K from `{path}/{split}.jsonl` (lines of {"question", "answer"}) as in openai/grade-school-math;
  `path` None: the copy shipped with the package."""

  path: str | None = None
  name: ClassVar[str] = "gsm8k"
  prompt_template: ClassVar[str] = GSM8K_TEMPLATE
  default_rewards: ClassVar[tuple[str, ...]] = ("gsm8k_accuracy", "answer_format")

  def __post_init__(self):
    if self.path is not None and not os.path.isdir(self.path):
      raise FileNotFoundError(f"Gsm8kTask.path={self.path!r} is not a directory with train.jsonl and test.jsonl")

  @property
  def directory(self) -> str:
    return self.path or GSM8K_DIR

  def source(self, split: str = "train", *, size: int | None = None, seed: int) -> sources.ListSource:
    """All problems of `split` (the first `size` if given); `seed` is unused (the file fixes the data)."""
    del seed
    path = os.path.join(self.directory, f"{split}.jsonl")
    raw = sources.read_jsonl(path, skip_bad_lines=False)  # GSM8K's own files: a bad line is a broken copy
    records = []
    for i, r in enumerate(raw.records[:size]):
      if "question" not in r or "answer" not in r:
        raise ValueError(f"{raw.where(i)}: lacks 'question' or 'answer' (has {sorted(r)})")
      try:
        answer = gsm8k_final_answer(r["answer"])
      except ValueError as e:
        raise ValueError(f"{raw.where(i)}: {e}") from None
      records.append({"id": f"gsm8k/{split}/{i}", "prompt": r["question"], "answer": answer,
                      "solution": r["answer"]})
    return sources.ListSource(records, path, raw.lines[:len(records)])


def as_source(data: Any, *, key: str, skip_bad_lines: bool) -> sources.RecordSource:
  """A record source from a path or glob (`sources.open_path`), a `RecordSource`, or an in-memory
  sequence of dicts (a list, a `grain.MapDataset`); `key` names it in errors. No rows is an error."""
  if isinstance(data, (str, os.PathLike)):
    try:
      source = sources.open_path(os.fspath(data), skip_bad_lines=skip_bad_lines)
    except (OSError, ValueError) as e:
      raise ValueError(f"{key}={os.fspath(data)!r}: {e}") from None
  elif isinstance(data, sources.RecordSource):
    source = data
  else:
    try:
      records = [dict(r) for r in data]
    except (TypeError, ValueError) as e:
      raise ValueError(f"{key}: expected a path, a RecordSource or a sequence of dicts ({type(e).__name__}: {e})"
                       ) from None
    source = sources.ListSource(records, key)
  if len(source) == 0:
    raise ValueError(f"{key}={getattr(source, 'name', data)!r}: the dataset has no rows"
                     + (f" ({source.skipped} bad lines skipped)" if getattr(source, "skipped", 0) else ""))
  return source


@dataclasses.dataclass(frozen=True)
class DatasetTask:
  """The user's own dataset: prompts from a column (or chat messages), every column passed to the rewards.

  `train` and `eval`: what `as_source` takes. Without `eval`, a held-out split of
  min(`holdout`, 10% of train) rows, chosen by the seed, is carved from train, which keeps the rest.
  The rewards come from the config (`rewards`), else `default_rewards`.
  """

  train: Any
  eval: Any = None
  prompt_field: str = "prompt"
  holdout: int = 500
  skip_bad_lines: bool = False
  default_rewards: tuple = ()  # used when the config names no `rewards` (a preset's, e.g. exact_match)
  name: ClassVar[str] = "dataset"

  @property
  def prompt_template(self) -> str:
    return "{" + self.prompt_field + "}"

  def columns(self) -> tuple[str, ...]:
    """The columns of the training data (what reward functions can name)."""
    return tuple(self._train.columns)

  # Each file is read once, however many splits and checks ask for it.
  @functools.cached_property
  def _train(self) -> sources.RecordSource:
    return as_source(self.train, key="data.train", skip_bad_lines=self.skip_bad_lines)

  @functools.cached_property
  def _eval(self) -> sources.RecordSource:
    return as_source(self.eval, key="data.eval", skip_bad_lines=self.skip_bad_lines)

  def data(self) -> dict[str, sources.RecordSource]:
    """The sources as given, by the key that names them: data.train and (when given) data.eval."""
    return {"data.train": self._train, **({"data.eval": self._eval} if self.eval is not None else {})}

  def source(self, split: str = "train", *, size: int | None = None, seed: int) -> sources.RecordSource:
    if split not in SPLITS:
      raise ValueError(f"split={split!r}, expected one of {SPLITS}")
    if split == "test" and self.eval is not None:
      source = self._eval
    else:
      train = self._train
      if len(train) < 2:
        raise ValueError(f"data.train={train.name!r}: {len(train)} row; carving a held-out split needs at least 2 "
                         "(or give data.eval)")
      n_test = max(1, min(self.holdout, len(train) // 10)) if self.eval is None else 0
      order = np.random.default_rng([seed, 7]).permutation(len(train))
      source = sources.Subset(train, order[:n_test] if split == "test" else np.sort(order[n_test:]))
    if size is not None and size < len(source):
      source = sources.Subset(source, np.arange(size))
    return source


TASKS: dict[str, Any] = {"addition": AdditionTask, "reverse": ReverseTask, "gsm8k": Gsm8kTask}


def get(name: str, **kwargs):
  """Builds a task by name, e.g. `get("addition", digits=4)`, `get("gsm8k")` or `get("gsm8k", path=...)`."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
  return TASKS[name](**kwargs)


def for_run(data, dataset=None, eval_dataset=None):
  """The run's task from its config's data section: the user's dataset (data.train, or rows given in
  memory as `dataset` / `eval_dataset`) with data.task's rewards as its default, else the built-in
  task data.task."""
  if data.train is not None or dataset is not None:
    preset = TASKS[data.task].default_rewards if data.task is not None else ()
    return DatasetTask(dataset if dataset is not None else data.train,
                       eval_dataset if eval_dataset is not None else data.eval,
                       prompt_field=data.prompt_field, holdout=data.num_eval_examples,
                       skip_bad_lines=data.skip_bad_lines, default_rewards=preset)
  if data.task is None:
    raise ValueError("data.task=None: needs a dataset instead: set data.train to a file, a glob or a directory "
                     "(or pass dataset= to tunixlike.train)")
  kwargs = {"digits": data.digits} if data.task == "addition" else {"path": data.path} if data.task == "gsm8k" else {}
  return get(data.task, **kwargs)


def reward_terms(configured, task, rewards=None) -> tuple:
  """The run's reward terms: `rewards` given in Python, else the config's (`configured`), else the task's own."""
  terms = tuple(rewards if rewards is not None else configured or task.default_rewards)
  if not terms:
    raise ValueError("rewards: a dataset without data.task needs reward functions: set rewards=[{fn, weight}] in "
                     "the config (or pass rewards=[...] to tunixlike.train)")
  return terms
