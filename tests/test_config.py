import dataclasses
import importlib
import pathlib

import pytest

from tunixlike import config as config_lib, settings
from tunixlike.rl.config import RuntimeConfig
from tunixlike.sampler.config import SamplerConfig

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def test_base_config_builds_typed_frozen_sections():
  cfg = config_lib.from_config_dict(config_lib.default_config_dict())
  assert isinstance(cfg.rl, RuntimeConfig) and isinstance(cfg.sampler, SamplerConfig)
  assert cfg.lora.targets == tuple(config_lib.default_config_dict().lora.targets)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.rl.num_steps = 3


def test_every_key_is_a_field_with_a_why_and_run_values_are_not_keys():
  def keys(d, prefix=""):
    for k, v in d.items():
      if isinstance(v, dict):
        yield from keys(v, f"{prefix}{k}.")
      else:
        yield f"{prefix}{k}"

  fields = dict(settings.keys(config_lib.Config))
  assert set(keys(config_lib.default_config_dict().to_dict())) == set(fields)
  assert all(f.metadata.get("help") for f in fields.values())
  for key in ("sampler.eos_ids", "sampler.group_size", "optim.total_steps", "algo.sampling_temperature"):
    assert key not in fields
  with pytest.raises(config_lib.ConfigError, match="sampler.eos_ids: unknown config key"):
    config_lib.from_config_dict({"sampler": {"eos_ids": (1,)}})


def _library_default(cls_path: str, field: str):
  module, name = cls_path.rsplit(".", 1)
  cls = getattr(importlib.import_module(f"tunixlike.{module}"), name)
  return {f.name: f.default for f in dataclasses.fields(cls)}[field]


_KNOWN_DIFFERENT = "issue 42 (finding 1): a library config re-declares this default and disagrees with the run's"


# A library config class used through the Python API, the field, and the run config's key it mirrors.
@pytest.mark.parametrize("cls_path, field, key", [
    ("learner.ppo.PPOConfig", "gamma", "algo.gamma"), ("learner.ppo.PPOConfig", "gae_lambda", "algo.gae_lambda"),
    ("learner.ppo.PPOConfig", "vf_coef", "algo.vf_coef"), ("learner.ppo.PPOConfig", "vf_clip", "algo.vf_clip"),
    ("learner.ppo.PPOConfig", "kl_reward_coef", "algo.kl_reward_coef"),
    ("learner.ppo.PPOConfig", "whiten_advantages", "algo.whiten_advantages"),
    ("rl.collapse.CollapseConfig", "entropy_frac", "rl.collapse_entropy_frac"),
    pytest.param("rl.collapse.CollapseConfig", "spike_factor", "rl.collapse_spike_factor",
                 marks=pytest.mark.xfail(strict=True, reason=_KNOWN_DIFFERENT)),
    ("rewards.process.StepConfig", "delimiter", "algo.step_delimiter"),
    ("rewards.process.StepConfig", "every_tokens", "algo.step_every_tokens"),
    ("rewards.process.StepConfig", "timeout_s", "rl.reward_timeout_s"),
    ("rewards.process.StepConfig", "workers", "rl.reward_workers"),
    ("agents.driver.AgentConfig", "max_turns", "rl.env_max_turns"),
    ("agents.driver.AgentConfig", "workers", "rl.agent_workers"),
    ("agents.driver.AgentConfig", "episode_timeout_s", "rl.episode_timeout_s"),
    ("agents.driver.AgentConfig", "port", "rl.agent_port"),
    ("agents.driver.AgentConfig", "host", "rl.agent_host"),
    ("agents.driver.AgentConfig", "max_body_bytes", "rl.agent_max_body_bytes"),
    ("sampler.episodes.EpisodeConfig", "max_turns", "rl.env_max_turns"),
    ("sampler.episodes.EpisodeConfig", "step_timeout_s", "rl.env_step_timeout_s"),
    ("models.lora.LoRAConfig", "alpha", "lora.alpha"), ("models.lora.LoRAConfig", "targets", "lora.targets"),
    ("data.pipeline.PipelineConfig", "seed", "data.shuffle_seed"),
    ("data.pipeline.PipelineConfig", "system_prompt", "data.system_prompt"),
    ("data.pipeline.PipelineConfig", "messages_field", "data.messages_field"),
    pytest.param("data.pipeline.PipelineConfig", "max_prompt_tokens", "data.max_prompt_length",
                 marks=pytest.mark.xfail(strict=True, reason=_KNOWN_DIFFERENT)),
] + [("models.config.ModelConfig", f, f"model.{f}") for f in (
    "rope_theta", "rms_norm_eps", "qkv_bias", "qk_norm", "tie_embeddings", "param_dtype", "dtype", "remat")])
def test_library_defaults_are_the_run_defaults(cls_path, field, key):
  """Library users (the Python API) get the same defaults as CLI users."""
  section, name = key.split(".")
  assert _library_default(cls_path, field) == getattr(getattr(config_lib.Config(), section), name)


def test_parse_arg_reads_several_keys_and_names_bad_ones():
  arg = config_lib.parse_arg("size=tiny,steps=10,fast=true", size=("default", "tiny"), steps=0, fast=False)
  assert (arg.size, arg.steps, arg.fast) == ("tiny", 10, True)
  assert config_lib.parse_arg(None, size=("default", "tiny")).size == "default"
  for bad in ("size=huge", "steps=ten", "colour=red", "size"):
    with pytest.raises(ValueError, match="unknown variant"):
      config_lib.parse_arg(bad, size=("default", "tiny"), steps=0)


