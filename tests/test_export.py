"""Export: a real Learner state saved with the Checkpointer, exported, loaded by transformers."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tunixlike import config as config_lib
from tunixlike import checkpoint as ckpt_lib
from tunixlike import export as export_lib
from tunixlike import mesh as mesh_lib
from tunixlike import models
from tunixlike.data import char_tokenizer, tokenizer as tokenizer_lib
from tunixlike.learner.config import LearnerConfig, OptimConfig
from tunixlike.learner.ppo import PPOLearner
from tunixlike.learner.train_step import Learner
from tunixlike.learner.value import PolicyWithValue
from tunixlike.models import hf, lora
from tunixlike.models.testing import write_random_hf_checkpoint

RUN = config_lib.Config()  # the lora section at its defaults
ONE = ckpt_lib.CheckpointSchedule(keep=1, every_steps=0, every_seconds=0)  # saves only when told, keeps one

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# init_std large enough that logits are O(1): a wrong or missing weight shows at atol 1e-4.
TINY = models.tiny_config(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8, init_std=0.3,
                          eos_token_ids=(2,))
LORA = lora.LoRAConfig.from_config(RUN, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
LEARNER_CONFIG = LearnerConfig(optim=OptimConfig(learning_rate=1e-3))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mesh4():
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))


def perturb_adapters(state, seed=0):
  """B starts at zero (the adapted model is the base); make it non-zero so the merge matters."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) if "lora_b" in jax.tree_util.keystr(p) else x
         for (p, x), k in zip(leaves, keys)]
  return state.replace(params=jax.tree_util.tree_unflatten(treedef, new))


def save_run(workdir, learner, state, cfg, *, lora_cfg=None, hf_path=None, save_frozen=True, step=3,
             estimator="grpo_family"):
  run = {"seed": 0, "algo": {"estimator": estimator}, "optim": {"learning_rate": 3e-4},
         "sampler": {"temperature": 0.7}, "lora": {"rank": 0 if lora_cfg is None else lora_cfg.rank}}
  meta = {"policy_version": step, "config": run,
          "model": dataclasses.asdict(cfg),
          "lora": None if lora_cfg is None else {"rank": lora_cfg.rank, "alpha": lora_cfg.alpha,
                                                 "targets": list(lora_cfg.targets)}}
  if hf_path is not None:
    meta["hf_path"] = str(hf_path)
  with ckpt_lib.Checkpointer(ckpt_lib.workdir_checkpoints(workdir), ONE, save_frozen=save_frozen) as ck:
    assert ck.save(step, state, meta, force=True)


