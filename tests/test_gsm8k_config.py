"""configs/gsm8k_grpo.py:size=tiny end to end: a tiny random HF checkpoint (LoRA on), the GSM8K shipped
with the package."""

import json
import os
import subprocess
import sys

import pytest

from tunixlike.data import char_tokenizer
from tunixlike.models import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gsm8k_tiny_runs_with_lora_from_a_local_hf_checkpoint(tmp_path):
  tok = char_tokenizer.build()
  ckpt = testing.write_random_hf_checkpoint(tmp_path / "hf", arch="qwen2", vocab_size=tok.vocab_size,
                                            max_position_embeddings=1024)
  tok.save(str(ckpt))
  workdir = tmp_path / "run"
  env = dict(os.environ)
  out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config", "configs/gsm8k_grpo.py:size=tiny",
                        f"--config.model.hf_path={ckpt}",
                        "--config.log.progress_bar=false", f"--workdir={workdir}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  records = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [0, 1]
  assert all("rewards/gsm8k_accuracy" in r and "rewards/answer_format" in r for r in steps)
  evals = [r for r in records if "eval/accuracy" in r]
  assert len(evals) == 2 and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
  assert (workdir / "reward.png").stat().st_size > 0
