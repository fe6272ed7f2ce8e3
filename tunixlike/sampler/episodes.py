"""Multi-turn episodes: decoding interleaved with environment steps, no slot ever waiting on a tool.

`EnvEpisodes` is the episode strategy (`strategy.Episodes`) whose completions are conversations with
an environment (`tunixlike.rewards.envs.Env`); `EpisodeDriver` is a `RolloutDriver` that runs it.
For each prompt it runs G episodes, each with its own Env:

  1. `env.reset(record)` runs on a worker thread; its text (if any) is appended to the prompt;
  2. the episode waits for a free decode slot (and, with a paged cache, its blocks), prefills its
     conversation so far (with the current weights) and decodes one policy turn, which ends at
     EOS, at a stop string (`EpisodeConfig.action_stop_strings`, by default `</tool_call>`) or at
     the turn's token limit;
  3. the slot is freed at once for other work and `env.step(turn_text)` runs on a worker thread
     (`EnvRunner`, with a timeout); meanwhile the other slots keep decoding;
  4. when the step returns, its observation tokens are appended (loss_mask 0, logprob 0) and the
     episode waits for a slot again (back to 2), until the env says done, `max_turns` policy
     turns are used, or the conversation no longer fits (`max_prefill_length`, `max_episode_tokens`).

An episode's `Completion` holds everything after the prompt: policy turns (loss_mask 1, their
sampling logprobs and per-token policy versions) and environment text (loss_mask 0, logprob 0,
version = the sampler's version when it was appended, so it never makes a group look older).
Weights can change between any two generate calls (`update_params`): a turn in flight keeps
decoding on its KV with the new weights (mixed versions, recorded per token); every later turn
re-prefills its conversation with the weights current then. With a paged cache
(`sampler.kv_layout='paged'`) a finished turn's KV stays in the pool while the env runs (`park`),
and the next turn computes only the tokens added since (`resume_prefill`) when no weight update came
in between; parked KV is dropped first when blocks run short, and a turn preempted mid-decode is
prefilled again and continues where it stopped, with the same noise. The episode reward aggregates
the step rewards (`reward_aggregation`); an env that raises, times out or returns garbage ends only
its own episode (finish_reason "aborted", reward `failure_reward`), never the run. Each finished
group goes to the sink as a `RolloutGroup` with `rewards` already filled (G episode rewards) and
`reward_metrics` (episode statistics, means over the group).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tunixlike.rewards.envs import base as env_base
from tunixlike.rewards.envs import tool_calls
from tunixlike.rewards.envs.runner import EnvRunner, EnvTimeout
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler.driver import DriverStats, PromptRequest, RolloutDriver
from tunixlike.sampler.engine import ParkedKV, Prefix
from tunixlike.sampler.engine_api import EngineAPI
from tunixlike.settings import FromConfig, tree_key

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EpisodeConfig(FromConfig):
  """`EpisodeConfig.from_config(cfg)`: the run's rl.env_* keys plus the episodes' own settings."""

  max_turns: int = tree_key("rl.env_max_turns")  # policy turns per episode
  step_timeout_s: float = tree_key("rl.env_step_timeout_s")  # per reset / step call, from when a worker starts it
  # Tokens per policy turn (None = sampler.max_new_tokens, which also caps it).
  max_turn_tokens: int | None = None
  # Completion tokens per episode, policy and environment together (None = only the prefill limit:
  # prompt + completion must fit sampler.max_prefill_length before every turn).
  max_episode_tokens: int | None = None
  # Strings that end a policy turn (besides EOS and sampler.stop_strings): the end of an action.
  action_stop_strings: tuple[str, ...] = (tool_calls.CALL_CLOSE,)
  env_workers: int = 8  # threads running env calls (a timed-out call's thread is replaced)
  failure_reward: float = 0.0  # reward of an episode whose env raised, timed out or misbehaved
  reward_aggregation: str = "sum"  # episode reward from step rewards: sum, last or mean
  # Episodes started and not finished (decoding, parked or waiting on the env); None = 2 x slots.
  max_episodes_in_flight: int | None = None

  def __post_init__(self):
    def positive_int(name, value, allow_none=False):
      if allow_none and value is None:
        return
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"episodes.{name}={value!r}: must be an int >= 1" + (" or None" if allow_none else ""))

    positive_int("max_turns", self.max_turns)
    positive_int("env_workers", self.env_workers)
    for name in ("max_turn_tokens", "max_episode_tokens", "max_episodes_in_flight"):
      positive_int(name, getattr(self, name), allow_none=True)
    if not isinstance(self.action_stop_strings, tuple) or not all(
        isinstance(s, str) and s for s in self.action_stop_strings):
      raise ValueError(f"episodes.action_stop_strings={self.action_stop_strings!r}: must be a tuple of "
                       "non-empty strings")
    if not isinstance(self.step_timeout_s, (int, float)) or not self.step_timeout_s > 0:
      raise ValueError(f"episodes.step_timeout_s={self.step_timeout_s!r}: must be > 0")
    if not isinstance(self.failure_reward, (int, float)) or not math.isfinite(self.failure_reward):
      raise ValueError(f"episodes.failure_reward={self.failure_reward!r}: must be a finite number")
    if self.reward_aggregation not in env_base.REWARD_AGGREGATIONS:
      raise ValueError(f"episodes.reward_aggregation={self.reward_aggregation!r}: expected one of "
                       f"{env_base.REWARD_AGGREGATIONS}")


@dataclasses.dataclass
class EpisodeStats(DriverStats):
  episodes: int = 0  # finished episodes (also counted in `completions`)
  policy_turns: int = 0
  env_tokens: int = 0  # observation tokens appended
  env_timeouts: int = 0
  env_errors: int = 0  # env raised or returned something that is not a StepResult / str
  aborted_episodes: int = 0
  kv_resumed_turns: int = 0  # turns that continued from their episode's parked KV (paged cache)


@dataclasses.dataclass
class _EpisodeGroup:
  seq: int
  request: PromptRequest
  prompt_ids: np.ndarray
  record: dict[str, Any]
  completions: list[Completion | None]
  rewards: list[float]
  metrics: list[dict[str, float]]
  first_prefix: dict = dataclasses.field(default_factory=dict)  # (ids, version) -> Prefix, turn 0 only


@dataclasses.dataclass
class _Episode:
  group: _EpisodeGroup
  index: int
  env: Any
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  masks: list[np.ndarray] = dataclasses.field(default_factory=list)
  step_rewards: list[float] = dataclasses.field(default_factory=list)
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  turns: int = 0  # policy turns started
  turn_start: int = 0  # index in `tokens` where the current turn began
  turn_finish: str = "length"  # how the last policy turn ended
  out_of_budget: bool = False  # the last turn used up the episode's token budget
  turn_limit: int = 0  # tokens the current turn may decode
  insert_version: int = 0  # weights version when the current turn was inserted
  preempted: bool = False  # the current turn lost its slot mid-decode (paged cache) and waits to go on
  kv: ParkedKV | None = None  # the last turn's KV, kept while the env runs (paged cache)
  kv_version: int | None = None  # the version that computed all of `kv` (None: mixed)
  prefix: Prefix | None = None  # built, waiting for blocks to be inserted


@dataclasses.dataclass
class _EpisodeSlot:
  episode: _Episode
  max_new: int


class EnvEpisodes:
  """The `strategy.Episodes` of environment episodes; see the module docstring."""

  continues_in_flight = False  # its episodes hold state a checkpoint does not: started again on resume

  def __init__(self, make_env: Callable[[], Any], tokenize: Callable[[str], Sequence[int]],
               episode_config: EpisodeConfig):
    if not isinstance(episode_config, EpisodeConfig):
      raise TypeError(f"episode_config must be an EpisodeConfig, got {type(episode_config).__name__}")
    self.episode_config = ec = episode_config
    self.key_turns = ec.max_turns
    self._make_env, self._tokenize = make_env, tokenize
    self._runner = EnvRunner(num_workers=ec.env_workers, timeout_s=ec.step_timeout_s, name="env")
    self._tickets: dict[int, _Episode] = {}  # env call in progress -> its episode
    self._ready: list[tuple[int, int, _Episode]] = []  # heap by (group seq, index): oldest group first
    self._live_episodes = 0

  def bind(self, driver) -> EpisodeStats:
    self.driver = driver
    self.engine, self.config = engine, cfg = driver.engine, driver.config
    ec = self.episode_config
    self.stats = EpisodeStats()
    self._max_in_flight = ec.max_episodes_in_flight or 2 * engine.max_concurrent_decodes
    self._stops = tuple(cfg.stop_strings) + ec.action_stop_strings
    self._turn_limit = min(ec.max_turn_tokens or cfg.max_new_tokens, cfg.max_new_tokens)
    self._mask_width = -(-engine.vocab_size // 8)
    return self.stats

  @property
  def is_idle(self) -> bool:
    return self._live_episodes == 0

  @property
  def waiting_on_env(self) -> int:
    return len(self._tickets)

  def close(self) -> None:
    self._runner.close()

  def collected(self) -> None:
    pass

  # ------------------------------------------------------------------ one step

  def prepare(self) -> None:
    """Before each refill: take environment results, then start new groups (episodes)."""
    self._poll_env()
    self._start_groups()

  def _start_groups(self) -> None:
    """Starts groups while ready episodes cannot fill the free slots and the in-flight bound allows."""
    d, g = self.driver, self.config.group_size
    while len(self._ready) < len(d.slots.free()) and self._live_episodes + g <= self._max_in_flight:
      group = d.admission.admit(d.version, self._new_group)
      if group is None:
        return
      for i in range(g):
        episode = _Episode(group=group, index=i, env=self._make_env())
        self._live_episodes += 1
        self._tickets[self._runner.submit(episode.env.reset, dict(group.record))] = episode

  def _new_group(self, seq: int, request: PromptRequest, ids: np.ndarray) -> _EpisodeGroup:
    g = self.config.group_size
    record = dict(request.columns)
    record.setdefault("prompt_id", request.prompt_id)
    record.setdefault("prompt_text", request.prompt_text)
    return _EpisodeGroup(seq=seq, request=request, prompt_ids=ids, record=record,
                         completions=[None] * g, rewards=[0.0] * g, metrics=[{}] * g)

  def _poll_env(self) -> None:
    for ticket, value, error in self._runner.poll():
      episode = self._tickets.pop(ticket)
      if error is None:
        if episode.turns == 0:
          error = self._after_reset(episode, value)
        else:
          error = self._after_step(episode, value)
      if error is not None:
        self._fail(episode, error)

  def _after_reset(self, episode: _Episode, text) -> BaseException | None:
    if text is None:
      text = ""
    if not isinstance(text, str):
      return TypeError(f"Env.reset returned {type(text).__name__}, expected str")
    self._continue(episode, text)
    return None

  def _after_step(self, episode: _Episode, result) -> BaseException | None:
    if not isinstance(result, env_base.StepResult):
      return TypeError(f"Env.step returned {type(result).__name__}, expected StepResult")
    episode.step_rewards.append(float(result.reward))
    for k, v in result.info.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        episode.metrics[f"env/{k}"] = episode.metrics.get(f"env/{k}", 0.0) + float(v)
    if result.done:
      self._finish_episode(episode, episode.turn_finish)
    elif episode.out_of_budget or episode.turns >= self.episode_config.max_turns:
      self._finish_episode(episode, "length")
    else:
      self._continue(episode, result.observation or "")
    return None

  def _continue(self, episode: _Episode, observation: str) -> None:
    """Appends the observation (if it fits with room for a turn) and queues the episode for a slot."""
    ids = [int(i) for i in self._tokenize(observation)] if observation else []
    n = len(episode.group.prompt_ids) + len(episode.tokens) + len(ids)
    budget = self.episode_config.max_episode_tokens
    if n > self.engine.max_prefill_length or (budget is not None and len(episode.tokens) + len(ids) >= budget):
      self._finish_episode(episode, "length")
      return
    if ids and (min(ids) < 0 or max(ids) >= self.engine.vocab_size):
      self._fail(episode, ValueError(f"tokenize gave ids outside [0, {self.engine.vocab_size}) for the observation "
                                     f"{observation[:80]!r}"))
      return
    episode.tokens += ids
    episode.logprobs += [0.0] * len(ids)
    episode.versions += [self.driver.version] * len(ids)
    episode.loss_mask += [0] * len(ids)
    if self.config.record_sampling_mask:
      episode.masks += [np.zeros((self._mask_width,), np.uint8)] * len(ids)
    self.stats.env_tokens += len(ids)
    heapq.heappush(self._ready, (episode.group.seq, episode.index, episode))

  def requeue(self, info: _EpisodeSlot) -> None:
    """A turn preempted by a paged cache waits for a slot again and then goes on where it stopped."""
    episode = info.episode
    episode.preempted = True
    heapq.heappush(self._ready, (episode.group.seq, episode.index, episode))

  def refill(self, free: list[int]) -> None:
    d = self.driver
    for slot in free:
      if not self._ready:
        return
      _, _, episode = heapq.heappop(self._ready)
      group = episode.group
      ids = np.concatenate([group.prompt_ids, np.asarray(episode.tokens, group.prompt_ids.dtype)])
      t0 = time.perf_counter()
      prefix = self._turn_prefix(episode, ids)
      if not self.engine.fits(d.slots.state, [(len(ids), [slot])]):  # a paged cache short of blocks
        episode.prefix = prefix
        heapq.heappush(self._ready, (group.seq, episode.index, episode))
        return
      resumed = episode.preempted
      if not resumed:  # a new turn
        episode.turns += 1
        episode.turn_start = len(episode.tokens)
        episode.turn_limit = self._new_turn_limit(episode)
      episode.preempted, episode.insert_version = False, d.version
      # Set by the group's start order, the episode's index and the turn number.
      key = d.keys.group(group.seq)[episode.index, episode.turns - 1]
      d.slots.state = self.engine.insert_many([prefix], d.slots.state, [[slot]], keys=[key[None]],
                                              max_new_tokens=[episode.turn_limit],
                                              generated=[len(episode.tokens) - episode.turn_start])
      self.stats.busy_time_s += time.perf_counter() - t0
      self.stats.resumed += resumed
      d.slots[slot] = _EpisodeSlot(episode, episode.turn_limit)

  def _new_turn_limit(self, episode: _Episode) -> int:
    limit = self._turn_limit
    if episode.group.request.max_new_tokens is not None:
      limit = min(limit, episode.group.request.max_new_tokens)
    if self.episode_config.max_episode_tokens is not None:
      limit = min(limit, self.episode_config.max_episode_tokens - len(episode.tokens))
    return limit

  def _turn_prefix(self, episode: _Episode, ids: np.ndarray) -> Prefix:
    """The KV of the conversation so far, computed with the current weights: a prefix built
    earlier, the last turn's parked KV extended by what came since, the group's shared first
    prefix, or a prefill of the whole conversation."""
    prefix, episode.prefix = episode.prefix, None
    if prefix is not None and prefix.version == self.driver.version:
      return prefix
    kv, episode.kv = episode.kv, None
    if kv is not None:
      if episode.kv_version == self.driver.version:
        d = self.driver
        prefix = self.engine.resume_prefill(d.params, d.slots.state, kv, ids, version=d.version)
      else:
        self.engine.discard(self.driver.slots.state, kv)
      if prefix is not None:
        self.stats.kv_resumed_turns += 1
        return prefix
    group, first = episode.group, episode.turns == 0 and not episode.preempted
    cache_key = (ids.tobytes(), self.driver.version)
    prefix = group.first_prefix.get(cache_key) if first else None
    if prefix is None:
      prefix = self.engine.prefill_many(self.driver.params, [ids], version=self.driver.version,
                                        max_length=self.config.cache_length)[0]
      self.stats.prefills += 1
      if first and self.config.group_size > 1:
        group.first_prefix = {cache_key: prefix}  # the G episodes usually start alike
    return prefix

  # ------------------------------------------------------------------ results

  def record(self, info: _EpisodeSlot, token: int, logprob: float, version: int, mask) -> None:
    ep = info.episode
    ep.tokens.append(token)
    ep.logprobs.append(logprob)
    ep.versions.append(version)
    ep.loss_mask.append(1)
    if mask is not None:
      ep.masks.append(mask)

  def stop_reason(self, info: _EpisodeSlot, token: int, eos: set[int]) -> str | None:
    """A turn ends at EOS, at an action stop string (a tool call) or at its token limit."""
    ep = info.episode
    if token in eos:
      return "eos"
    if self._stops and any(x in self._turn_text(ep) for x in self._stops):
      return "stop"
    if len(ep.tokens) - ep.turn_start >= info.max_new:
      return "length"
    return None

  def finish(self, slot: int, info: _EpisodeSlot, reason: str) -> None:
    episode = info.episode
    # KV of the conversation but its last token (sampled, not yet fed) stays for the next turn.
    episode.kv = self.engine.park(self.driver.slots.state, slot,
                                  len(episode.group.prompt_ids) + len(episode.tokens) - 1)
    episode.kv_version = self.driver.version if episode.insert_version == self.driver.version else None
    self._end_turn(episode, reason)

  def _turn_text(self, episode: _Episode) -> str:
    return self.driver.detokenize(episode.tokens[episode.turn_start:])

  def _end_turn(self, episode: _Episode, finish: str) -> None:
    """The slot is already free; the env step runs on a worker while decoding goes on."""
    self.stats.policy_turns += 1
    self.stats.tokens_generated += len(episode.tokens) - episode.turn_start
    episode.turn_finish = finish
    budget = self.episode_config.max_episode_tokens
    episode.out_of_budget = budget is not None and len(episode.tokens) >= budget
    self._tickets[self._runner.submit(episode.env.step, self._turn_text(episode))] = episode

  def _fail(self, episode: _Episode, error: BaseException) -> None:
    if isinstance(error, EnvTimeout):
      self.stats.env_timeouts += 1
    else:
      self.stats.env_errors += 1
    _log.warning("episode %d of prompt %r aborted: %r", episode.index, episode.group.request.prompt_id, error)
    episode.metrics["env/failed"] = 1.0
    self._finish_episode(episode, "aborted", reward=self.episode_config.failure_reward)

  def _finish_episode(self, episode: _Episode, reason: str, reward: float | None = None) -> None:
    self.engine.discard(self.driver.slots.state, episode.kv)
    episode.kv = episode.prefix = None
    if reward is None:
      reward = env_base.aggregate_rewards(episode.step_rewards, self.episode_config.reward_aggregation)
    n = len(episode.tokens)
    completion = Completion(
        token_ids=np.asarray(episode.tokens, np.int32).reshape(n),
        logprobs=np.asarray(episode.logprobs, np.float32).reshape(n),
        policy_versions=np.asarray(episode.versions, np.int32).reshape(n),
        finish_reason=reason,
        loss_mask=np.asarray(episode.loss_mask, np.int32).reshape(n),
        sampling_mask=np.stack(episode.masks) if episode.masks else None,
        text=self.driver.detokenize(episode.tokens))
    self._live_episodes -= 1
    self.stats.completions += 1
    self.stats.episodes += 1
    self.stats.aborted_episodes += reason == "aborted"
    group = episode.group
    group.completions[episode.index] = completion
    group.rewards[episode.index] = float(reward)
    group.metrics[episode.index] = dict(episode.metrics, **{"episode/turns": float(episode.turns),
                                                            "episode/env_tokens": float(n - sum(episode.loss_mask))})
    if all(c is not None for c in group.completions):
      self.driver.admission.done(group.seq)
      names = sorted({k for m in group.metrics for k in m})
      metrics = {k: float(np.mean([m.get(k, 0.0) for m in group.metrics])) for k in names}
      req = group.request
      self.driver.emit(RolloutGroup(prompt_id=req.prompt_id, prompt_token_ids=group.prompt_ids.astype(np.int32),
                                    completions=list(group.completions), columns=dict(req.columns),
                                    prompt_text=req.prompt_text, rewards=np.asarray(group.rewards, np.float32),
                                    reward_metrics=metrics))


class EpisodeDriver(RolloutDriver):
  """A `RolloutDriver` of G env episodes per prompt (`EnvEpisodes`); see the module docstring.

  Control from other threads is the RolloutDriver's: `start` / `stop` / `update_params` /
  `may_start_group`. `is_idle` also waits for parked and env-waiting episodes.
  """

  def __init__(self, engine: EngineAPI, params, *, source: Iterable[PromptRequest | None], sink,
               make_env: Callable[[], Any], tokenize: Callable[[str], Sequence[int]],
               detokenize: Callable[[Sequence[int]], str], episode_config: EpisodeConfig,
               version: int = 0, may_start_group: Callable[[int], bool] | None = None, tracer=None):
    """`make_env()` builds one Env per episode. `tokenize(text)` must add no special tokens (it
    encodes observations appended mid-conversation); `detokenize(ids)` gives a turn's text."""
    if not callable(make_env) or not callable(tokenize) or detokenize is None:
      raise ValueError("EpisodeDriver needs make_env, tokenize and detokenize callables")
    if engine.config.record_routing:  # observation tokens are prefilled into a slot, not decoded
      raise ValueError("sampler.record_routing is not supported by EpisodeDriver (multi-turn): only "
                       "single-turn RolloutDriver rollouts record MoE routing")
    super().__init__(engine, params, source=source, sink=sink, version=version, may_start_group=may_start_group,
                     detokenize=detokenize, episodes=EnvEpisodes(make_env, tokenize, episode_config),
                     **({} if tracer is None else {"tracer": tracer}))
    self.episode_config = episode_config

  @property
  def episodes_waiting_on_env(self) -> int:
    """Episodes whose env reset / step is running or queued."""
    return self.episodes.waiting_on_env

  @property
  def episodes_decoding(self) -> int:
    """Episodes holding a decode slot."""
    return sum(s is not None for s in self.slots)
