"""Checkpointer: real orbax checkpoints of real Learner states on a 2x2 learner mesh."""

import glob
import logging
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tunixlike import config as config_lib
from tunixlike import checkpoint as ckpt_lib
from tunixlike import mesh as mesh_lib
from tunixlike import models
from tunixlike.learner import batch as batch_lib
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.group_advantages import AdvantageConfig
from tunixlike.learner.train_step import Learner
from tunixlike.models import lora
from tunixlike.rollout import Completion, RolloutGroup

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

RUN = config_lib.Config()  # the lora section at its defaults
TINY = models.tiny_config(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8)


def schedule(**values):
  """A writer's schedule: the run's `checkpoint` keys at their defaults, but for `values`."""
  return ckpt_lib.CheckpointSchedule.from_config(RUN, **values)


@pytest.fixture(scope="module")
def mesh4():
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))


def make_learner(mesh, *, seed=0, cfg=TINY, lora_rank=0, lora_seed=0, kl_coef=0.1):
  model = models.create_sharded(cfg, mesh, mesh_lib.LEARNER_RULES, seed=seed)
  if lora_rank:
    model = lora.apply_lora(model, lora.LoRAConfig.from_config(RUN, rank=lora_rank, alpha=8.0), seed=lora_seed,
                            mesh=mesh, rules=mesh_lib.LEARNER_RULES)
  lcfg = LearnerConfig(algo=AlgoConfig(kl_coef=kl_coef), optim=OptimConfig(learning_rate=1e-2),
                       logprob_chunk_size=8)
  return Learner(model, lcfg, mesh=mesh, rules=mesh_lib.LEARNER_RULES)


def host_batch(num_rows=8, seed=0, vocab=128):
  rng = np.random.default_rng(seed)
  groups = []
  for gi in range(num_rows // 4):
    comps = []
    for _ in range(4):
      n = int(rng.integers(2, 9))
      comps.append(Completion(rng.integers(1, vocab, size=n).astype(np.int32),
                              (-4.8 + 0.3 * rng.normal(size=n)).astype(np.float32), np.zeros(n, np.int32), "eos"))
    groups.append(RolloutGroup(prompt_id=gi, prompt_token_ids=rng.integers(1, vocab, size=3).astype(np.int32),
                               completions=comps, rewards=rng.integers(0, 2, size=4).astype(np.float32)))
  return batch_lib.assemble_batch(groups, num_rows=num_rows, seq_buckets=(16,), sampling_mask=False, routing=False,
                                  unscored=UNSCORED)


def meta_for(step):
  return {"policy_version": step, "rng_key": [0, 42], "data_position": 16 * step,
          "counters": {"dropped": 1, "wall_s": 12.5}, "in_flight": ["p17", "p18"], "config": {"seed": 0}}


def host_copy(tree):
  return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


def assert_restored(restored, want_host, target):
  """Every leaf equal to the saved values, with the target's sharding and dtype."""
  got = jax.tree_util.tree_leaves_with_path(restored)
  want = jax.tree.leaves(want_host)
  tgt = jax.tree.leaves(target)
  assert len(got) == len(want) == len(tgt) > 0
  for (path, g), w, t in zip(got, want, tgt):
    where = jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=where)
    assert g.sharding == t.sharding, where
    assert g.dtype == t.dtype, where


@pytest.fixture(scope="module")
def run(mesh4, tmp_path_factory):
  """Two real train steps, each saved asynchronously and then donated to the next step at once.

  Returns (learner, final live state, host copies of the state after steps 1 and 2, checkpoint dir).
  """
  learner = make_learner(mesh4)
  placed = learner.put_batch(host_batch())
  root = tmp_path_factory.mktemp("run") / "ck"
  state, saved = learner.state, {}
  with ckpt_lib.Checkpointer(root, schedule(keep=3)) as ck:
    assert ck.latest_step() is None
    for step in (1, 2):
      state, _ = learner.train_step(state, placed, jax.random.key(0))
      saved[step] = host_copy(state)
      assert ck.save(step, state, meta_for(step), force=True)
      # the next train_step donates `state` while orbax may still be writing it
  return learner, placed, state, saved, root


@pytest.fixture
def run_dir(run, tmp_path):
  """A private copy of the run's checkpoints (tests damage it)."""
  shutil.copytree(run[-1], tmp_path / "ck")
  return tmp_path / "ck"


