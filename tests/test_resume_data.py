"""A resume checks the data by content: a changed data file is refused with one line naming it, or,
with data.allow_change, the prompt stream starts again on the new data (never a re-carved split)."""

import json
import os

import pytest

import tunixlike
from tunixlike.rl.trainer import SetupError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "addition_grpo.py:size=tiny")
FAST = {"rl.prompts_per_step": 4, "warm_start.max_steps": 0, "data.num_eval_examples": 8, "log.progress_bar": False,
        "log.tensorboard": False, "data.task": None, "data.prompt_field": "question",
        "rewards": ({"fn": "stopped"},)}


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(n):
  return [{"question": f"{a}+{b}=", "total": a + b} for a in range(1, 30) for b in range(1, 30)][:n]


def test_changed_data_is_refused_or_restarts_the_stream_when_allowed(tmp_path):
  train, held_out, workdir = tmp_path / "train.jsonl", tmp_path / "eval.jsonl", str(tmp_path / "run")
  _write(train, _rows(400))
  cfg = lambda steps, **kw: tunixlike.load_config(TINY, {**FAST, "rl.num_steps": steps, "data.train": str(train),
                                                         **kw})
  tunixlike.train(cfg(1), workdir)
  _write(train, _rows(400)[::-1][:150])  # shuffled and cut, at the same path
  size = train.stat().st_size
  with pytest.raises(SetupError, match=rf"trained on other data: data.train: {train} changed \(.* -> {size:,} bytes\)"
                                       r".*set data.allow_change=true"):
    tunixlike.train(cfg(2), workdir)
  # Allowed, but the held-out split is carved from data.train: it would change under the run.
  with pytest.raises(SetupError, match=r"held-out split is carved from it.*Give a fixed held-out file \(data.eval\)"):
    tunixlike.train(cfg(2, **{"data.allow_change": True}), workdir)

  # With a fixed held-out file: data.train may change, and the stream starts again on the new rows.
  workdir = str(tmp_path / "run2")
  _write(train, _rows(400))
  _write(held_out, _rows(800)[-8:])
  tunixlike.train(cfg(1, **{"data.eval": str(held_out)}), workdir)
  _write(train, _rows(150))
  summary = tunixlike.train(cfg(2, **{"data.eval": str(held_out), "data.allow_change": True}), workdir)
  assert summary["groups_regenerated"] == 0
  prompts = [json.loads(line) for line in open(os.path.join(workdir, "prompts.jsonl"))]
  assert [p["step"] for p in prompts] == [0, 1]
  assert min(prompts[1]["trained"]) == 0  # the new data's stream, from its start
  # And the held-out file itself may not change silently either.
  _write(held_out, _rows(800)[-9:])
  with pytest.raises(SetupError, match=rf"data.eval: {held_out} changed"):
    tunixlike.train(cfg(3, **{"data.eval": str(held_out)}), workdir)
