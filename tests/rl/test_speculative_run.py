"""A short RL run with sampler.speculative: it trains, its metrics say how the drafts fared, and the
behaviour logprobs it ships still match the learner's (as plain decoding's do)."""

import numpy as np
import pytest

from test_runtime import run_steps, tiny_config
from tunixlike import config as config_lib
from tunixlike.settings import ConfigError


@pytest.mark.slow
def test_speculative_rollouts_train_and_their_logprobs_match_the_learners():
  cfg = tiny_config(max_staleness=0)
  cfg = config_lib.replace(cfg, sampler=dict(kv_layout="paged", kv_block_size=8, speculative=True), rl=dict(num_steps=2))
  records, *_ = run_steps(cfg, threaded=True)
  assert [s for s, _ in records] == [0, 1]
  for _, m in records:
    assert np.isfinite(m["loss"]) and 0.0 <= m["reward/mean"] <= 1.0
    # Same weights (staleness 0): the learner's logprobs of the sampled tokens equal the sampler's.
    assert m["mismatch_kl"] < 1e-6 and m["is_weight"] == pytest.approx(1.0, abs=1e-4)
    assert 0.0 <= m["sampler/draft_acceptance"] <= 1.0 and m["sampler/tokens_per_decode_step"] >= 1.0


def test_speculation_is_refused_where_it_cannot_run():
  with pytest.raises(ConfigError, match=r"sampler.speculative=True needs sampler.kv_layout='paged'"):
    config_lib.replace(tiny_config(), sampler=dict(speculative=True))
  with pytest.raises(ConfigError, match=r"sampler.speculative=True: is for single-turn rollouts"):
    config_lib.replace(tiny_config(), sampler=dict(kv_layout="paged", speculative=True), rl=dict(env="calculator"))
