"""An OpenAI-compatible server on the sampler, so agents written with any framework can be trained.

    GET  /v1/models                         the one model served: the policy being trained
    POST /v1/chat/completions               messages -> the policy's next turn (stream or not)
    POST /v1/completions                    a text prompt -> its continuation (stream or not)
    POST /v1/episodes/{episode_id}/reward   {"reward": 1.0}: the episode's reward (once)

Starlette on uvicorn, in a thread of the training process; the requests are served by the run's
`AgentDriver`, on the same decode slots as everything else. Every request names its episode: the
`X-Episode-Id` header, or the body's `metadata.episode_id` or `user` field.

Only the run's own agents are admitted: every request on every path must carry the run's key
(`Authorization: Bearer KEY`, which the OpenAI client sends as its `api_key`), compared in constant
time, or it is answered 401 before its body is read; episode ids are random (128 bits), so even a
holder of the key cannot guess a live one. A body over `max_body_bytes` is answered 413. A client
that disconnects before its request is read is counted and logged in one line. A body that is not JSON
(malformed, a number past float64's range or over Python's 4,300 digits, nesting deeper than the parser
recurses) is answered 400 `invalid_json`, counted and logged in one line.

Connections are bounded (`connections.py`): at most `max_connections` open, the ones that never sent
the key closed first, each closed `header_timeout_s` after it opened unless it sent the key by then,
and `idle_timeout_s` after its last answer (uvicorn's keep-alive); the limit must fit in half the
process's file descriptors, so a flood of idle sockets cannot reach the trainer's files.

Sampling: the learner corrects only for the run's own sampling distribution (`sampler.temperature`,
`top_p`), so a request asking for another one is served at the run's and counted (clamped, and the
response carries the header `X-Tunixlike-Clamped`); so is a `max_tokens` over `sampler.max_new_tokens`.
`stop` strings are honoured and, as OpenAI does, left out of the returned text unless the request
sets vLLM's `include_stop_str_in_output`. One choice per request (`n` = 1): a GRPO group is G episodes.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
import time
import uuid
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tunixlike.agents.chains import PLAIN_CHAT_TEMPLATE
from tunixlike.agents.connections import ConnectionLimit, backlog, fd_budget_error
from tunixlike.agents.protocol import EpisodeBackend, RequestError, TurnResult
from tunixlike.data import chat_template

EPISODE_HEADER = "x-episode-id"
CLAMPED_HEADER = "x-tunixlike-clamped"
_ROLES = ("system", "developer", "user", "assistant", "tool")
START_TIMEOUT_S = 30.0  # uvicorn binds an open socket: it starts in milliseconds unless something is wrong

_log = logging.getLogger(__name__)


def _error(status: int, message: str, code: str = "invalid_request_error") -> JSONResponse:
  kind = "invalid_request_error" if status < 500 else "server_error"
  return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": None}}, status_code=status)


class _Gone(Exception):
  """The client disconnected."""


class _Guard:
  """ASGI middleware in front of every route: a request without the run's key gets 401 (its body
  unread); a body announced over the limit gets 413; a client gone before its request was read is
  one counted log line, not an 'Exception in ASGI application' traceback."""

  def __init__(self, app, *, server: "AgentServer"):
    self.app, self.server = app, server

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope["headers"])
    server = self.server
    if not hmac.compare_digest(headers.get(b"authorization", b""), server._authorization):
      server.driver.stats.unauthorized_requests += 1
      refused = _error(401, "missing or wrong API key: send the key the agent function was given as the OpenAI "
                       "client's api_key (Authorization: Bearer KEY)", "invalid_api_key")
      refused.headers["connection"] = "close"  # a client without the key keeps no connection
      return await refused(scope, receive, send)
    length = headers.get(b"content-length", b"0")
    if length.isdigit() and int(length) > server.max_body_bytes:
      server.driver.stats.refused_requests += 1
      return await _error(413, f"the request body ({length.decode(errors='replace')} bytes) is over "
                          f"rl.agent_max_body_bytes={server.max_body_bytes}", "request_too_large")(scope, receive, send)
    server.connections.request_started(scope.get("client"))
    try:
      await self.app(scope, receive, send)
    except ClientDisconnect:
      server.driver.stats.dropped_requests += 1
      _log.warning("agent server: a client disconnected before its request was read (%d so far)",
                   server.driver.stats.dropped_requests)
    finally:
      server.connections.request_ended(scope.get("client"))


async def _disconnected(request: Request) -> None:
  """Returns when the client goes away. Once the body is read, the server's `receive` blocks until
  then (or until the response is sent), so a waiting request costs nothing until it is answered."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def _next(events: asyncio.Queue, gone: asyncio.Task):
  """The driver's next event for this request, or _Gone if the client left first."""
  if not events.empty():
    return events.get_nowait()
  get = asyncio.ensure_future(events.get())
  await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
  if get.done():
    return get.result()
  get.cancel()
  raise _Gone()


