import pytest

from tunixlike.rewards.envs import format_tool_call, parse_tool_call


def test_well_formed_call_is_parsed():
  text = 'Let me compute. ' + format_tool_call("calculator", {"expression": "2+3*4"}) + " trailing"
  call = parse_tool_call(text)
  assert call.error is None and call.name == "calculator" and call.arguments == {"expression": "2+3*4"}


def test_first_call_wins_and_missing_arguments_is_empty():
  text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
  call = parse_tool_call(text)
  assert call.error is None and call.name == "a" and call.arguments == {}


def test_no_call_is_a_final_answer():
  assert parse_tool_call("The answer is 14.") is None
  assert parse_tool_call("") is None


@pytest.mark.parametrize("text, fragment", [
    ('<tool_call>{"name": "calculator"', "missing </tool_call>"),
    ("<tool_call>{name: calculator}</tool_call>", "invalid JSON"),
    ('<tool_call>["calculator"]</tool_call>', "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": 3}</tool_call>', '"name"'),
    ('<tool_call>{"name": "c", "arguments": "2+2"}</tool_call>', '"arguments"'),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "characters"),
    ("<tool_call>" + "[" * 1_500 + "]" * 1_500 + "</tool_call>", "characters"),
    ("<tool_call>" + "[" * 999 + "</tool_call>", "JSON"),
])
def test_malformed_calls_return_an_error_never_raise(text, fragment):
  call = parse_tool_call(text)
  assert call is not None and call.error is not None and fragment in call.error
