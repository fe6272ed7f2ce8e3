"""`python -m tunixlike.eval --checkpoint WORKDIR` with no --config, on every kind of run the README and
the docs show: the config comes back from the checkpoint's meta (JSON: lists where the config has
tuples, run values filled in) and the prompts are built exactly as training built them."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tunixlike.data import char_tokenizer, tokenizer
from tunixlike.models import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
SHORT = ["--config.rl.num_steps=1", "--config.rl.prompts_per_step=4", "--config.data.num_eval_examples=8",
         "--config.log.progress_bar=false", "--config.log.tensorboard=false"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def run(module, *args, cwd=ROOT, timeout=600):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                        timeout=timeout)


def _user_task(tmp_path, hf_dir=None):
  """A user's own task in its own directory: a JSONL file, a reward module, a config file."""
  task = tmp_path / "my_task"
  task.mkdir()
  with open(task / "train.jsonl", "w") as f:
    for a in range(1, 12):
      for b in range(1, 12):
        f.write(json.dumps({"question": f"{a}+{b}=", "total": a + b}) + "\n")
  (task / "my_rewards.py").write_text(textwrap.dedent('''
      def reversed_sum(completions, total):
        return [float(c.strip().startswith(str(t)[::-1])) for c, t in zip(completions, total)]
  '''))
  lines = ["from tunixlike import config", "", "def get_config(arg=None):",
           "  c = config.default_config_dict()", "  c.data.task = None", "  c.data.train = './train.jsonl'",
           "  c.data.prompt_field = 'question'",
           "  c.sampler.max_new_tokens = 8  # no answer column to size it from",
           "  c.rewards = [dict(fn='./my_rewards.py:reversed_sum'), dict(fn='stopped', weight=0.1)]"]
  if hf_dir is not None:
    lines += [f"  c.model.hf_path = {str(hf_dir)!r}",
              "  c.data.system_prompt = 'Add.'  # only a chat template uses it: eval must too",
              "  c.data.max_prompt_length = 96", "  c.sampler.max_prefill_length = 128"]
  (task / "config.py").write_text("\n".join(lines + ["  return c", ""]))
  return task / "config.py"


def _hf_checkpoint(tmp_path):
  """A tiny random Qwen2 checkpoint whose tokenizer has a chat template."""
  base = char_tokenizer.build()
  ckpt = testing.write_random_hf_checkpoint(tmp_path / "hf", arch="qwen2", vocab_size=base.vocab_size,
                                            max_position_embeddings=256)
  tokenizer.Tokenizer(base.hf, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                      chat_template=CHATML).save(str(ckpt))
  return ckpt


def _config(kind, tmp_path):
  if kind == "builtin":
    return [os.path.join(ROOT, "configs", "addition_grpo.py:size=tiny"), "--config.warm_start.max_steps=0"]
  if kind == "countdown":
    return [os.path.join(ROOT, "examples", "countdown", "config.py:size=tiny")]
  if kind == "agent":
    return [os.path.join(ROOT, "examples", "calculator_agent", "config.py:size=tiny"),
            "--config.warm_start.max_steps=0"]
  if kind == "user_file":
    return [str(_user_task(tmp_path))]
  assert kind == "hf_checkpoint"
  return [str(_user_task(tmp_path, _hf_checkpoint(tmp_path)))]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["builtin", "user_file", "hf_checkpoint", "countdown", "agent"])
def test_eval_of_a_saved_workdir_needs_no_config(kind, tmp_path):
  config, *extra = _config(kind, tmp_path)
  workdir = tmp_path / "run"
  out = run("tunixlike.train", "--config", config, *extra, *SHORT, f"--workdir={workdir}", cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  out = run("tunixlike.eval", "--checkpoint", str(workdir), f"--out={tmp_path / 'eval.json'}", cwd=tmp_path)  # from another directory, with nothing but the workdir
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout)
  # The same 8 held-out prompts, built the same way, decoded greedily by the same weights: what the
  # trainer measured right after saving that checkpoint.
  final = [json.loads(l) for l in open(workdir / "metrics.jsonl") if "eval/accuracy" in l][-1]
  assert result["step"] == final["step"] == 1 and result["num_prompts"] == 8
  assert result["accuracy"] == final["eval/accuracy"]
  assert result["mean_completion_tokens"] == final["eval/mean_completion_tokens"]
  rows = json.loads((tmp_path / "eval.json").read_text())["examples"]
  assert len(rows) == 8
  assert all(set(r) >= {"prompt", "completion", "score", "finish_reason", "num_tokens"} for r in rows)
  assert sum(r["score"] for r in rows) / 8 == pytest.approx(result["accuracy"])
  if kind == "hf_checkpoint":  # the system prompt of data.system_prompt is in every prompt, as in training
    assert all(r["prompt"].startswith("<|im_start|>system\nAdd.<|im_end|>") for r in rows), rows[0]["prompt"]
