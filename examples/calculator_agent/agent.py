"""A tool-using agent with its own loop, written with the official `openai` client (docs/agents.md).

The policy is asked the task's question ("12+34=", answered least-significant digit first). It can
answer, or call the calculator by writing `calc(EXPR)`: the agent runs the tool and sends the result
back as a tool message, until the policy answers or the turns run out. The agent grades the final
answer itself and posts the reward. Nothing here knows about tunixlike except the key and the
episode id it sends with every request and the reward it posts.
"""

import re

import httpx
from openai import OpenAI

from tunixlike.rewards.envs.calculator import CalculatorError, calculate, format_number

MAX_TURNS = 3  # = rl.env_max_turns in config.py
CALL = re.compile(r"calc\((.+)\)")


def run_episode(base_url: str, api_key: str, episode_id: str, row: dict) -> None:
  client = OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Episode-Id": episode_id}, max_retries=0)
  messages = [{"role": "user", "content": row["prompt_text"]}]
  answer = ""
  for _ in range(MAX_TURNS):
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    answer = reply.choices[0].message.content
    messages.append({"role": "assistant", "content": answer})
    call = CALL.fullmatch(answer.strip())
    if call is None:  # a final answer
      break
    try:
      result = format_number(calculate(call.group(1)))
    except CalculatorError as e:  # the policy sees the error and can try again
      result = f"error: {e}"
    messages.append({"role": "tool", "content": f"={result}\n"})
  reward = 1.0 if answer.strip() == row["answer"] else 0.0
  httpx.post(f"{base_url}/episodes/{episode_id}/reward", json={"reward": reward},
             headers={"Authorization": f"Bearer {api_key}"}).raise_for_status()
