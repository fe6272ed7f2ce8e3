"""Keep Routing through the async runtime: an MoE policy, sampler.record_routing + algo.keep_routing."""

import dataclasses
import pathlib

import numpy as np
import pytest

from tunixlike import config as config_lib, mesh as mesh_lib, models
from tunixlike.rl import build
from tunixlike.rl.prompts import PromptStream

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.slow
def test_moe_routing_is_recorded_and_replayed_through_the_runtime():
  cfg = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  cfg = config_lib.replace(cfg, data=dict(digits=2, num_eval_examples=16), warm_start=dict(max_steps=0),
                           log=dict(progress_bar=False, tensorboard=False), sampler=dict(max_concurrent_decodes=16,
                                                                                         record_routing=True),
                           algo=dict(keep_routing=True), rl=dict(num_steps=2, prompts_per_step=4, max_staleness=0),
                           optim=dict(share_prompts=False))  # Keep Routing needs a row per completion
  setup = build.build(cfg)
  # The config's model section builds dense models: swap in an MoE policy of the same trunk.
  moe_cfg = setup.model.cfg.replace(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
  setup = dataclasses.replace(setup, model=models.create_sharded(moe_cfg, setup.meshes.learner,
                                                                 mesh_lib.LEARNER_RULES, seed=cfg.seed))
  rl = build.build_rl(setup)
  records = []
  runtime = build.make_runtime(setup, rl, PromptStream(iter(setup.train_pipe)))
  runtime.hooks.add(lambda info: records.append((info.step, info.metrics)))
  runtime.run(threaded=True)
  setup.tracer.close()
  assert len(records) == 2
  for _, m in records:
    assert np.isfinite(m["loss"])
    # Staleness 0, fp32 sampler: the learner's router agrees and the IS weight is 1.
    assert 0.0 <= m["routing_disagreement"] <= m["routing_token_disagreement"] <= 0.01
    assert m["mismatch_kl"] < 1e-6 and m["is_weight"] == pytest.approx(1.0, abs=1e-4)
