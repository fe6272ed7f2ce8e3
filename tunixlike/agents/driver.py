"""Agent episodes: the policy served to the user's own agent code, one request per policy turn.

`AgentEpisodes` is the episode strategy (`strategy.Episodes`, run by `AgentDriver`, a `RolloutDriver`)
whose episodes are run by an agent function written with any
framework (`run_episode(base_url, api_key, episode_id, row)`, plain or async). For each prompt it starts
G episodes on a pool of worker threads (`EnvRunner`, with `episode_timeout_s`); each agent talks to
the policy through the OpenAI-compatible server (`server.py`) with the run's key, and names its
episode (a random id) in every request:

  1. the server renders the request (chat template) and the episode's `Recording` turns it into a
     prompt that extends the episode's token chain (or splits it, counted, if the agent edited its
     history); `submit` queues the turn;
  2. the turn waits for a free decode slot, with the other rollouts and agents (continuous batching),
     prefills its conversation with the current weights and decodes, its tokens streamed to the
     client as they come;
  3. at EOS, a stop string or `max_tokens` the slot is freed and the answer returned; the sampled
     tokens join the chain with their logprobs and per-token policy versions (loss_mask 1), while
     what the agent adds in between (tool results, its own turns) enters the chain with loss_mask 0;
  4. when the agent function returns, the episode is over. Its reward is the one posted to
     `/v1/episodes/{id}/reward`, else the number the function returned; a group where no episode
     has one is scored by the run's reward functions on the recorded text. The G episodes of a
     prompt form a `RolloutGroup` (each trains on its last chain) that goes to the sink.

Admission control and the staleness bound apply per group, as for every driver; an agent that
raises, exceeds `episode_timeout_s` or disconnects mid-stream ends its own episode (aborted,
counted), never the run.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import queue
import secrets
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tunixlike.agents.chains import Recording
from tunixlike.agents.protocol import RequestError, TurnResult
from tunixlike.agents.server import AgentServer, is_loopback
from tunixlike.rewards.envs.runner import EnvRunner, EnvTimeout
from tunixlike.rollout import Completion, RolloutGroup
from tunixlike.sampler.driver import DriverError, DriverStats, PromptRequest, RolloutDriver
from tunixlike.sampler.engine_api import EngineAPI
from tunixlike.settings import FromConfig, tree_key

_log = logging.getLogger(__name__)

_PREFIXES = 8  # prefills kept for reuse: the G episodes of a prompt usually open with the same request


@dataclasses.dataclass(frozen=True)
class AgentConfig(FromConfig):
  """`AgentConfig.from_config(cfg)`: the run's rl.* keys of agent episodes and their server."""

  max_turns: int = tree_key("rl.env_max_turns")  # requests (policy turns) per episode
  workers: int = tree_key("rl.agent_workers")  # agent functions running at once = episodes in flight
  episode_timeout_s: float = tree_key("rl.episode_timeout_s")
  port: int = tree_key("rl.agent_port")  # 0 = any free port
  host: str = tree_key("rl.agent_host")  # another address lets other hosts reach the server (warned about)
  max_body_bytes: int = tree_key("rl.agent_max_body_bytes")
  max_connections: int = tree_key("rl.agent_max_connections")
  header_timeout_s: float = tree_key("rl.agent_header_timeout_s")
  idle_timeout_s: float = tree_key("rl.agent_idle_timeout_s")
  api_key: str | None = None  # None = a random key for this run only
  failure_reward: float = 0.0  # reward of an episode without one when the agent gives rewards


@dataclasses.dataclass
class AgentStats(DriverStats):
  episodes: int = 0
  requests: int = 0  # turns accepted
  refused_requests: int = 0  # answered with a 4xx
  unauthorized_requests: int = 0  # without the run's key: answered 401, never read
  dropped_requests: int = 0  # clients gone before their request was read
  invalid_json: int = 0  # bodies that did not parse: answered 400 (also in refused_requests)
  closed_connections: int = 0  # over rl.agent_max_connections, or without the key in time (connections.py)
  history_edits: int = 0  # requests that did not extend their episode's chain (the episode split)
  clamped_requests: int = 0  # sampling settings the run cannot train on, served at the run's
  timeouts: int = 0
  disconnects: int = 0  # clients gone mid-request: slot freed, episode aborted
  agent_errors: int = 0  # agent functions that raised
  aborted_episodes: int = 0


