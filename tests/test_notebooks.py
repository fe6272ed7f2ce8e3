"""The colabs run top to bottom on CPU with small settings, as Colab runs them: the notebook alone.

Each runs in a kernel whose Python has no tunixlike (tests/fresh_install.py), from a temporary
directory outside the checkout, with `REPO_URL` pointing at a git repository of the working tree
(standing in for the repository's URL): its first cell installs tunixlike from there, and nothing
after it may read a file of the checkout. The test injects a cell after each notebook's `parameters`
cell (papermill style) that switches it to SMALL and points its outputs at a temporary directory;
everything else runs as a user would run it.
"""

import json
import os

import nbclient
import nbformat
import pytest

import fresh_install

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, "colabs")
NOTEBOOKS = ("quickstart.ipynb", "hf_model_grpo.ipynb")
CELL_TIMEOUT_S = 300
KERNEL = "tunixlike-fresh"  # a kernel spec of the fresh environment's python


def load(name):
  return nbformat.read(os.path.join(COLABS, name), as_version=4)


@pytest.fixture(scope="module")
def repo_url(tmp_path_factory):
  return fresh_install.git_repository(tmp_path_factory.mktemp("repository"))


def execute(name, where, **params):
  """Runs notebook `name` in a fresh environment under `where` (its working directory too), with
  `params` overriding its parameters cell; returns the executed notebook and the environment's python."""
  nb = load(name)
  at = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(at) == 1, f"{name}: expected one cell tagged 'parameters'"
  nb.cells.insert(at[0] + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items())))
  python = fresh_install.fresh_venv(where / "venv")
  spec = where / "jupyter" / "kernels" / KERNEL
  spec.mkdir(parents=True)
  argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
  (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
  cwd = where / "content"  # Colab's /content: no checkout around it
  cwd.mkdir()
  env_before, env = dict(os.environ), fresh_install.install_env(JUPYTER_PATH=str(where / "jupyter"))
  os.environ.clear()
  os.environ.update(env)  # inherited by the kernel
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  try:
    nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                            resources={"metadata": {"path": str(cwd)}}).execute()
  finally:
    os.environ.clear()
    os.environ.update(env_before)
  return nb, python


def installed_from_repository(python) -> bool:
  """tunixlike is in the fresh environment itself, with a config that ships in the package."""
  site = python.parent.parent / "lib"
  return any(site.glob("python3*/site-packages/tunixlike/configs/addition_grpo.py"))


def images(nb) -> int:
  return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_stored_without_outputs_and_valid(name):
  nb = load(name)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == "python3"
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(not c.outputs and c.execution_count is None for c in code), f"{name} has outputs"
  assert all(len(c.source.splitlines()) <= 30 for c in code), f"{name}: keep each cell small"
  assert sum(c.cell_type == "markdown" for c in nb.cells) >= len(code) // 2, f"{name}: explain the steps"
  # Colab opens the notebook alone: the parameters name the repository, the next cell installs from it
  # when tunixlike is missing, and no later cell names a file of a checkout.
  assert "parameters" in code[0].metadata.get("tags", []) and "REPO_URL = " in code[0].source
  assert 'find_spec("tunixlike") is None' in code[1].source and '"pip", "install"' in code[1].source
  for c in code[2:]:
    assert not any(word in c.source for word in ("..", "configs/", "examples/", "ROOT")), c.source


@pytest.mark.slow
def test_quickstart_installs_then_runs_async_and_sync_and_plots(tmp_path, repo_url):
  nb, python = execute("quickstart.ipynb", tmp_path / "env", SMALL=True, WORKDIR=str(tmp_path), REPO_URL=repo_url)
  assert installed_from_repository(python)
  for png in ("reward.png", "timeline.png", "sync_vs_async.png"):
    assert (tmp_path / png).stat().st_size > 1000, png
  assert images(nb) >= 3
  for mode in ("async", "sync"):
    records = [json.loads(l) for l in open(tmp_path / mode / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [0, 1], mode
    assert len([r for r in records if "eval/accuracy" in r]) == 2, mode
    bound = 0 if mode == "sync" else 1  # rl.max_staleness of each run
    assert all(r["staleness/max"] <= bound for r in records if "loss" in r), mode
    events = json.load(open(tmp_path / mode / "trace.json"))["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"train_step", "weight_sync", "reward"} <= names, (mode, names)


@pytest.mark.slow
def test_hf_model_grpo_installs_then_runs_lora_on_gsm8k_from_a_tiny_local_checkpoint(tmp_path, repo_url):
  nb, python = execute("hf_model_grpo.ipynb", tmp_path / "env", SMALL=True, WORKDIR=str(tmp_path), REPO_URL=repo_url)
  assert installed_from_repository(python)
  assert (tmp_path / "tiny-hf" / "config.json").exists() and (tmp_path / "tiny-hf" / "tokenizer.json").exists()
  records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [0, 1]
  assert all("rewards/gsm8k_accuracy" in r for r in steps)
  assert (tmp_path / "run" / "reward.png").stat().st_size > 1000
  assert images(nb) >= 1
  meta_lora = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if "LoRA rank" in o.get("text", "")]
  assert meta_lora, "the notebook prints the LoRA setup it trained"
