"""Checks a run's inputs before it starts: what `python -m tunixlike.train --check_only` adds to the
config's own checks, in seconds, with no JAX backend and no model.

  * the data files (data.train, data.eval; a built-in task's rows) read and parse, with the run's readers;
  * the columns the config names (data.prompt_field or data.messages_field, data.answer_field) are in the
    first rows, whose prompts format as the run formats them and fit data.max_prompt_length in the run's
    tokenizer;
  * each reward (`rewards`, else the task's own) loads, its parameters are columns the batch has, and one
    call on one row (its answer and an empty completion) returns one finite score (or None) per completion;
  * the sampler.max_new_tokens the run will use: the config's, or sized from the data's answers as the run
    sizes it (refused, as the run refuses it, when the data has none);
  * optim.learning_rate, sampler.temperature and warm_start.max_steps where the config leaves them None, as
    the run chooses them (`rl.starting_point`);
  * a model.attention kernel of one backend (cudnn, pallas_tpu) has that backend installed: its JAX plugin
    (libtpu, a CUDA plugin) and JAX_PLATFORMS allowing it. The run checks the backend itself once JAX starts;
  * with rl.agent, the agent server's rl.agent_max_connections fits in half this process's file descriptors;
  * multi_agent.env loads (a multi-agent run).

The run checks the same at start-up, but only after JAX has started and the model is built. A problem
raises `PreflightError`: one line naming the config key, the file and the line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import threading
from typing import Any

import numpy as np

from tunixlike.agents.connections import fd_budget_error
from tunixlike.config import Config
from tunixlike.data import char_tokenizer, pipeline, sources, tasks, tokenizer as tokenizer_lib
from tunixlike.models import attention
from tunixlike.rewards import CombinedReward
from tunixlike.multi_agent.env import env_factory
from tunixlike.rewards.loader import NOT_COLUMNS, LoadError
from tunixlike.rewards.safe import as_score
from tunixlike.rl import starting_point

ROWS = 8  # rows checked of each source: a misnamed column or an overlong template shows in the first
CALL_TIMEOUT_S = 10.0  # a slower reward (a remote grader) is left unchecked rather than waited for
# The modules that bring JAX a backend: without one of them installed, no process here can run its kernels.
BACKEND_PLUGINS = {"tpu": ("libtpu",), "gpu": ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12",
                                               "jax_plugins.xla_cuda13")}


class PreflightError(ValueError):
  """An input that would stop the run at start-up (or leave it without data): one line naming it."""


@dataclasses.dataclass(frozen=True)
class _Prompt:
  """A checked row as the run sees it: the record, where it is, its formatted prompt and its tokens."""

  record: dict[str, Any]
  where: str
  text: str
  tokens: int | None  # None: no tokenizer to count with


def check(cfg: Config) -> str:
  """Checks the run's data and rewards (see the module docstring); returns one line of what was checked."""
  try:
    task = tasks.for_run(cfg.data)
  except ValueError as e:
    raise PreflightError(str(e)) from None
  _check_attention(cfg.model.attention)
  too_many = cfg.rl.agent and fd_budget_error(cfg.rl.agent_max_connections)
  if too_many:
    raise PreflightError(too_many)
  tok, untokenized = _tokenizer(cfg)
  said, prompts = [], {}
  for key, source, read in _sources(cfg, task):
    n = min(ROWS, len(source))
    _check_columns(cfg, key, source, n)
    prompts[key] = _format(cfg, task, tok, source, n)
    said.append(read)
  said.append(untokenized or _check_lengths(cfg, prompts))
  key, train = next(iter(prompts.items()))  # data.train, or the built-in task's
  if not train:
    raise PreflightError(f"{key}: none of the first {ROWS} rows has a text prompt (data.skip_bad_lines skips them)")
  said.append(_check_rewards(cfg, task, tok, train[0]))
  said.append(_completion_limit(cfg, task, tok))
  if cfg.multi_agent.env is not None:
    try:
      env_factory(cfg)
    except LoadError as e:
      raise PreflightError(str(e)) from None
    said.append(f"multi_agent.env={cfg.multi_agent.env!r} loads")
  return "; ".join(said + starting_point.resolved(cfg)[1])


