"""Process rewards on partial rollouts: score each *step* of a completion while it is still decoding.

A process reward model (PRM) is any callable `prm(prefix: Prefix) -> float` that scores the prompt
plus the completion so far (a function, or a model: `TokenProbPRM` wraps a language model). The
sampler hands a prefix to `ProcessRewardScorer.submit` the moment a step boundary is generated (a
delimiter such as a newline, or every N tokens; see `StepConfig`) and keeps decoding: the call
runs on a daemon worker thread. When a group is finished, the reward stage calls `collect(group)`,
which waits only for that group's outstanding calls (one deadline, `timeout_s`) and writes
`Completion.step_rewards` / `Completion.step_ends`. A call that raises, returns a non-number or
misses the deadline scores 0 for its step and is counted (as `rewards.safe` does for rewards).

Workers are daemon threads fed by one queue: a stuck PRM call cannot block interpreter exit, and
a call still queued when its deadline passed is skipped instead of run. Outstanding calls are
bounded by decode slots x steps per completion.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from tunixlike import trace as trace_lib
from tunixlike.rewards.safe import as_score
from tunixlike.rollout import RolloutGroup
from tunixlike.settings import FromConfig, tree_key

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prefix:
  """What a PRM scores: the prompt and the first `len(token_ids)` tokens of one completion."""

  prompt_token_ids: np.ndarray  # int32 [P]
  token_ids: np.ndarray  # int32 [n]: the completion so far, boundary token included
  text: str | None  # the completion so far, detokenised (None without a detokenizer)
  prompt_text: str | None = None
  columns: dict[str, Any] = dataclasses.field(default_factory=dict)  # the prompt's dataset columns


ProcessRewardFn = Callable[[Prefix], float]
_REGISTRY: dict[str, ProcessRewardFn] = {}


def register_process_reward(name: str) -> Callable[[ProcessRewardFn], ProcessRewardFn]:
  """Decorator: `@register_process_reward("answer_prefix")` makes it `algo.process_reward="answer_prefix"`."""

  def decorator(fn: ProcessRewardFn) -> ProcessRewardFn:
    if name in _REGISTRY and _REGISTRY[name] is not fn:
      raise ValueError(f"process reward {name!r} is already registered ({_REGISTRY[name]})")
    _REGISTRY[name] = fn
    return fn

  return decorator


def get_process_reward(name: str, **kwargs) -> ProcessRewardFn:
  if name not in _REGISTRY:
    raise ValueError(f"algo.process_reward={name!r} is not a registered process reward; choose one of "
                     f"{process_reward_names()}")
  fn = _REGISTRY[name]
  return functools.partial(fn, **kwargs) if kwargs else fn


def process_reward_names() -> list[str]:
  return sorted(_REGISTRY)


@register_process_reward("answer_prefix")
def answer_prefix(prefix: Prefix) -> float:
  """1 if the completion so far (stripped) is a non-empty prefix of the `answer` column, else 0.

  For answers produced token by token (the synthetic tasks), every correct partial answer is a
  correct step: with `algo.step_every_tokens=1` each digit gets its own reward.
  """
  answer = str(prefix.columns["answer"])
  text = (prefix.text or "").strip()
  return float(bool(text) and answer.startswith(text))


class TokenProbPRM:
  """A language model as a PRM (Math-Shepherd style): the score of a prefix is the model's
  probability of `good_id` right after it, renormalised over {good_id, bad_id} when bad_id is given.

  `model` is an nnx Transformer (`model(tokens_bt) -> logits_btv`); each call runs one jitted
  forward of [1, bucket] tokens (lengths rounded up to `bucket` so it compiles once per bucket).
  """

  def __init__(self, model, *, good_id: int, bad_id: int | None = None, bucket: int = 64, pad_id: int = 0):
    import jax  # the rewards package is importable without touching a JAX backend
    from flax import nnx

    if bucket <= 0:
      raise ValueError(f"TokenProbPRM.bucket={bucket}: must be > 0")
    graphdef, state = nnx.split(model)
    self._state, self.good_id, self.bad_id, self.bucket, self.pad_id = state, good_id, bad_id, bucket, pad_id

    def score(state, tokens_1t, last):
      logits_v = nnx.merge(graphdef, state)(tokens_1t)[0, last].astype(np.float32)
      logp_v = jax.nn.log_softmax(logits_v)
      if bad_id is None:
        return jax.numpy.exp(logp_v[good_id])
      return jax.nn.softmax(logp_v[jax.numpy.array([good_id, bad_id])])[0]

    self._score = jax.jit(score)

  def __call__(self, prefix: Prefix) -> float:
    ids = np.concatenate([np.asarray(prefix.prompt_token_ids), np.asarray(prefix.token_ids)]).astype(np.int32)
    t = -(-len(ids) // self.bucket) * self.bucket
    tokens = np.full((1, t), self.pad_id, np.int32)
    tokens[0, :len(ids)] = ids
    return float(self._score(self._state, tokens, len(ids) - 1))


@dataclasses.dataclass(frozen=True)
class StepConfig(FromConfig):
  """Where steps end and how long the reward stage waits for their scores:
  `StepConfig.from_config(cfg)` (the config checks the keys, and that some boundary is set).

  A token ends a step when the text it completes contains `delimiter` (e.g. "\\n"; "" = off) or
  when it is the N-th, 2N-th, ... token (`every_tokens` = N; 0 = off). The last token of a
  completion always ends its final step.
  """

  delimiter: str = tree_key("algo.step_delimiter")
  every_tokens: int = tree_key("algo.step_every_tokens")
  timeout_s: float = tree_key("rl.reward_timeout_s")  # a group's deadline for its calls, from its collection
  workers: int = tree_key("rl.reward_workers")

  def is_boundary(self, tokens: Sequence[int], detokenize: Callable[[Sequence[int]], str] | None) -> bool:
    """Does the last of `tokens` end a step? (Each token decodes to >= 1 character, so the last
    len(delimiter) tokens hold any delimiter occurrence the last token completed.)"""
    n = len(tokens)
    if self.every_tokens and n % self.every_tokens == 0:
      return True
    if self.delimiter and detokenize is not None:
      w = len(self.delimiter)
      return self.delimiter in detokenize(tokens[-w:]) and self.delimiter not in detokenize(tokens[-w:-1])
    return False


class _Call:
  """One PRM call: submitted by the sampler thread, run by a worker, awaited by the reward stage."""

  __slots__ = ("prefix", "value", "error", "done", "cancelled")

  def __init__(self, prefix: Prefix):
    self.prefix, self.value, self.error = prefix, None, None
    self.done, self.cancelled = threading.Event(), False


class ProcessRewardScorer:
  """Runs a PRM on step prefixes in daemon worker threads; see the module docstring.

  `submit(prefix)` (sampler thread, never blocks) -> a handle; `attach(group, handles)` (sampler
  thread, before the group leaves it) records which step ends each handle belongs to;
  `collect(group)` (reward stage) waits for them and fills the group's step rewards.
  """

  def __init__(self, fn: ProcessRewardFn, *, name: str, steps: StepConfig,
               tracer: trace_lib.Tracer = trace_lib.NULL_TRACER):
    self.fn, self.name, self.steps, self.tracer = fn, name, steps, tracer
    self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._attached: dict[int, tuple[RolloutGroup, list[list[tuple[int, _Call]]]]] = {}
    self.calls = self.failures = self.timeouts = 0  # over the scorer's lifetime
    self._workers = [threading.Thread(target=self._work, name=f"prm-{i}", daemon=True)
                     for i in range(steps.workers)]
    for w in self._workers:
      w.start()

  # ---- workers ------------------------------------------------------------------------------
  def _work(self):
    while True:
      call = self._queue.get()
      if call is None:
        return
      if call.cancelled:  # its group's deadline passed while it waited in the queue
        call.done.set()
        continue
      try:
        with self.tracer.span("prm", cat="reward", tokens=len(call.prefix.token_ids)):
          call.value = self.fn(call.prefix)
      except BaseException as e:  # scored 0 and counted by `collect`, never raised here
        call.error = e
      call.done.set()

  def close(self):
    """Lets idle workers exit (a worker stuck in a PRM call is a daemon and never blocks exit)."""
    for _ in self._workers:
      self._queue.put(None)

  # ---- sampler thread -----------------------------------------------------------------------
  def submit(self, prefix: Prefix) -> _Call:
    call = _Call(prefix)
    with self._lock:
      self.calls += 1
    self._queue.put(call)
    return call

  def attach(self, group: RolloutGroup, handles: list[list[tuple[int, _Call]]]) -> None:
    """`handles[i]` = [(step end token index, call), ...] of completion i, in token order."""
    if len(handles) != group.group_size:
      raise ValueError(f"ProcessRewardScorer.attach: {len(handles)} handle lists for a group of {group.group_size}")
    with self._lock:
      self._attached[id(group)] = (group, handles)  # holds `group`: its id stays unique until collected

  # ---- reward stage -------------------------------------------------------------------------
  def collect(self, group: RolloutGroup, timeout_s: float | None = None) -> dict[str, float]:
    """Waits (one deadline for the group) for its PRM calls; fills `step_rewards` / `step_ends` of
    each completion and adds `process_reward/*` to `group.reward_metrics`. Returns those metrics."""
    with self._lock:
      entry = self._attached.pop(id(group), None)
    if entry is None or entry[0] is not group:
      raise ValueError(f"RolloutGroup(prompt_id={group.prompt_id!r}) has no process-reward calls attached: it did "
                       "not come from a driver with a ProcessRewardRecorder with this scorer (or was collected twice)")
    t0 = time.perf_counter()
    deadline = time.monotonic() + (self.steps.timeout_s if timeout_s is None else timeout_s)
    failed = timed_out = 0
    all_scores = []
    for c, handles in zip(group.completions, entry[1]):
      ends, scores = [], []
      for end, call in handles:
        finished = call.done.wait(max(0.0, deadline - time.monotonic()))
        score = None
        if not finished:
          call.cancelled = True
          timed_out += 1
        elif call.error is not None:
          _log.warning("process reward %s raised %r; the step scores 0", self.name, call.error)
        else:
          score = as_score(call.value)
        failed += score is None
        ends.append(end)
        scores.append(0.0 if score is None else score)
      c.step_ends = np.asarray(ends, np.int32)
      c.step_rewards = np.asarray(scores, np.float32)
      all_scores += scores
    if failed:
      _log.warning("process reward %s: %d of %d steps scored 0 (%d timed out after %.1f s)", self.name, failed,
                   len(all_scores), timed_out, self.steps.timeout_s if timeout_s is None else timeout_s)
    with self._lock:
      self.failures += failed
      self.timeouts += timed_out
    metrics = {"process_reward/mean": float(np.mean(all_scores)) if all_scores else 0.0,
               "process_reward/steps_per_completion": len(all_scores) / max(group.group_size, 1),
               "process_reward/failures": float(failed), "process_reward/timeout_failures": float(timed_out),
               "process_reward/wait_ms": 1000.0 * (time.perf_counter() - t0)}
    group.reward_metrics.update(metrics)
    return metrics