def is_loopback(host: str) -> bool:
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return host == "localhost"


_F64_MAX = int(sys.float_info.max)


def _no_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise ValueError(f"the number {text[:40]} is past float64's range")
  return value


def _float_sized_int(text: str) -> int:
  """An int that converts to a float: the numbers of a request (rewards, temperatures, token counts)
  are all used as floats or compared with them, and a 400-digit integer would overflow there."""
  digits = len(text.lstrip("-"))
  if digits <= 309:  # longer ones are past float64's 1.8e308 (and int() refuses over 4,300 digits)
    value = int(text)
    if abs(value) <= _F64_MAX:
      return value
  raise ValueError(f"the integer {text[:12]}... ({digits} digits) is past float64's range")


def parse_json(raw: bytes):
  """The request body as JSON, or ValueError with the reason (RecursionError for nesting too deep
  for the parser is one too, as are NaN, Infinity and numbers no float holds)."""
  try:
    return json.loads(raw, parse_int=_float_sized_int, parse_float=_finite_float, parse_constant=_no_constant)
  except RecursionError:
    raise ValueError("it nests arrays or objects deeper than the parser recurses") from None


class AgentServer:
  """Serves an `AgentDriver` on `host`:`port` (0 = a free port) from a daemon thread, to requests
  that carry `api_key` and bodies of at most `max_body_bytes`, over at most `max_connections`
  connections (module docstring)."""

  def __init__(self, driver: EpisodeBackend, *, api_key: str, host: str, port: int, max_body_bytes: int,
               max_connections: int, header_timeout_s: float, idle_timeout_s: float):
    error = fd_budget_error(max_connections)
    if error:
      raise ValueError(error)
    self.driver = driver
    self._authorization = f"Bearer {api_key}".encode()
    self.max_body_bytes = max_body_bytes
    cfg = driver.engine.config
    self._temperature, self._top_p, self._max_new = cfg.sampling.temperature, cfg.top_p, cfg.max_new_tokens
    tok = driver.tokenizer
    self._template = tok.chat_template or PLAIN_CHAT_TEMPLATE
    self._special = {k: v for k, v in tok.special_tokens.items() if v is not None}
    routes = [Route("/v1/models", self.models, methods=["GET"]),
              Route("/v1/chat/completions", self.chat, methods=["POST"]),
              Route("/v1/completions", self.completions, methods=["POST"]),
              Route("/v1/episodes/{episode_id}/reward", self.reward, methods=["POST"])]
    self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error},
                         middleware=[Middleware(_Guard, server=self)])
    self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      self._sock.bind((host, port))
    except OSError as e:
      self._sock.close()
      raise ValueError(f"rl.agent_port={port}: cannot listen on {host}:{port}: {e}") from e
    self.port = self._sock.getsockname()[1]
    self.base_url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"
    self.connections = ConnectionLimit(max_connections=max_connections, header_timeout_s=header_timeout_s,
                                       on_close=self._count_closed)
    self._server = uvicorn.Server(uvicorn.Config(
        self.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1, ws="none",
        http=self.connections.protocol(AutoHTTPProtocol), backlog=backlog(max_connections),
        timeout_keep_alive=idle_timeout_s))
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                    name="agent-server", daemon=True)
    self._thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the agent server did not start on {self.base_url}")
      time.sleep(0.01)

  def _count_closed(self, reason: str) -> None:
    self.driver.stats.closed_connections += 1

  def stop(self) -> None:
    self._server.should_exit = True
    if self._thread is not None:
      self._thread.join(10)
    self._sock.close()

  # ------------------------------------------------------------------ endpoints

  async def models(self, request: Request):
    return JSONResponse({"object": "list", "data": [{"id": self.driver.model_name, "object": "model",
                                                     "created": 0, "owned_by": "tunixlike"}]})

  async def chat(self, request: Request):
    try:
      body, episode_id = await self._parse(request)
      messages = body.get("messages")
      if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects")
      messages = [self._message(i, m) for i, m in enumerate(messages)]
      variables = dict(self._special)
      if body.get("tools") is not None:
        variables["tools"] = body["tools"]
      try:
        text = chat_template.render(self._template, messages, add_generation_prompt=True, **variables)
      except Exception as e:  # the template is the model's code: its message is the user's best clue
        raise RequestError(400, f"the chat template cannot render these messages: {e}") from None
    except RequestError as e:
      return self._refuse(e)
    return await self._serve(request, body, episode_id, text, chat=True)

  async def completions(self, request: Request):
    try:
      body, episode_id = await self._parse(request)
      prompt = body.get("prompt")
      if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
      if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "'prompt' must be a non-empty string (one prompt per request)")
    except RequestError as e:
      return self._refuse(e)
    return await self._serve(request, body, episode_id, prompt, chat=False)

  async def reward(self, request: Request):
    try:
      body = await self._body(request)
      if "reward" not in body:
        raise RequestError(400, "the body must be {\"reward\": <number>}")
      self.driver.post_reward(request.path_params["episode_id"], body["reward"])
    except RequestError as e:
      return self._refuse(e)
    return JSONResponse({"episode_id": request.path_params["episode_id"], "reward": float(body["reward"])})

  async def _http_error(self, request: Request, exc: HTTPException):
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "not_found"
                  if exc.status_code == 404 else "invalid_request_error")

  # ------------------------------------------------------------------ parsing

  def _refuse(self, e: RequestError) -> JSONResponse:
    self.driver.stats.refused_requests += 1
    return _error(e.status, e.message, e.code)

  async def _body(self, request: Request) -> dict[str, Any]:
    raw = bytearray()
    async for chunk in request.stream():  # a body sent without its length is cut at the limit too
      raw += chunk
      if len(raw) > self.max_body_bytes:
        raise RequestError(413, f"the request body is over rl.agent_max_body_bytes={self.max_body_bytes}",
                           "request_too_large")
    try:
      body = parse_json(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError among them
      self.driver.stats.invalid_json += 1
      _log.warning("agent server: refused a request body that is not valid JSON (%s; %d so far)", str(e)[:200],
                   self.driver.stats.invalid_json)
      raise RequestError(400, f"the request body is not valid JSON: {str(e)[:200]}", "invalid_json") from None
    if not isinstance(body, dict):
      raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
    return body

  async def _parse(self, request: Request) -> tuple[dict[str, Any], str]:
    body = await self._body(request)
    model = body.get("model")
    if model != self.driver.model_name:
      raise RequestError(404, f"model {model!r} does not exist: this server serves {self.driver.model_name!r}",
                         "model_not_found")
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    episode_id = request.headers.get(EPISODE_HEADER) or metadata.get("episode_id") or body.get("user")
    if not isinstance(episode_id, str) or not episode_id:
      raise RequestError(400, "no episode id: send the header X-Episode-Id (or metadata.episode_id, or user) with "
                         "the id the agent function was given", "missing_episode_id")
    if body.get("n", 1) != 1:
      raise RequestError(400, f"n={body.get('n')!r}: one choice per request (a GRPO group is G episodes)")
    return body, episode_id

  @staticmethod
  def _message(i: int, m) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
      raise RequestError(400, f"messages[{i}] must be an object with a role in {list(_ROLES)}, got {m!r:.120}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is supported
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise RequestError(400, f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                           "supported")
      content = "".join(p["text"] for p in content)
    if content is None:
      content = ""
    if not isinstance(content, str):
      raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts")
    return {**m, "content": content}

  def _sampling(self, body: dict[str, Any]) -> tuple[int, tuple[str, ...], list[str]]:
    """max_tokens, stop strings, and the names of settings served at the run's value instead."""
    clamped = []
    for name, run_value in (("temperature", self._temperature), ("top_p", self._top_p)):
      value = body.get(name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"{name}={value!r} must be a number")
      if not math.isclose(value, run_value, abs_tol=1e-6):
        clamped.append(name)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
      max_tokens = self._max_new
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
      raise RequestError(400, f"max_tokens={max_tokens!r} must be an integer >= 1")
    if max_tokens > self._max_new:
      clamped.append("max_tokens")
      max_tokens = self._max_new
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
      raise RequestError(400, f"stop={stop!r} must be a string or a list of up to 4 non-empty strings")
    return max_tokens, tuple(stops), clamped

  # ------------------------------------------------------------------ serving

  async def _serve(self, request: Request, body: dict[str, Any], episode_id: str, text: str, *, chat: bool):
    stream = bool(body.get("stream", False))
    try:
      max_tokens, stops, clamped = self._sampling(body)
      loop = asyncio.get_running_loop()
      events: asyncio.Queue = asyncio.Queue()
      post = lambda item: loop.call_soon_threadsafe(events.put_nowait, item)
      turn = self.driver.submit(episode_id, text, add_special_tokens=not chat, max_tokens=max_tokens, stops=stops,
                                post=post, stream=stream)
    except RequestError as e:
      return self._refuse(e)
    if clamped:
      self.driver.count_clamped(episode_id)
    headers = {CLAMPED_HEADER: ",".join(clamped)} if clamped else {}
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    keep_stop = bool(body.get("include_stop_str_in_output", False))
    want_logprobs = bool(body.get("logprobs"))
    gone = asyncio.ensure_future(_disconnected(request))
    if not stream:
      try:
        while True:
          kind, value = await _next(events, gone)
          if kind == "done":
            return JSONResponse(self._response(rid, value, chat, keep_stop, want_logprobs), headers=headers)
          if kind == "error":
            return _error(value.status, value.message, value.code)
      except _Gone:
        self.driver.cancel(turn)
        return _error(499, "client disconnected")
      finally:
        gone.cancel()
    return StreamingResponse(self._chunks(rid, turn, events, gone, chat, keep_stop),
                             media_type="text/event-stream", headers=headers)

  def _response(self, rid: str, result: TurnResult, chat: bool, keep_stop: bool, want_logprobs: bool) -> dict:
    text = self._text(result, keep_stop)
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
             "total_tokens": result.prompt_tokens + len(result.token_ids)}
    logprobs = None
    if want_logprobs:
      texts = [self.driver.tokenizer.decode([t], skip_special_tokens=False) for t in result.token_ids]
      content = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                 for t, lp in zip(texts, result.logprobs)]
      logprobs = {"content": content} if chat else {"tokens": texts, "token_logprobs": result.logprobs}
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": result.finish_reason,
               "logprobs": logprobs} if chat else
              {"index": 0, "text": text, "finish_reason": result.finish_reason, "logprobs": logprobs})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.driver.model_name, "choices": [choice], "usage": usage}

  @staticmethod
  def _text(result: TurnResult, keep_stop: bool) -> str:
    if not keep_stop or result.finish_reason != "stop":
      return result.text
    return result.full_text

  def _chunk(self, rid: str, chat: bool, text: str | None, finish: str | None, role: bool = False) -> str:
    if chat:
      delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
      choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
      choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": self.driver.model_name, "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n"

  async def _chunks(self, rid, turn, events, gone: asyncio.Task, chat: bool, keep_stop: bool):
    finished = False
    try:
      if chat:
        yield self._chunk(rid, chat, None, None, role=True)
      while True:
        kind, value = await _next(events, gone)
        if kind == "delta":
          yield self._chunk(rid, chat, value, None)
        elif kind == "done":
          finished = True
          tail = value.full_text[len(value.text):] if keep_stop and value.finish_reason == "stop" else ""
          if tail:
            yield self._chunk(rid, chat, tail, None)
          yield self._chunk(rid, chat, None, value.finish_reason)
          yield "data: [DONE]\n\n"
          return
        else:
          finished = True
          error = {"error": {"message": value.message, "type": "invalid_request_error", "code": value.code}}
          yield f"data: {json.dumps(error)}\n\n"
          return
    finally:
      gone.cancel()
      if not finished:  # the client went away (or the stream was cancelled): free its slot, abort the episode
        self.driver.cancel(turn)