def _check_attention(impl: str) -> None:
  """A backend's own kernel on a machine whose JAX cannot load that backend, found without starting JAX."""
  needs = attention.BACKEND_ONLY.get(impl)
  if needs is None:
    return
  platforms = [p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms and not {needs, *(["cuda"] if needs == "gpu" else [])} & set(platforms):
    raise PreflightError(f"model.attention={impl!r} runs on {needs.upper()} only and JAX_PLATFORMS="
                         f"{','.join(platforms)} leaves it out: use 'auto' (the fastest correct kernel on any backend)")
  plugins = BACKEND_PLUGINS[needs]
  if not any(_installed(m) for m in plugins):
    missing = f"{plugins[0]} is not" if len(plugins) == 1 else f"none of {', '.join(plugins)} is"
    raise PreflightError(f"model.attention={impl!r} runs on {needs.upper()} only and this machine's JAX has no "
                         f"{needs.upper()} backend ({missing} installed): use 'auto' (the fastest correct kernel on "
                         "any backend)")


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ImportError:  # a missing parent package
    return False


def _tokenizer(cfg: Config) -> tuple[tokenizer_lib.Tokenizer | None, str | None]:
  """(the run's tokenizer, None), or (None, why the prompts' lengths are not checked): a Hub model that is not
  downloaded yet is not fetched here (the run downloads it)."""
  m = cfg.model
  if not m.hf_path:
    return char_tokenizer.build(), None
  from tunixlike.models import hub  # noqa: PLC0415 (huggingface_hub only when a model is named)
  path = hub.cached(m.hf_path, m.revision) if hub.is_hub_name(m.hf_path) else m.hf_path
  if path is None:
    return None, f"prompt lengths not checked (model.hf_path={m.hf_path!r} is not downloaded yet)"
  try:
    return tokenizer_lib.load(path), None
  except (OSError, ValueError) as e:
    raise PreflightError(f"model.hf_path={m.hf_path!r}: {e}") from None


def _sources(cfg: Config, task) -> list[tuple[str, sources.RecordSource, str]]:
  """(key, source, what was read) of each source the run reads prompts from, read as the run reads it."""
  if isinstance(task, tasks.DatasetTask):
    try:
      data = task.data()
    except (OSError, ValueError, ImportError) as e:  # the message names the key and the file (and its line)
      raise PreflightError(str(e)) from None
    return [(key, s, f"{key}: {len(s)} rows read (first {min(ROWS, len(s))} checked)") for key, s in data.items()]
  key = f"data.task={cfg.data.task!r}"
  try:
    source = task.source("train", size=ROWS, seed=cfg.data.shuffle_seed)
  except (OSError, ValueError) as e:
    raise PreflightError(f"{key}: {e}") from None
  return [(key, source, f"{key}: first {len(source)} train rows checked")]


def _check_columns(cfg: Config, key: str, source: sources.RecordSource, n: int):
  """The columns the config names are in each of the first `n` rows (a JSONL line may lack one)."""
  d = cfg.data
  named = ([("data.messages_field", d.messages_field)] if d.messages_field
           else [("data.prompt_field", d.prompt_field)] if d.train is not None else [])  # a built-in task: its own
  if d.answer_field is not None:
    named.append(("data.answer_field", d.answer_field))
  for i in range(n):
    record = source[i]
    for name, column in named:
      if column not in record:
        raise PreflightError(f"{name}={column!r}: {key} has no such column ({source.where(i)} has {list(record)})")


def _format(cfg: Config, task, tok, source: sources.RecordSource, n: int) -> list[_Prompt]:
  """The first `n` rows formatted by the run's own prompt pipeline (templates, chat template) and counted in
  tokens; a row whose prompt is not text fails as in the run, or is skipped with data.skip_bad_lines."""
  rows = sources.Subset(source, np.arange(n))  # each record gets the `id` the run gives it
  if tok is None:
    field = cfg.data.messages_field or cfg.data.prompt_field
    return [_Prompt(rows[i], rows.where(i), str(rows[i].get(field, "")), None) for i in range(n)]
  config = pipeline.PipelineConfig.from_config(cfg, max_prompt_tokens=None, shuffle=False, num_epochs=1)
  out = []
  try:
    pipe = pipeline.PromptPipeline(rows, tok, config, default_template=task.prompt_template)
    for i in range(n):
      record, where = rows[i], rows.where(i)
      try:
        text = pipe.format(record, where)
      except pipeline.BadRow:
        if not cfg.data.skip_bad_lines:
          raise
        continue
      out.append(_Prompt(record, where, text, len(tok.encode_prompt(text, templated=pipe.templated))))
  except ValueError as e:  # the pipeline's messages name the file and the line
    raise PreflightError(str(e)) from None
  return out


def _check_lengths(cfg: Config, prompts: dict[str, list[_Prompt]]) -> str:
  """The run drops prompts over data.max_prompt_length: a source none of whose first rows fits is a mistake."""
  m = cfg.data.max_prompt_length
  for key, checked in prompts.items():
    if checked and all(p.tokens > m for p in checked):
      shortest = min(checked, key=lambda p: p.tokens)
      raise PreflightError(f"data.max_prompt_length={m}: all {len(checked)} prompts checked in {key} are longer "
                           f"(the shortest, {shortest.where}, has {shortest.tokens} tokens); the run drops longer "
                           "prompts")
  lengths = [p.tokens for checked in prompts.values() for p in checked]
  over = sum(n > m for n in lengths)
  low, high = min(lengths, default=0), max(lengths, default=0)
  return (f"prompts {low}{'' if low == high else f' to {high}'} tokens (data.max_prompt_length={m}"
          + (f"; {over} of {len(lengths)} longer, which the run drops)" if over else ")"))


def _completion_limit(cfg: Config, task, tok) -> str:
  """The sampler.max_new_tokens the run will use: the config's, or sized from the data as the run sizes it
  (the same rows and tokenizer), and refused as the run refuses it when the data has no answers."""
  if cfg.sampler.max_new_tokens is not None:
    return f"sampler.max_new_tokens={cfg.sampler.max_new_tokens}"
  if tok is None:
    return "sampler.max_new_tokens sized from the data at start-up (no tokenizer here to count with)"
  from tunixlike.rl import build  # noqa: PLC0415 (the run's own sizing, for a config that leaves it to the data)
  try:
    return build.sized_completions(cfg, tok, task)[1]
  except ValueError as e:
    raise PreflightError(str(e)) from None


def _answer(cfg: Config, record: dict[str, Any]) -> tuple[str | None, str]:
  """(the row's answer as a completion, the column it came from): data.answer_field (a built-in task's
  'answer'), else the last assistant turn of data.messages_field; None when the row has none."""
  d = cfg.data
  if d.answer_field is None and d.messages_field is not None:
    turns = [m.get("content") for m in record.get(d.messages_field) or () if isinstance(m, dict)
             and m.get("role") == "assistant"]
    return (turns[-1], d.messages_field) if turns and isinstance(turns[-1], str) else (None, "")
  field = d.answer_field or "answer"
  value = record.get(field)
  return (None if value is None else str(value)), field


def _check_rewards(cfg: Config, task, tok, prompt: _Prompt) -> str:
  """Loads the rewards as the run does (import, signature against the columns), then calls each once on
  `prompt`'s row with its answer and an empty completion, as the run's reward stage calls them."""
  try:
    terms = tasks.reward_terms(cfg.rewards, task)
  except ValueError as e:
    raise PreflightError(str(e)) from None
  columns = [c for c in task.columns() if c not in NOT_COLUMNS] if isinstance(task, tasks.DatasetTask) else None
  try:
    reward = CombinedReward(terms, timeout_s=cfg.rl.reward_timeout_s, columns=columns)
  except ValueError as e:  # a LoadError: names rewards[i].fn and what is wrong
    raise PreflightError(str(e)) from None
  answer, field = _answer(cfg, prompt.record)
  completions = [answer or "", ""]
  n = len(completions)
  batch = {k: [v] * n for k, v in prompt.record.items() if k not in NOT_COLUMNS}
  batch.update(completion_lengths=[len(tok.encode(c, add_special_tokens=False)) if tok else len(c)
                                   for c in completions],
               finish_reasons=["eos"] * n, prompt_ids=[prompt.record["id"]] * n)
  limit = min(cfg.rl.reward_timeout_s, CALL_TIMEOUT_S)
  said = []
  for i, (spec, safe) in enumerate(zip(reward.specs, reward.fns)):
    key, tried = f"rewards[{i}].fn", completions
    done, result, error = _call(safe.fn, limit, [prompt.text] * n, tried, **batch)
    if done and error is not None and answer:  # the run scores a completion it raises on 0: try the answer alone
      tried = completions[:1]
      done, result, error = _call(safe.fn, limit, [prompt.text], tried, **{k: v[:1] for k, v in batch.items()})
    if not done:
      said.append(f"{spec.name} (no result in {limit:g} s, not checked)")
      continue
    if error is not None and answer:
      raise PreflightError(f"{key}: {spec.name} raised {type(error).__name__}: {error} (called on {prompt.where} with "
                           f"its {field!r} {_short(answer)} as the completion)")
    if error is not None:  # on empty completions only, as the run's own start-up check, this proves nothing
      said.append(f"{spec.name} (raised {type(error).__name__} on an empty completion, not checked)")
      continue
    score = _score_of_answer(key, spec.name, result, tried, prompt.where)
    said.append(f"{spec.name}={score}" if answer else spec.name)
  return f"rewards: {', '.join(said)} called on one row" + (f"'s {field!r}" if answer else "")


def _score_of_answer(key: str, name: str, result, completions: list[str], where: str) -> str:
  """What a reward returned, checked as the run's `SafeReward` would count it (one finite float or None per
  completion, else a failure scored 0); the first completion's score, as text."""
  n = len(completions)
  if result is None or isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
    got = "None" if result is None else f"a {type(result).__name__}"
    raise PreflightError(f"{key}: {name} returned {got} instead of a list of {n} scores: return one float (or None) "
                         "per completion")
  if len(result) != n:
    raise PreflightError(f"{key}: {name} returned {len(result)} scores for {n} completions: return one float (or None) "
                         "per completion")
  for value, completion in zip(result, completions):
    if value is not None and as_score(value) is None:
      raise PreflightError(f"{key}: {name} returned {_short(value)} for the completion {_short(completion)} of "
                           f"{where}: return a finite float (or None) per completion")
  return "None" if result[0] is None else f"{as_score(result[0]):g}"


def _call(fn, timeout_s: float, *args, **kwargs) -> tuple[bool, Any, BaseException | None]:
  """(finished, result, error) of `fn(*args, **kwargs)` on a daemon thread, given up after `timeout_s` (a
  hung reward is abandoned, as the run's `SafeReward` abandons it, and cannot hold up the exit)."""
  out: dict[str, Any] = {}

  def run():
    try:
      out["result"] = fn(*args, **kwargs)
    except BaseException as e:  # reported by the caller, with the reward's key
      out["error"] = e

  thread = threading.Thread(target=run, daemon=True, name="preflight-reward")
  thread.start()
  thread.join(timeout_s)
  return not thread.is_alive(), out.get("result"), out.get("error")


def _short(value, limit: int = 40) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."
