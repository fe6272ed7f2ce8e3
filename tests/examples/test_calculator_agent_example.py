"""The agent example of docs/agents.md (an `openai`-client agent with its own loop) trained through the CLI."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_calculator_agent_example_trains_a_few_steps_through_the_cli(tmp_path):
  env = {**os.environ}
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config",
                        os.path.join(ROOT, "examples", "calculator_agent", "config.py:size=tiny"),
                        "--config.log.progress_bar=false", "--workdir", str(tmp_path / "run"),
                        # What is checked is the agent's episodes through the server, not what the model
                        # knows: no warm start (20 steps and 5 evals of 64 prompts), 8 held-out prompts.
                        "--config.warm_start.max_steps=0", "--config.data.num_eval_examples=8"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "agent server: http://127.0.0.1:" in out.stdout
  assert "Traceback" not in out.stderr, out.stderr[-3000:]  # the server shut down cleanly
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r for r in records if "agent/turns" in r]
  assert len(steps) == 3
  for r in steps:  # every episode made its requests and posted its reward; nothing was refused or lost
    assert 1.0 <= r["agent/turns"] <= 3.0
    assert r["agent/no_reward"] == 0.0 and r["agent/aborted"] == 0.0 and r["agent/errors"] == 0.0
    assert 0.0 <= r["reward/mean"] <= 1.0
