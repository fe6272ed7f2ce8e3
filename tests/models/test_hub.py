"""model.hf_path as a Hub name, resolved offline from a cache laid out as huggingface_hub lays it out
(HF_HOME/hub/models--org--name/snapshots/<commit>/..., refs/main), built here from a tiny checkpoint."""

import os
import subprocess
import sys
import textwrap

import pytest

from tunixlike.data import char_tokenizer
from tunixlike.models import testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
  home = tmp_path_factory.mktemp("hf_home")
  repo = home / "hub" / "models--tiny-org--tiny-model"
  snapshot = repo / "snapshots" / COMMIT
  testing.write_random_hf_checkpoint(snapshot, arch="qwen2", vocab_size=char_tokenizer.build().vocab_size)
  char_tokenizer.build().save(str(snapshot))
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(COMMIT)
  return home


def run(code_or_args, hf_home, *, module=False):
  env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
  env.pop("HF_HUB_CACHE", None)
  args = ["-m", *code_or_args] if module else ["-c", textwrap.dedent(code_or_args)]
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_hub_name_is_read_from_the_cache_offline(hf_home):
  out = run(f'''
      import jax
      import tunixlike
      from tunixlike import config as config_lib, mesh as mesh_lib
      from tunixlike.models import hub
      from tunixlike.rl import build
      print(hub.resolve("tiny-org/tiny-model"))
      print(hub.resolve("tiny-org/tiny-model", "{COMMIT}"))
      cfg = tunixlike.load_config("configs/addition_grpo.py:size=tiny", {{"model.hf_path": "tiny-org/tiny-model"}})
      config_lib.check_paths(cfg)
      tok, task = build.build_task(cfg)
      model = build.build_model(cfg, tok, mesh_lib.make_meshes(4, 4, 1, 1, layout="split").learner)
      print(model.cfg.vocab_size, tok.vocab_size)
  ''', hf_home)
  assert out.returncode == 0, out.stderr[-3000:]
  snapshot = str(hf_home / "hub" / "models--tiny-org--tiny-model" / "snapshots" / COMMIT)
  vocab = char_tokenizer.build().vocab_size
  assert out.stdout.split("\n")[:3] == [snapshot, snapshot, f"{vocab} {vocab}"]


def test_a_local_directory_still_wins(hf_home, tmp_path):
  local = tmp_path / "tiny-org" / "tiny-model"
  local.mkdir(parents=True)
  out = run(f'''
      import os
      from tunixlike.models import hub
      os.chdir({str(tmp_path)!r})
      print(hub.resolve("tiny-org/tiny-model"))
  ''', hf_home)
  assert out.returncode == 0 and out.stdout.strip() == "tiny-org/tiny-model", out.stderr[-2000:]


@pytest.mark.parametrize("args,expected", [
    (["--config.model.hf_path=tiny-org/not-cached"], "model.hf_path='tiny-org/not-cached' is not a local directory, "
     "and not in the Hugging Face cache ("),
    (["--config.model.hf_path=tiny-org/tiny-model", "--config.model.revision=v2"],
     "model.hf_path='tiny-org/tiny-model' at revision 'v2' is not a local directory"),
])
def test_a_name_not_in_the_cache_offline_is_one_line(hf_home, args, expected):
  out = run(["tunixlike.train", "--config", "configs/addition_grpo.py", *args, "--check_only"], hf_home, module=True)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and expected in lines[0] and "HF_HUB_OFFLINE=1" in lines[0], lines
  assert str(hf_home / "hub") in lines[0]