def assert_transformers_matches(out, ours_model, vocab):
  toks = np.random.default_rng(0).integers(0, vocab, size=(2, 11)).astype(np.int32)
  ours = np.asarray(ours_model(jnp.asarray(toks)))
  theirs_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = theirs_model(torch.tensor(toks, dtype=torch.long)).logits.numpy()
  assert np.abs(theirs).max() > 1.0
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("use_lora", [False, True])
def test_export_matches_transformers(mesh4, tmp_path, use_lora):
  model = models.create_sharded(TINY, mesh4, mesh_lib.LEARNER_RULES, seed=0)
  if use_lora:
    model = lora.apply_lora(model, LORA, seed=1, mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  learner = Learner(model, LEARNER_CONFIG, mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  state = perturb_adapters(learner.state) if use_lora else learner.state
  save_run(tmp_path / "run", learner, state, TINY, lora_cfg=LORA if use_lora else None)

  out = export_lib.export(tmp_path / "run", tmp_path / "hf")
  ours = learner.model(state)
  if use_lora:  # the merge must matter: the base alone differs
    base = learner.model(state.replace(params=lora.zero_adapters(state.params)))
    toks = jnp.arange(10)[None]
    assert float(jnp.abs(ours(toks) - base(toks)).max()) > 1e-2
  assert_transformers_matches(out, ours, TINY.vocab_size)
  # Built-in tasks: the char tokenizer goes along, and reads back the same.
  tok = tokenizer_lib.load(str(out))
  assert tok.encode("12+7=") == char_tokenizer.build().encode("12+7=")
  assert hf.from_pretrained(out).cfg.eos_token_ids == (2,)
  # transformers' generate pads with config.json's pad_token_id: the tokenizer's, kept.
  theirs = transformers.AutoConfig.from_pretrained(str(out))
  assert (theirs.pad_token_id, theirs.bos_token_id) == (tok.pad_id, tok.bos_id) == (0, 1)
  # A run from this directory goes on at the exporting run's temperature and (full weights) learning rate.
  recorded = json.loads((out / "config.json").read_text())["tunixlike_run"]
  assert recorded == ({"sampler.temperature": 0.7} if use_lora else
                      {"sampler.temperature": 0.7, "optim.learning_rate": 3e-4})


@pytest.fixture
def umask():
  """Sets the process umask for the test (to one that differs from a private 0600 and from 0644)."""
  old = os.umask(0o002)
  yield 0o002
  os.umask(old)


def test_exported_files_get_the_mode_of_any_new_file(mesh4, tmp_path, umask):
  """A shared machine's other users can read the export as they can any file its user writes."""
  learner = Learner(models.create_sharded(TINY, mesh4, mesh_lib.LEARNER_RULES, seed=0), LEARNER_CONFIG,
                    mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  save_run(tmp_path / "run", learner, learner.state, TINY)
  out = export_lib.export(tmp_path / "run", tmp_path / "hf")
  with open(tmp_path / "plain.txt", "w") as f:
    f.write("x")
  plain = os.stat(tmp_path / "plain.txt").st_mode & 0o777
  assert plain == 0o666 & ~umask
  modes = {name: oct(os.stat(out / name).st_mode & 0o777) for name in sorted(os.listdir(out))}
  assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(modes)  # no probe file left
  assert modes == dict.fromkeys(modes, oct(plain))


def test_export_ppo_checkpoint_keeps_the_policy_and_drops_the_value_head(mesh4, tmp_path):
  policy = models.create_sharded(TINY, mesh4, mesh_lib.LEARNER_RULES, seed=0)
  learner = PPOLearner(PolicyWithValue.create(policy, seed=1), LEARNER_CONFIG, mesh=mesh4,
                       rules=mesh_lib.LEARNER_RULES)
  save_run(tmp_path / "run", learner, learner.state, TINY, estimator="ppo")
  out = export_lib.export(tmp_path / "run", tmp_path / "hf")
  assert_transformers_matches(out, learner.model(learner.state).policy, TINY.vocab_size)


def test_export_lora_over_hf_base_without_saved_base(mesh4, tmp_path):
  """save_frozen=False: the checkpoint holds adapters only; export reads the base from hf_path."""
  base_dir = write_random_hf_checkpoint(tmp_path / "base", "qwen2", vocab_size=128)
  char_tokenizer.build().save(str(base_dir))  # the run's tokenizer lives in its HF directory
  model = hf.from_pretrained(base_dir, mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  model = lora.apply_lora(model, LORA, seed=1, mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  learner = Learner(model, LEARNER_CONFIG, mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  state = perturb_adapters(learner.state)
  save_run(tmp_path / "run", learner, state, model.cfg, lora_cfg=LORA, hf_path=base_dir, save_frozen=False)
  with ckpt_lib.Checkpointer(ckpt_lib.workdir_checkpoints(tmp_path / "run"), read_only=True) as ck:
    assert ck.layout()["frozen_saved"] is False

  out = export_lib.export(tmp_path / "run", tmp_path / "hf")
  assert_transformers_matches(out, learner.model(state), 128)
  assert sorted(f for f in os.listdir(out) if f.startswith("tokenizer")) == ["tokenizer.json",
                                                                              "tokenizer_config.json"]
  assert json.load(open(out / "config.json"))["pad_token_id"] == char_tokenizer.build().pad_id


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "tunixlike.export", *args], capture_output=True, text=True,
                        cwd=REPO, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_cli_help_and_errors(mesh4, tmp_path):
  r = run_cli("--help")
  assert r.returncode == 0 and "Hugging Face" in r.stdout and "--workdir" in r.stdout and "--step" in r.stdout

  r = run_cli("--workdir", str(tmp_path / "empty"), "--out", str(tmp_path / "hf"))
  assert r.returncode == 2
  assert r.stderr.strip().splitlines()[-1] == f"export: error: {tmp_path / 'empty'}: no complete checkpoint found"
  assert not (tmp_path / "empty").exists() and not (tmp_path / "hf").exists()

  learner = Learner(models.create_sharded(TINY, mesh4, mesh_lib.LEARNER_RULES, seed=0), LEARNER_CONFIG,
                    mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  save_run(tmp_path / "run", learner, learner.state, TINY)
  r = run_cli("--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--step", "7")
  assert r.returncode == 2
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("export: error: ") and "no complete checkpoint at step 7" in last and "[3]" in last

  r = run_cli("--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "hf" / "model.safetensors").is_file()
  np.testing.assert_allclose(np.asarray(hf.from_pretrained(tmp_path / "hf")(jnp.arange(6)[None])),
                             np.asarray(learner.model(learner.state)(jnp.arange(6)[None])), atol=1e-5)


def test_best_exports_the_checkpoint_with_the_best_held_out_accuracy(mesh4, tmp_path):
  learner = Learner(models.create_sharded(TINY, mesh4, mesh_lib.LEARNER_RULES, seed=0), LEARNER_CONFIG,
                    mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  save_run(tmp_path / "run", learner, learner.state, TINY, step=3)  # saved without a metric
  with pytest.raises(ckpt_lib.CheckpointError, match="no checkpoint saved with a 'eval/accuracy' metric"):
    export_lib.export(tmp_path / "run", tmp_path / "hf", best=True)
  states = {4: perturb_params(learner.state, 1), 5: perturb_params(learner.state, 2)}
  with ckpt_lib.Checkpointer(ckpt_lib.workdir_checkpoints(tmp_path / "run"), ONE,
                             best_metric=ckpt_lib.RUN_BEST_METRIC) as ck:
    for step, acc in ((4, 0.6), (5, 0.1)):  # the newest (5) is worse than 4
      meta = {"policy_version": step, "config": {"seed": 0, "algo": {"estimator": "grpo_family"}},
              "model": dataclasses.asdict(TINY), "lora": None}
      assert ck.save(step, states[step], meta, metrics={ckpt_lib.RUN_BEST_METRIC: acc}, force=True)
  out = export_lib.export(tmp_path / "run", tmp_path / "hf", best=True)
  tokens = jnp.arange(6)[None]
  np.testing.assert_allclose(np.asarray(hf.from_pretrained(out)(tokens)),
                             np.asarray(learner.model(states[4])(tokens)), atol=1e-5)
  assert not np.allclose(np.asarray(learner.model(states[4])(tokens)), np.asarray(learner.model(states[5])(tokens)))


def perturb_params(state, seed):
  leaves, treedef = jax.tree_util.tree_flatten(state.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return state.replace(params=jax.tree_util.tree_unflatten(treedef, new))


def test_bad_meta_names_the_problem(mesh4, tmp_path):
  learner = Learner(models.create_sharded(TINY, mesh4, mesh_lib.LEARNER_RULES, seed=0), LEARNER_CONFIG,
                    mesh=mesh4, rules=mesh_lib.LEARNER_RULES)
  with ckpt_lib.Checkpointer(tmp_path / "a", ONE) as ck:
    ck.save(1, learner.state, {"config": {}}, force=True)
  with pytest.raises(export_lib.ExportError, match=r"1: meta has no 'model'"):
    export_lib.export(tmp_path / "a", tmp_path / "hf")
  bad = {**dataclasses.asdict(TINY), "hidden_size": -1}
  with ckpt_lib.Checkpointer(tmp_path / "b", ONE) as ck:
    ck.save(1, learner.state, {"model": bad, "lora": None}, force=True)
  with pytest.raises(export_lib.ExportError, match=r"not a valid ModelConfig \(ModelConfig.hidden_size=-1"):
    export_lib.export(tmp_path / "b", tmp_path / "hf")
  wrong = {**dataclasses.asdict(TINY), "hidden_size": 64}  # meta and arrays disagree
  with ckpt_lib.Checkpointer(tmp_path / "c", ONE) as ck:
    ck.save(1, learner.state, {"model": wrong, "lora": None}, force=True)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"params/embed_tokens/embedding has shape \[128, 32\]"):
    export_lib.export(tmp_path / "c", tmp_path / "hf")
