"""The tool-call format the policy writes and the parser that reads it.

Format (the Hermes / Qwen2.5 convention, which instruct models already know from their chat templates):

    <tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call>

and the environment answers with

    <tool_response>14</tool_response>

`</tool_call>` is the turn's stop string, so a turn ends right after the call. A turn without
`<tool_call>` is a final answer. Only the first call of a turn is read. Anything malformed (no
closing tag, invalid JSON, not an object, missing or non-string name, arguments not an object,
too long) is a `ToolCall` with `error` set: the environment answers with the error text and a
penalty, it never raises.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
MAX_CALL_CHARS = 2000  # a call longer than this is an error, not something to json-parse


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str | None
  arguments: dict[str, Any]
  error: str | None = None  # set when the call is malformed; name / arguments are then unreliable


def parse_tool_call(text: str) -> ToolCall | None:
  """The first tool call in `text`, None if there is none (a final answer), or a ToolCall with `error`."""
  start = text.find(CALL_OPEN)
  if start < 0:
    return None
  body_start = start + len(CALL_OPEN)
  end = text.find(CALL_CLOSE, body_start)
  if end < 0:
    return _error(f"malformed tool call: missing {CALL_CLOSE}")
  body = text[body_start:end].strip()
  if len(body) > MAX_CALL_CHARS:
    return _error(f"malformed tool call: {len(body)} characters > {MAX_CALL_CHARS}")
  try:
    obj = json.loads(body)
  except (json.JSONDecodeError, RecursionError) as e:
    return _error(f"malformed tool call: invalid JSON ({e.msg if hasattr(e, 'msg') else e})")
  if not isinstance(obj, dict):
    return _error(f"malformed tool call: expected a JSON object, got {type(obj).__name__}")
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return _error('malformed tool call: "name" must be a non-empty string')
  arguments = obj.get("arguments", {})
  if not isinstance(arguments, dict):
    return ToolCall(name, {}, '"arguments" must be a JSON object')
  return ToolCall(name, arguments)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
  return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def format_tool_response(text: str) -> str:
  return f"{RESPONSE_OPEN}{text}{RESPONSE_CLOSE}"


def _error(message: str) -> ToolCall:
  return ToolCall(None, {}, message)