@dataclasses.dataclass(eq=False)
class Turn:
  """One request being served: a policy turn of an episode."""

  episode: "AgentEpisode"
  number: int  # the episode's turn index (with the group and episode, it sets the sampling noise)
  prompt_ids: np.ndarray
  max_new: int
  stops: tuple[str, ...]
  post: Callable[[tuple], None]  # thread-safe delivery to the request: ("delta", text) / ("done", TurnResult)
  stream: bool = False
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  sent: int = 0  # characters of content already streamed
  cancelled: bool = False


@dataclasses.dataclass(eq=False)
class _AgentGroup:
  seq: int
  request: PromptRequest
  record: dict[str, Any]
  version: int  # the sampler's version at admission
  episodes: list["AgentEpisode"] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class AgentEpisode:
  id: str
  group: _AgentGroup
  index: int
  recording: Recording
  turns: int = 0
  turn: Turn | None = None  # the request in flight
  reward: float | None = None  # posted
  returned: float | None = None  # returned by the agent function
  finish_reason: str = "stop"  # of the last turn ("aborted" if the episode was)
  finished: bool = False
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = min(len(a), len(b))
  for i in range(n):
    if a[i] != b[i]:
      return i
  return n


class AgentEpisodes:
  """The `strategy.Episodes` of agent episodes, and the server's backend (`protocol.EpisodeBackend`):
  it owns the server, which hands it requests; see the module docstring."""

  continues_in_flight = False  # its episodes hold state a checkpoint does not: started again on resume

  def __init__(self, agent: Callable[..., Any], tokenizer, agent_config: AgentConfig, model_name: str):
    """`agent(base_url, api_key, episode_id, row)` runs one episode against `base_url` (its OpenAI
    base URL), sending `api_key` with every request."""
    if not callable(agent):
      raise TypeError(f"rl.agent must be a function run_episode(base_url, api_key, episode_id, row), got {agent!r}")
    self.agent_config = ac = agent_config
    self.key_turns = ac.max_turns
    self.tokenizer, self.model_name = tokenizer, model_name
    self._agent = agent
    self._inbox: queue.SimpleQueue[Turn] = queue.SimpleQueue()  # accepted by the server, waiting for a slot
    self._cancels: queue.SimpleQueue[Turn] = queue.SimpleQueue()
    self._episodes: dict[str, AgentEpisode] = {}
    self._episode_lock = threading.Lock()  # the server thread accepts requests, this one finishes turns
    self._tickets: dict[int, AgentEpisode] = {}
    self._live_episodes = 0
    self._prefixes: collections.OrderedDict = collections.OrderedDict()
    self._runner = EnvRunner(num_workers=ac.workers, timeout_s=ac.episode_timeout_s, name="agent")
    self.api_key = ac.api_key or secrets.token_urlsafe(32)

  def bind(self, driver) -> AgentStats:
    """Starts the server (its requests need the driver's engine and weights version)."""
    self.driver = driver
    self.engine, self.config = driver.engine, driver.config
    self.stats = AgentStats()
    ac = self.agent_config
    self.server = AgentServer(self, api_key=self.api_key, host=ac.host, port=ac.port,
                              max_body_bytes=ac.max_body_bytes, max_connections=ac.max_connections,
                              header_timeout_s=ac.header_timeout_s, idle_timeout_s=ac.idle_timeout_s)
    if not is_loopback(ac.host):
      _log.warning("the agent server listens on %s, reachable from other hosts: anyone who can read its traffic "
                   "(plain HTTP) can learn the key and drive the policy or post rewards", ac.host)
    self.server.start()
    self.base_url = self.server.base_url
    return self.stats

  # ------------------------------------------------------------------ state

  @property
  def is_idle(self) -> bool:
    return self._live_episodes == 0

  def episode(self, episode_id: str) -> AgentEpisode | None:
    with self._episode_lock:
      return self._episodes.get(episode_id)

  def close(self) -> None:
    """Requests still waiting get an answer, so the server's handlers end before it stops."""
    with self._episode_lock:
      for ep in self._episodes.values():
        ep.finished = True
        if ep.turn is not None:
          ep.turn.post(("error", RequestError(503, "the run is stopping", "shutting_down")))
    self._runner.close()
    self.server.stop()

  # ------------------------------------------------------------------ requests (server thread)

  def submit(self, episode_id: str, text: str, *, add_special_tokens: bool, max_tokens: int,
             stops: tuple[str, ...], post: Callable[[tuple], None], stream: bool) -> Turn:
    """Accepts a request of `episode_id` rendering to `text`, or raises RequestError (nothing recorded)."""
    with self._episode_lock:
      ep = self._episodes.get(episode_id)
      if ep is None:
        raise RequestError(404, f"unknown episode id {episode_id!r}: ids are given to the agent function and "
                           "live until the episode's group is trained", "episode_not_found")
      if ep.finished:
        raise RequestError(409, f"episode {episode_id!r} is over ({ep.finish_reason})", "episode_finished")
      if ep.turn is not None:
        raise RequestError(409, f"episode {episode_id!r} already has a request in flight: an episode is one "
                           "conversation, one request at a time", "request_in_flight")
      if ep.turns >= self.agent_config.max_turns:
        raise RequestError(400, f"episode {episode_id!r} used all its rl.env_max_turns="
                           f"{self.agent_config.max_turns} requests", "turn_limit")
      ext = ep.recording.extend(text, add_special_tokens=add_special_tokens)
      limit = self.engine.max_prefill_length
      if not ext.ids:
        raise RequestError(400, "the prompt is empty", "empty_prompt")
      if len(ext.ids) > limit:
        raise RequestError(400, f"the conversation is {len(ext.ids)} tokens, over the sampler's "
                           f"max_prefill_length={limit}", "context_length_exceeded")
      if min(ext.ids) < 0 or max(ext.ids) >= self.engine.vocab_size:
        raise RequestError(400, f"the prompt has token ids outside [0, {self.engine.vocab_size})")
      ep.recording.commit(ext, self.driver.version)
      if ext.split:
        self.stats.history_edits += 1
        ep.counts["history_edits"] += 1
      turn = Turn(ep, ep.turns, np.asarray(ext.ids, np.int32), max_tokens, stops, post, stream)
      ep.turns += 1
      ep.turn = turn
      self.stats.requests += 1
    self._inbox.put(turn)
    return turn

  def cancel(self, turn: Turn) -> None:
    """The client went away (server thread): the driver frees its slot and aborts its episode."""
    turn.cancelled = True
    self._cancels.put(turn)

  def post_reward(self, episode_id: str, reward) -> None:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
      raise RequestError(400, f"reward must be a finite number, got {reward!r}")
    with self._episode_lock:
      ep = self._episodes.get(episode_id)
      if ep is None:
        raise RequestError(404, f"unknown episode id {episode_id!r}", "episode_not_found")
      if ep.finished:
        raise RequestError(409, f"episode {episode_id!r} is over: post its reward before the agent function "
                           "returns", "episode_finished")
      if ep.reward is not None:
        raise RequestError(409, f"episode {episode_id!r} already has a reward ({ep.reward:g})", "reward_posted")
      ep.reward = float(reward)

  def count_clamped(self, episode_id: str) -> None:
    with self._episode_lock:
      self.stats.clamped_requests += 1
      ep = self._episodes.get(episode_id)
      if ep is not None:
        ep.counts["clamped_requests"] += 1

  # ------------------------------------------------------------------ one step (driver thread)

  def prepare(self) -> None:
    self._take_cancels()
    self._poll_agents()
    self._start_groups()

  def _take_cancels(self) -> None:
    while True:
      try:
        turn = self._cancels.get_nowait()
      except queue.Empty:
        return
      if not turn.episode.finished and turn.episode.turn is turn:
        self.stats.disconnects += 1
        turn.episode.counts["disconnects"] += 1
        self._abort(turn.episode, RequestError(499, "the client disconnected"))

  def _poll_agents(self) -> None:
    for ticket, value, error in self._runner.poll():
      ep = self._tickets.pop(ticket, None)
      if ep is None or ep.finished:
        continue
      if error is None and value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
          error = TypeError(f"the agent function returned {value!r}: return None or a finite reward")
        else:
          ep.returned = float(value)
      if error is None:
        self._finish_episode(ep, ep.finish_reason)
        continue
      if isinstance(error, EnvTimeout):
        self.stats.timeouts += 1
        ep.counts["timeouts"] += 1
      else:
        self.stats.agent_errors += 1
        ep.counts["errors"] += 1
        _log.warning("agent episode %s failed: %r", ep.id, error)
      self._abort(ep, error)

  def _start_groups(self) -> None:
    d, g = self.driver, self.config.group_size
    while self._live_episodes + g <= max(self.agent_config.workers, g):
      group = d.admission.admit(d.version, self._new_group)
      if group is None:
        return
      encode = lambda text, special: self.tokenizer.encode(text, add_special_tokens=special)
      with self._episode_lock:
        for i in range(g):
          # Unguessable (128 random bits), so a request cannot name a live episode it was not given;
          # the suffix is the episode's index in its group.
          ep = AgentEpisode(id=f"{secrets.token_hex(16)}-{i}", group=group, index=i, recording=Recording(encode))
          group.episodes.append(ep)
          self._episodes[ep.id] = ep
      for ep in group.episodes:
        self._live_episodes += 1
        self._tickets[self._runner.submit(self._agent, self.base_url, self.api_key, ep.id, dict(group.record))] = ep

  def _new_group(self, seq: int, request: PromptRequest, ids: np.ndarray) -> _AgentGroup:
    record = dict(request.columns)
    record.setdefault("prompt_id", request.prompt_id)
    record.setdefault("prompt_text", request.prompt_text)
    return _AgentGroup(seq=seq, request=request, record=record, version=self.driver.version)

  def requeue(self, info: Turn) -> None:
    """A paged cache preempted the turn: agent turns are not resumed, its episode ends (aborted)."""
    self._abort(info.episode, RequestError(503, "the sampler's paged cache ran out of blocks mid-answer",
                                           "preempted"))

  def refill(self, free: list[int]) -> None:
    """Waiting turns into free slots; turns with the same prompt (the G episodes' first requests
    usually are) share one prefill and one insert call."""
    batches: dict[tuple[bytes, int], list[Turn]] = {}
    taken = 0
    while taken < len(free):
      try:
        turn = self._inbox.get_nowait()
      except queue.Empty:
        break
      if not (turn.cancelled or turn.episode.finished):
        batches.setdefault((turn.prompt_ids.tobytes(), turn.max_new), []).append(turn)
        taken += 1
    d = self.driver
    for (ids, max_new), turns in batches.items():
      t0 = time.perf_counter()
      key = (ids, d.version)
      prefix = self._prefixes.get(key)
      if prefix is None:
        with d.tracer.span("prefill", cat="sampler", version=d.version):
          prefix = self.engine.prefill(d.params, turns[0].prompt_ids, version=d.version)
        self.stats.prefills += 1
        self._prefixes[key] = prefix
        if len(self._prefixes) > _PREFIXES:
          self._prefixes.popitem(last=False)
      slots = [free.pop(0) for _ in turns]
      noise = [d.keys.group(t.episode.group.seq)[t.episode.index, t.number] for t in turns]
      d.slots.state = self.engine.bulk_insert(prefix, d.slots.state, slots, keys=noise, max_new_tokens=max_new)
      self.stats.busy_time_s += time.perf_counter() - t0
      for slot, turn in zip(slots, turns):
        d.slots[slot] = turn

  # ------------------------------------------------------------------ results (driver thread)

  def record(self, info: Turn, token: int, logprob: float, version: int, mask) -> None:
    info.tokens.append(token)
    info.logprobs.append(logprob)
    info.versions.append(version)

  def stop_reason(self, info: Turn, token: int, eos: set[int]) -> str | None:
    if token in eos:
      return "eos"
    if info.stops and any(s in self._content(info) for s in info.stops):
      return "stop"
    if len(info.tokens) >= info.max_new:
      return "length"
    return None

  def collected(self) -> None:
    for turn in self.driver.slots:  # what live streaming turns decoded in this call
      if turn is not None and turn.stream:
        self._stream(turn, final=False)

  def _content(self, turn: Turn) -> str:
    """The answer's text as the API returns it: every sampled token written out, special tokens too,
    so an agent that keeps it in its history extends its chain (dropping a special token the model
    sampled mid-answer would split the episode); only a final EOS is left out, which the chat
    template puts back after the assistant message."""
    tokens = turn.tokens[:-1] if turn.tokens and turn.tokens[-1] in self.config.eos_ids else turn.tokens
    return self.tokenizer.decode(tokens, skip_special_tokens=False)

  def _stream(self, turn: Turn, final: bool) -> str:
    """Sends the new part of `turn`'s content; held back: what a stop string might still cut."""
    text = self._content(turn)
    if final:
      cut = [text.find(s) for s in turn.stops if s in text]
      safe = text[:min(cut)] if cut else text
    else:
      hold = max((len(s) - 1 for s in turn.stops), default=0)
      safe = text[:len(text) - hold] if hold else text
      safe = safe.rstrip("\ufffd")  # an incomplete multi-byte character
    if turn.stream and len(safe) > turn.sent:
      turn.post(("delta", safe[turn.sent:]))
    turn.sent = max(turn.sent, len(safe))
    return safe

  def finish(self, slot: int, info: Turn, reason: str) -> None:
    turn, ep = info, info.episode
    text = self._stream(turn, final=True)
    self.stats.tokens_generated += len(turn.tokens)
    self.stats.completions += 1
    with self._episode_lock:
      ep.recording.current.sample(turn.tokens, turn.logprobs, turn.versions,
                                  self.tokenizer.decode(turn.tokens, skip_special_tokens=False))
      ep.turn = None
      ep.finish_reason = reason
    turn.post(("done", TurnResult(text=text, full_text=self._content(turn),
                                  finish_reason="length" if reason == "length" else "stop",
                                  prompt_tokens=len(turn.prompt_ids), token_ids=list(turn.tokens),
                                  logprobs=list(turn.logprobs))))

  def _abort(self, ep: AgentEpisode, error: BaseException) -> None:
    """Ends `ep` now: its request in flight (if any) leaves its slot and is answered with an error."""
    turn = ep.turn
    if turn is not None:
      for slot, info in enumerate(self.driver.slots):
        if info is turn:
          self.driver.slots.release(slot)
      status = error.status if isinstance(error, RequestError) else 408 if isinstance(error, EnvTimeout) else 500
      turn.post(("error", RequestError(status, f"episode {ep.id!r} was aborted: {error}", "episode_aborted")))
    self._finish_episode(ep, "aborted")

  def _finish_episode(self, ep: AgentEpisode, reason: str) -> None:
    with self._episode_lock:
      ep.finished, ep.turn = True, None
      ep.finish_reason = reason
    self._live_episodes -= 1
    self.stats.episodes += 1
    self.stats.aborted_episodes += reason == "aborted"
    group = ep.group
    if all(e.finished for e in group.episodes):
      self._emit_group(group)

  def _emit_group(self, group: _AgentGroup) -> None:
    """The G episodes as one group: each its last chain after the prompt their chains share."""
    chains = [ep.recording.current for ep in group.episodes]
    ref = next((c for c in chains if c is not None), None)
    if ref is None:
      raise DriverError(f"every episode of prompt {group.request.prompt_id!r} ended before its first request: "
                        "check that the agent function (rl.agent) sends its episode id to the server")
    chains = [c if c is not None and c.prompt_ids[:1] == ref.prompt_ids[:1] else None for c in chains]
    shared = min(_common_prefix(c.prompt_ids, ref.prompt_ids) for c in chains if c is not None)
    completions = []
    for ep, c in zip(group.episodes, chains):
      if c is None:
        if ep.recording.current is not None:  # its conversation shares not even a first token with the others
          ep.counts["prompt_mismatch"] += 1
        completions.append(Completion(np.zeros((0,), np.int32), np.zeros((0,), np.float32),
                                      np.zeros((0,), np.int32), "aborted", np.zeros((0,), np.int32), text=""))
        continue
      head = c.prompt_ids[shared:]
      ids = head + c.tokens
      finish = ep.finish_reason if ep.finish_reason in ("eos", "stop", "length", "aborted") else "stop"
      completions.append(Completion(
          token_ids=np.asarray(ids, np.int32),
          logprobs=np.asarray([0.0] * len(head) + c.logprobs, np.float32),
          policy_versions=np.asarray([c.version] * len(head) + c.versions, np.int32),
          finish_reason=finish, loss_mask=np.asarray([0] * len(head) + c.loss_mask, np.int32),
          text=self.tokenizer.decode(ids)))
    given = [ep.reward if ep.reward is not None else ep.returned for ep in group.episodes]
    rewards = None
    if any(r is not None for r in given):  # the agent gives rewards: an episode without one gets failure_reward
      for ep, r in zip(group.episodes, given):
        ep.counts["no_reward"] += r is None
      rewards = np.asarray([self.agent_config.failure_reward if r is None else r for r in given], np.float32)
    metrics = {}
    for name in ("history_edits", "clamped_requests", "timeouts", "disconnects", "errors", "no_reward",
                 "prompt_mismatch"):
      metrics[f"agent/{name}"] = float(np.mean([ep.counts[name] for ep in group.episodes]))
    metrics["agent/turns"] = float(np.mean([ep.turns for ep in group.episodes]))
    metrics["agent/aborted"] = float(np.mean([ep.finish_reason == "aborted" for ep in group.episodes]))
    with self._episode_lock:
      for ep in group.episodes:
        del self._episodes[ep.id]
    self.driver.admission.done(group.seq)
    req = group.request
    self.driver.emit(RolloutGroup(prompt_id=req.prompt_id,
                                  prompt_token_ids=np.asarray(ref.prompt_ids[:shared], np.int32),
                                  completions=completions, columns=dict(req.columns), prompt_text=req.prompt_text,
                                  rewards=rewards, reward_metrics=metrics, start_version=group.version))


class AgentDriver(RolloutDriver):
  """A `RolloutDriver` of G agent episodes per prompt (`AgentEpisodes`), served by an
  OpenAI-compatible server; see the module docstring."""

  def __init__(self, engine: EngineAPI, params, *, source: Iterable[PromptRequest | None], sink,
               agent: Callable[..., Any], tokenizer, agent_config: AgentConfig, version: int = 0,
               may_start_group: Callable[[int], bool] | None = None, tracer=None, model_name: str = "policy"):
    """`agent(base_url, api_key, episode_id, row)` runs one episode against `base_url` (its OpenAI
    base URL), sending `api_key` with every request."""
    episodes = AgentEpisodes(agent, tokenizer, agent_config, model_name)
    super().__init__(engine, params, source=source, sink=sink, version=version, may_start_group=may_start_group,
                     detokenize=tokenizer.decode, episodes=episodes, **({} if tracer is None else {"tracer": tracer}))
    self.agent_config, self.tokenizer, self.model_name = agent_config, tokenizer, model_name
    self.server, self.api_key, self.base_url = episodes.server, episodes.api_key, episodes.base_url

  def episode(self, episode_id: str) -> AgentEpisode | None:
    return self.episodes.episode(episode_id)