def test_async_save_then_donate_then_restore_exactly(run):
  learner, placed, state, saved, root = run
  ck = ckpt_lib.Checkpointer(root, read_only=True)
  assert ck.latest_step() == 2 and ck.all_steps() == [1, 2]
  target = ckpt_lib.abstract_like(state)
  restored, meta = ck.restore(1, abstract_state=target)
  assert meta == meta_for(1) and ck.read_meta(2) == meta_for(2)
  assert isinstance(restored, type(state))
  assert_restored(restored, saved[1], state)
  assert restored.ref_params is not None and int(restored.step) == 1
  # Resuming from step 1 and taking the same step again reproduces step 2 exactly.
  resumed, _ = learner.train_step(restored, placed, jax.random.key(0))
  assert_restored(resumed, saved[2], state)
  ck.close()


def test_restore_reshards_onto_another_mesh(run):
  _, _, state, saved, root = run
  other = Mesh(np.array(jax.devices()[4:8]).reshape(4, 1), ("fsdp", "tensor"))
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, x.sharding.spec)),
                        state)
  with ckpt_lib.Checkpointer(root, read_only=True) as ck:
    restored, _ = ck.restore(abstract_state=target)
  assert_restored(restored, saved[2], target)
  kernel = restored.params["layers"][0]["mlp"]["up_proj"]["kernel"][...]
  assert kernel.sharding.mesh.devices.tolist() == other.devices.tolist()
  assert kernel.addressable_shards[0].data.shape == (32 // 4, 64)  # only a quarter on each device


def test_should_save_by_steps_and_time_and_keep(run, tmp_path):
  state = run[2]
  ck = ckpt_lib.Checkpointer(tmp_path, schedule(keep=2, every_steps=2))
  assert [s for s in range(0, 7) if ck.should_save(s)] == [2, 4, 6]
  saved = [s for s in range(1, 7) if ck.save(s, state, meta_for(s))]
  assert saved == [2, 4, 6]
  assert not ck.save(6, state, meta_for(6), force=True)  # already there
  ck.wait()
  assert ck.all_steps() == [4, 6]  # keep=2
  assert sorted(os.listdir(tmp_path)) == ["4", "6"]
  ck.close()

  # A controlled clock: a loaded CI machine can stall longer than any real interval we would wait.
  clock = [1000.0]
  timed = ckpt_lib.Checkpointer(tmp_path / "t", schedule(every_seconds=30), clock=lambda: clock[0])
  assert not timed.should_save(1)
  clock[0] += 31
  assert timed.should_save(1)
  assert timed.save(1, state, meta_for(1))
  assert not timed.should_save(2)  # the clock restarts at each save
  clock[0] += 31
  assert timed.should_save(2)
  timed.close()

  with pytest.raises(ValueError, match="keep=0"):
    ckpt_lib.Checkpointer(tmp_path, schedule(keep=0))
  with pytest.raises(ValueError, match="every_seconds=-1"):
    ckpt_lib.Checkpointer(tmp_path, schedule(every_seconds=-1))
  with pytest.raises(ValueError, match="one that writes needs a schedule"):
    ckpt_lib.Checkpointer(tmp_path)
  # A library user's schedule is a CLI user's: saved every checkpoint.every_steps = 50 steps.
  with ckpt_lib.Checkpointer(tmp_path / "cli", schedule()) as cli:
    assert [s for s in range(1, 101) if cli.should_save(s)] == [50, 100]


def test_lora_saves_adapters_and_optimizer_without_frozen_base(mesh4, tmp_path):
  state = make_learner(mesh4, lora_rank=4).state
  saved_host = host_copy(state)
  saved = {}  # subtree -> arrays orbax wrote for it (directory sizes vary with OCDBT's file layout)
  for name, keep_frozen in (("small", False), ("full", True)):
    with ckpt_lib.Checkpointer(tmp_path / name, schedule(), save_frozen=keep_frozen) as ck:
      ck.save(1, state, meta_for(1), force=True)
    # after close: the save is asynchronous
    tree = ocp.StandardCheckpointer().metadata(os.path.join(ck.step_dir(1), "state")).item_metadata.tree
    saved[name] = {k: len(jax.tree_util.tree_leaves(v)) for k, v in tree.items()}
  # The base weights are left out; the adapters and the optimizer's state are all there.
  frozen = len(jax.tree_util.tree_leaves(state.frozen))
  assert frozen > 0 and saved["full"]["frozen"] == frozen and saved["small"]["frozen"] == 0
  assert {k: v for k, v in saved["small"].items() if k != "frozen"} == {k: v for k, v in saved["full"].items() if k != "frozen"}
  with ckpt_lib.Checkpointer(tmp_path / "small", read_only=True) as ck:
    assert ck.layout(1)["frozen_saved"] is False

  # Resume: the base weights come from the live model (as from hf_path), the adapters from disk.
  fresh = make_learner(mesh4, seed=0, lora_rank=4, lora_seed=1)  # same base, other adapters
  fresh_frozen = fresh.state.frozen
  with ckpt_lib.Checkpointer(tmp_path / "small", schedule(), save_frozen=False) as ck:
    restored, meta = ck.restore(abstract_state=fresh.state)
    assert meta["in_flight"] == ["p17", "p18"]
    assert restored.frozen is fresh_frozen
    assert_restored(restored, saved_host, fresh.state)
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(restored.params))
    with pytest.raises(ckpt_lib.CheckpointError, match="save_frozen=False.*frozen/embed_tokens/embedding is not a live array"):
      ck.restore(abstract_state=ckpt_lib.abstract_like(fresh.state))


