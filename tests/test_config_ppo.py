"""PPO and offload keys: defaults, and bad values that fail with the key named."""

import pathlib
import pytest

from tunixlike import config as config_lib

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def build(**overrides):
  c = config_lib.default_config_dict()
  for key, value in overrides.items():
    section, name = key.split("__")
    setattr(getattr(c, section), name, value)
  return config_lib.from_config_dict(c)


def test_defaults_and_the_ppo_config():
  cfg = build()
  assert cfg.algo.estimator == "grpo_family" and cfg.learner.offload == () and cfg.model.critic_path is None
  ppo = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_ppo.py"))
  assert ppo.algo.estimator == "ppo" and 0 <= ppo.algo.gae_lambda <= 1
  assert config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_ppo.py", "size=tiny")).rl.num_steps == 3
  with pytest.raises(ValueError, match="unknown variant"):
    config_lib.load(CONFIGS / "addition_ppo.py", "size=huge")
  ok = build(algo__estimator="ppo", algo__kl_reward_coef=0.1, learner__offload=("reference", "optimizer"))
  assert ok.learner.offload == ("reference", "optimizer")


@pytest.mark.parametrize("overrides,message", [
    (dict(algo__gamma=1.5), "algo.gamma=1.5: must be in [0, 1]"),
    (dict(algo__gae_lambda=-0.1), "algo.gae_lambda=-0.1: must be in [0, 1]"),
    (dict(algo__estimator="a2c"), "algo.estimator='a2c': must be one of ['grpo_family', 'ppo']"),
    (dict(algo__vf_coef=-1.0), "algo.vf_coef=-1.0: must be >= 0"),
    (dict(algo__estimator="ppo", algo__loss="gspo"), "algo.loss='gspo': algo.estimator='ppo' needs a token-level loss"),
    (dict(learner__offload=("activations",)), "learner.offload=('activations',): 'activations' is not a component"),
    (dict(learner__offload=("reference",)), "learner.offload=('reference',): 'reference' does not exist"),
    (dict(algo__estimator="ppo", learner__offload=("critic",)), "learner.offload=('critic',): 'critic' does not exist"),
    (dict(model__critic_path="/tmp/critic"), "model.critic_path='/tmp/critic': a critic is only used with"),
    (dict(algo__estimator="ppo", lora__rank=4), "lora.rank=4: algo.estimator='ppo'"),
])
def test_bad_values_name_the_key(overrides, message):
  with pytest.raises(config_lib.ConfigError) as e:
    build(**overrides)
  assert message in str(e.value)