def test_config_files_load_by_path_from_any_directory(tmp_path, monkeypatch):
  import os
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "addition_ppo.py")
  monkeypatch.chdir(tmp_path)
  ppo = config_lib.from_config_dict(config_lib.load(f"{path}:size=tiny"))
  assert ppo.algo.estimator == "ppo" and ppo.rl.num_steps == 3


def test_defaults_of_base_match_dataclass_defaults():
  assert config_lib.from_config_dict(config_lib.default_config_dict()) == config_lib.Config()


@pytest.mark.parametrize("section,key,value,message", [
    ("rl", "max_staleness", -1, "rl.max_staleness=-1: must be >= 0"),
    ("model", "num_kv_heads", 3, "model.num_kv_heads=3: must divide model.num_heads=4"),
    ("sampler", "top_p", 0.0, "sampler.top_p=0.0: must be in (0, 1]"),
    ("algo", "kl_estimator", "k9", "algo.kl_estimator='k9'"),
    ("data", "task", "chess", "data.task='chess'"),
    ("optim", "micro_batches", 3, "rl.prompts_per_step=32"),
    ("optim", "group_by_length", -2, "optim.group_by_length=-2: must be >= 0"),
    ("optim", "group_by_length", 4, "optim.group_by_length=4: needs optim.micro_batches >= 2"),
    ("optim", "learning_rate", float("inf"), "optim.learning_rate=inf: must be finite"),
    ("rl", "wait_timeout_s", float("nan"), "rl.wait_timeout_s=nan: must be finite"),
    ("data", "path", "/data", "data.path='/data': is only read by data.task='gsm8k'"),
    # Only colocated sides may give the learner no devices of its own (one GPU: 1 + 0).
    ("mesh", "learner_devices", 0, "mesh.learner_devices=0: must be > 0 (0 only with mesh.layout='colocated'"),
])
def test_invalid_values_name_the_key_and_value(section, key, value, message):
  raw = config_lib.default_config_dict()
  with raw.unlocked():
    raw[section][key] = value
  with pytest.raises(config_lib.ConfigError, match=r"^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
    config_lib.from_config_dict(raw)


@pytest.mark.parametrize("changes,message", [
    ({"mesh": {"layout": "shared"}}, "mesh.layout='shared': must be one of ['split', 'colocated']"),
    # Colocated, the sampler decodes on all 8 devices: 12 slots do not split over 8 replicas.
    ({"mesh": {"layout": "colocated"}, "sampler": {"max_concurrent_decodes": 12}},
     "sampler.max_concurrent_decodes=12: must be divisible by the number of sampler replicas (mesh.sampler_devices "
     "+ mesh.learner_devices (mesh.layout='colocated') / mesh.sampler_tensor = 8)"),
    # ... and the learner trains on all 8: 2 prompts x 2 samples do not split over 8 fsdp devices.
    ({"mesh": {"layout": "colocated"}, "rl": {"prompts_per_step": 2}, "algo": {"group_size": 2},
      "sampler": {"max_concurrent_decodes": 8}},
     "rl.prompts_per_step=2: prompts_per_step * algo.group_size = 4 must be divisible by optim.micro_batches * "
     "learner fsdp devices = 1 * 8 (mesh.layout='colocated': the learner uses every device)"),
])
def test_a_layout_that_does_not_fit_names_the_key(changes, message):
  raw = config_lib.default_config_dict()
  with raw.unlocked():
    for section, values in changes.items():
      for key, value in values.items():
        raw[section][key] = value
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.from_config_dict(raw)
  assert str(err.value).splitlines()[0].startswith(message)
  if changes["mesh"].get("layout") == "colocated":
    with raw.unlocked():
      raw.mesh.layout = "split"  # 4 sampler replicas and 4 learner devices: the same sizes fit
    assert config_lib.from_config_dict(raw).mesh.learner_size == 4


def test_unknown_key_and_wrong_type_are_named():
  with pytest.raises(config_lib.ConfigError, match="rl.bogus: unknown config key"):
    config_lib.from_config_dict({"rl": {"bogus": 1}})
  with pytest.raises(config_lib.ConfigError, match="rl.num_steps='3': wrong type str"):
    config_lib.from_config_dict({"rl": {"num_steps": "3"}})


def test_variant_argument_selects_tiny():
  tiny = config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py", "size=tiny"))
  assert tiny.rl.num_steps < config_lib.from_config_dict(config_lib.load(CONFIGS / "addition_grpo.py")).rl.num_steps
  with pytest.raises(ValueError, match="unknown variant"):
    config_lib.load(CONFIGS / "addition_grpo.py", "size=galactic")


def test_replace_changes_only_the_named_keys():
  cfg = config_lib.replace(config_lib.Config(), rl=dict(num_steps=3))
  assert cfg.rl.num_steps == 3 and cfg.rl.max_staleness == config_lib.Config().rl.max_staleness


def test_docs_config_reference_is_current():
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "scripts/config_reference.py", "--check", "docs/config.md"], cwd=root,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stdout + out.stderr