def test_missing_directory_is_a_fresh_start(tmp_path):
  missing = tmp_path / "nope"
  ro = ckpt_lib.Checkpointer(missing, read_only=True)
  assert ro.latest_step() is None and ro.all_steps() == []
  assert not missing.exists()  # read-only never creates anything
  with pytest.raises(ckpt_lib.CheckpointError, match=f"{missing}: no complete checkpoint"):
    ro.restore(abstract_state={})
  ck = ckpt_lib.Checkpointer(missing, schedule())
  assert ck.latest_step() is None
  ck.close()


def test_interrupted_save_is_never_loaded(run, run_dir, caplog):
  root, saved, target = run_dir, run[3], ckpt_lib.abstract_like(run[2])
  # A save killed mid-write leaves orbax's temporary directory behind (partly written) ...
  shutil.copytree(root / "2", root / "3.orbax-checkpoint-tmp-1700000000")
  for f in glob.glob(str(root / "3.orbax-checkpoint-tmp-1700000000" / "state" / "**" / "d" / "*"), recursive=True):
    os.remove(f)
  # ... and a listed step directory missing an item's metadata is not a checkpoint either.
  shutil.copytree(root / "2", root / "4")
  os.remove(root / "4" / "state" / "_METADATA")
  with caplog.at_level(logging.WARNING, logger="tunixlike"):
    ck = ckpt_lib.Checkpointer(root, read_only=True)
    assert ck.latest_step() == 2 and ck.all_steps() == [1, 2]
  assert f"ignoring incomplete checkpoint directory {root / '4'}" in caplog.text
  restored, meta = ck.restore(abstract_state=target)
  assert meta["policy_version"] == 2
  assert_restored(restored, saved[2], target)
  with pytest.raises(ckpt_lib.CheckpointError, match=f"{root / '4'}: no complete checkpoint at step 4"):
    ck.restore(4, abstract_state=target)
  ck.close()


@pytest.mark.parametrize("damage", ["delete", "truncate"])
@pytest.mark.parametrize("digest", [True, False], ids=["digest", "no_digest"])
def test_corrupted_checkpoint(run, run_dir, damage, digest, caplog):
  root, saved, target = run_dir, run[3], ckpt_lib.abstract_like(run[2])
  files = glob.glob(str(root / "2" / "state" / "**" / "d" / "*"), recursive=True)
  assert files and (root / "2" / ckpt_lib.DIGEST_FILE).exists()
  if not digest:  # as if killed before the digest was written: orbax's read error is what falls back
    os.remove(root / "2" / ckpt_lib.DIGEST_FILE)
  for f in files:
    if damage == "delete":
      os.remove(f)
    else:
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
  ck = ckpt_lib.Checkpointer(root, read_only=True)
  with pytest.raises(ckpt_lib.CheckpointError, match=f"{root / '2'}: checkpoint unreadable"):
    ck.restore(2, abstract_state=target)
  with pytest.raises(ckpt_lib.CheckpointError, match=f"{root / '2'}: checkpoint unreadable"):
    ck.restore(abstract_state=target, fallback=False)
  with caplog.at_level(logging.WARNING, logger="tunixlike"):
    restored, meta = ck.restore(abstract_state=target)  # falls back to the newest readable one
  assert meta["policy_version"] == 1
  assert_restored(restored, saved[1], target)
  assert f"{root / '2'}: checkpoint unreadable" in caplog.text
  if not digest:  # read by tensorstore alone before orbax is asked: no read of orbax's fails halfway
    assert f"{root / '2'}: checkpoint unreadable (reading " in caplog.text
  # With nothing older to fall back on, the error names the damaged directory.
  ck.close()
  shutil.rmtree(root / "1")
  with ckpt_lib.Checkpointer(root, read_only=True) as ck, pytest.raises(
      ckpt_lib.CheckpointError, match=f"no readable checkpoint: {root / '2'}: checkpoint unreadable"):
    ck.restore(abstract_state=target)


def flip_bytes_in_largest_array_file(step_dir, n=64):
  """XORs `n` bytes in the middle of the biggest file of the step's arrays; returns its path."""
  files = [f for f in glob.glob(str(step_dir / "state" / "**"), recursive=True) if os.path.isfile(f)]
  path = max(files, key=os.path.getsize)
  size = os.path.getsize(path)
  assert size > 4 * n
  with open(path, "r+b") as fh:
    fh.seek(size // 2)
    data = fh.read(n)
    fh.seek(size // 2)
    fh.write(bytes(b ^ 0xFF for b in data))
  return path


def test_flipped_bytes_fail_the_content_check_and_fall_back(run, run_dir, caplog):
  root, saved, target = run_dir, run[3], ckpt_lib.abstract_like(run[2])
  flipped = flip_bytes_in_largest_array_file(root / "2")
  with ckpt_lib.Checkpointer(root, read_only=True) as ck:
    with caplog.at_level(logging.WARNING, logger="tunixlike"):
      restored, meta = ck.restore(abstract_state=target)
    assert meta["policy_version"] == 1
    assert_restored(restored, saved[1], target)
    assert f"{root / '2'}: checkpoint unreadable (content check against digest.json: {flipped} changed)" in caplog.text
    assert "trying an older checkpoint" in caplog.text
    with pytest.raises(ckpt_lib.CheckpointError, match=f"{root / '2'}: checkpoint unreadable .*{flipped} changed"):
      ck.restore(2, abstract_state=target)



# Step 2 is the best; 4 has no metrics; 6 is a collapse whose metric is NaN.
REWARDS = {1: 0.2, 2: 0.8, 3: 0.5, 4: None, 5: 0.1, 6: float("nan")}


def test_best_checkpoint_survives_rotation_and_a_resume(run, tmp_path, caplog):
  state, target = run[2], ckpt_lib.abstract_like(run[2])
  root = tmp_path / "ck"
  with ckpt_lib.Checkpointer(root, schedule(keep=2), best_metric="reward") as ck:
    assert ck.best_step() is None
    for step, reward in REWARDS.items():
      metrics = None if reward is None else {"reward": reward, "loss": 1.5}
      assert ck.save(step, state, meta_for(step), metrics=metrics, force=True)
    ck.wait()
    assert ck.all_steps() == [2, 5, 6] and ck.best_step() == 2
    with pytest.raises(ValueError, match="metrics hold no 'reward'.*only \\['loss'\\]"):
      ck.save(7, state, meta_for(7), metrics={"loss": 1.0}, force=True)
    with pytest.raises(TypeError, match=r"metrics\['reward'\] is a str"):
      ck.save(7, state, meta_for(7), metrics={"reward": "high"}, force=True)
  assert "step 6 metric reward=nan is not finite" in caplog.text
  # orbax keeps each step's metrics with the step, which is what a resumed run ranks by
  reader = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
  assert reader.metadata(2).metrics == {"reward": 0.8, "loss": 1.5} and not reader.metadata(6).metrics
  reader.close()

  # A resumed run (another process) remembers the best and keeps preserving it.
  with ckpt_lib.Checkpointer(root, schedule(keep=2), best_metric="reward") as ck:
    assert ck.all_steps() == [2, 5, 6] and ck.best_step() == 2
    for step, reward in ((7, 0.3), (8, 0.4)):
      ck.save(step, state, meta_for(step), metrics={"reward": reward}, force=True)
    ck.wait()
    assert ck.all_steps() == [2, 7, 8] and ck.best_step() == 2
  caplog.clear()
  with ckpt_lib.Checkpointer(root, read_only=True, best_metric="reward") as ck, \
      caplog.at_level(logging.WARNING, logger="tunixlike"):
    assert ck.best_step() == 2
    for step in ck.all_steps():  # the digests of both runs hold (rotation touched no kept file)
      assert ck.restore(step, abstract_state=target)[1]["policy_version"] == step
    assert not [r.message for r in caplog.records if r.name == "tunixlike"]
    flipped = flip_bytes_in_largest_array_file(root / "8")
    with caplog.at_level(logging.WARNING, logger="tunixlike"):
      assert ck.restore(abstract_state=target)[1]["policy_version"] == 7
    assert f"{root / '8'}: checkpoint unreadable (content check against digest.json: {flipped} changed)" in caplog.text
  shutil.rmtree(root / "8")

  # A better checkpoint replaces the best; without best_metric only the latest are kept.
  with ckpt_lib.Checkpointer(root, schedule(keep=2), best_metric="reward") as ck:
    ck.save(9, state, meta_for(9), metrics={"reward": 0.9}, force=True)
    ck.wait()
    assert ck.all_steps() == [7, 9] and ck.best_step() == 9
  with ckpt_lib.Checkpointer(root, schedule(keep=1)) as ck:
    assert ck.best_step() is None
    ck.save(10, state, meta_for(10), metrics={"reward": 1.0}, force=True)  # recorded only with a best_metric
    ck.wait()
    assert ck.all_steps() == [10]

  with ckpt_lib.Checkpointer(tmp_path / "min", schedule(keep=1), best_metric="loss", best_mode="min") as ck:
    for step, loss in ((1, 0.5), (2, 0.1), (3, 0.7)):
      ck.save(step, state, meta_for(step), metrics={"loss": loss}, force=True)
    ck.wait()
    assert ck.all_steps() == [2, 3] and ck.best_step() == 2
    ck.save(4, state, meta_for(4), metrics={"loss": 0.1}, force=True)  # as good: the newer one is kept
    ck.wait()
    assert ck.all_steps() == [4] and ck.best_step() == 4
  with pytest.raises(ValueError, match="best_mode='best'"):
    ckpt_lib.Checkpointer(tmp_path, schedule(), best_metric="loss", best_mode="best")


def test_incompatible_model_shape(run, mesh4):
  root = run[-1]
  ck = ckpt_lib.Checkpointer(root, read_only=True)
  wider = make_learner(mesh4, cfg=TINY.replace(hidden_size=64))
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=rf"{root / '2'}: params/embed_tokens/embedding has shape \[128, 32\] in the "
                           rf"checkpoint but \[128, 64\] in this model"):
    ck.restore(abstract_state=wider.state)
  deeper = make_learner(mesh4, cfg=TINY.replace(num_layers=3))
  with pytest.raises(ckpt_lib.CheckpointError, match="checkpoint has no 'params/layers/2/attn/k_proj/kernel'"):
    ck.restore(abstract_state=deeper.state)
  with_lora = make_learner(mesh4, lora_rank=2)
  with pytest.raises(ckpt_lib.CheckpointError, match="different model, LoRA or optimizer setup"):
    ck.restore(abstract_state=with_lora.state)
  ck.close()


def test_partial_restore_reads_only_the_weights(run):
  _, _, state, saved, root = run
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), state.params)}
  with ckpt_lib.Checkpointer(root, read_only=True) as ck:
    got, meta = ck.restore(abstract_state=target, partial=True)
  assert set(got) == {"params"} and meta == meta_for(2)
  assert_restored(got["params"], saved[2].params, target["params"])


def test_meta_must_be_json(run, tmp_path):
  state = run[2]
  ck = ckpt_lib.Checkpointer(tmp_path, schedule())
  with pytest.raises(TypeError, match=r"meta\['counters'\]\['loss'\] is a float32"):
    ck.save(1, state, {"counters": {"loss": np.float32(1.0)}}, force=True)
  with pytest.raises(ValueError, match=r"meta\['x'\]\[1\]=nan is not finite"):
    ck.save(1, state, {"x": [1.0, float("nan")]}, force=True)
  assert ck.latest_step() is None
  ck.close()
