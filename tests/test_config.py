import dataclasses
import functools
import importlib
import inspect
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


@functools.cache
def _modules() -> dict:
  """Every module of the package by name, also in packages without an __init__. A module of an optional
  extra that is not installed is left out, once its ImportError has said which extra to install."""
  package = pathlib.Path(config_lib.__file__).parent
  found = {}
  for path in sorted(package.rglob("*.py")):
    name = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
    if name in ("tunixlike.train", "tunixlike.sft", "tunixlike.eval", "tunixlike.export", "tunixlike.__main__"):
      continue  # the commands define absl flags on import; they declare no config classes
    try:
      found[name] = importlib.import_module(name)
    except ImportError as e:  # a module of an optional extra: as a user without the extra meets it
      assert "pip install 'tunixlike[" in str(e), f"{name} needs a package that is not installed: {e}"
  return found


def _tree_sections() -> set[type]:
  sections, stack = set(), [config_lib.Config]
  while stack:
    cls = stack.pop()
    sections.add(cls)
    stack += [type(f.default) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default)]
  return sections


@functools.cache
def _library_configs():
  """Every dataclass of the package that is not a section of the run's config tree: the `*Config`s and
  the other library inputs (`SamplingParams`, the tasks, `ExampleFormat`, ...)."""
  sections, found = _tree_sections(), {}
  for name, module in _modules().items():
    for obj in vars(module).values():
      if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == name and obj not in sections:
        found[f"{name}.{obj.__name__}"] = obj
  return found


def _copied_defaults(classes) -> list[str]:
  """What breaks "each setting defined once" in these library configs: a field that is a config key
  (`settings.tree_key`) has no default of its own and names a real key; a field with a default that is
  named like a key must be one, unless that key takes its default from it (`settings.library_setting`). A
  default of None is "not given" (e.g. a request's own `max_new_tokens`), not a copy of a value."""
  tree = dict(settings.keys(config_lib.Config))
  names = {key.rpartition(".")[2]: key for key in tree}
  problems = []
  for path, cls in classes.items():
    for f in dataclasses.fields(cls):
      key = f.metadata.get("tree_key")
      has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
      if key is None and f.default is None:
        continue
      if key is not None:
        if key not in tree:
          problems.append(f"{path}.{f.name}: tree_key({key!r}) is no config key")
        elif has_default:
          problems.append(f"{path}.{f.name}: has a default of its own besides {key}'s")
      elif has_default and f.name in names and tree[names[f.name]].metadata.get("default_of") != (cls, f.name):
        problems.append(f"{path}.{f.name}={f.default!r}: a copy of the config's {names[f.name]}="
                        f"{tree[names[f.name]].default!r}; make it a tree_key")
  return problems


def test_no_library_config_declares_a_default_of_the_tree():
  classes = _library_configs()
  assert {"ModelConfig", "LoRAConfig", "AgentConfig", "EpisodeConfig", "CollapseConfig", "StepConfig",
          "PipelineConfig", "AdvantageConfig", "SamplingParams", "AdditionTask", "DatasetTask",
          "ExampleFormat"} <= {path.rpartition(".")[2] for path in classes}
  problems = _copied_defaults(classes)
  assert not problems, "\n".join(problems)


def test_a_copied_default_or_a_key_that_does_not_exist_is_found():
  @dataclasses.dataclass(frozen=True)
  class CopyConfig(settings.FromConfig):
    spike_factor: float = settings.tree_key("rl.spike_factor")  # no such key
    num_steps: int = 60  # rl.num_steps's default, written a second time
    prompts_per_step: int = dataclasses.field(default=32, metadata={"tree_key": "rl.prompts_per_step"})
    window: int = 20  # not a key: may have its own default

  problems = _copied_defaults({"CopyConfig": CopyConfig})
  assert [p.split(":")[0].split("=")[0] for p in problems] == [
      "CopyConfig.spike_factor", "CopyConfig.num_steps", "CopyConfig.prompts_per_step"], problems


def _public_signatures() -> dict[str, inspect.Signature]:
  """'module.function', 'module.Class' (its constructor) and 'module.Class.method' -> signature, for every
  public function, class and method the package defines (a dataclass's constructor is its fields: the
  test above checks those)."""
  found = {}

  def add(path, fn):
    try:
      found[path] = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin's, e.g. an inherited object.__init__
      pass

  for name, module in _modules().items():
    for attr, obj in vars(module).items():
      if attr.startswith("_") or getattr(obj, "__module__", None) != name:
        continue
      if inspect.isfunction(obj):
        add(f"{name}.{attr}", obj)
      elif isinstance(obj, type):
        if not dataclasses.is_dataclass(obj) and "__init__" in vars(obj):
          add(f"{name}.{attr}", obj.__init__)
        for method, fn in vars(obj).items():
          fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
          if not method.startswith("_") and inspect.isfunction(fn):
            add(f"{name}.{attr}.{method}", fn)
  return found


def _keys_named(param: str, leaves: dict[str, list[str]]) -> list[str]:
  """The config keys a parameter named `param` stands for: a key's last part is `param`, or one of the two
  names ends with the other after an underscore, where the shorter has an underscore itself
  (`max_turns`: rl.env_max_turns; `save_every_steps`: checkpoint.every_steps; not `mode` or `every`)."""
  return [key for leaf, keys in leaves.items() for key in keys if leaf == param
          or "_" in param and leaf.endswith("_" + param) or "_" in leaf and param.endswith("_" + leaf)]


# Parameters named like a key that are not that key, each with what it is instead. Anything else named like a
# key takes it from the caller (no default) or from the section it is part of.
NOT_THE_KEY = {
    "tunixlike.checkpoint.Checkpointer.keep_every_steps": "steps kept for replays (a run passes log.replay_every), "
                                                          "not checkpoint.every_steps, the save interval",
    "tunixlike.flops.peak_matmul_flops.dtype": "the dtype of the matmul whose peak it measures, not the model's",
    "tunixlike.learner.gae.kl_penalized_rewards.estimator": "the KL estimate PPO folds into its rewards "
                                                            "(ppo.KL_REWARD_ESTIMATOR), not algo.estimator",
    "tunixlike.learner.gae.masked_whiten.eps": "whitening's epsilon, not Adam's (optim.eps)",
    "tunixlike.learner.logprobs.chunked_token_logprobs.temperature": "what the logits are divided by: 1.0 is the "
                                                                     "model's own distribution",
    "tunixlike.learner.sampling_mask.processed_logits.temperature": "what the logits are divided by: 1.0 is the "
                                                                    "model's own distribution",
    "tunixlike.models.context_parallel.attend.layout": "the order of the tokens it is given (contiguous: the row's "
                                                       "own; model.context_parallel_layout's values), not mesh.layout",
    "tunixlike.models.testing.tiny_hf_config.tie_embeddings": "a test checkpoint's own description",
    "tunixlike.models.testing.write_random_hf_checkpoint.tie_embeddings": "a test checkpoint's own description",
    "tunixlike.models.testing.write_random_hf_checkpoint.seed": "a test checkpoint's own description",
    "tunixlike.models.testing.write_random_hf_checkpoint.dtype": "a test checkpoint's own description",
    "tunixlike.rl.evaluate.eval_sampler_config.temperature": "the held-out eval's decoding: 0 = greedy, as every "
                                                             "eval; not the training sampler's",
    "tunixlike.sampler.paged.PagedEngine.attention": "the paged decode attention (auto | pool | kernel), not "
                                                     "model.attention, the training and prefill kernel",
}


def _restated_defaults(signatures: dict[str, inspect.Signature], not_the_key=()) -> list[str]:
  """What breaks "each setting defined once" in signatures: a parameter named like a config key with a
  default of its own (None, "not given", excepted). Its callers pass the key's value, or it takes the
  section (or its `FromConfig` class) the key is part of."""
  leaves: dict[str, list[str]] = {}
  for key, _ in settings.keys(config_lib.Config):
    leaves.setdefault(key.rpartition(".")[2], []).append(key)
  problems = []
  for path, sig in signatures.items():
    for p in sig.parameters.values():
      keys = _keys_named(p.name, leaves)
      if keys and p.default is not inspect.Parameter.empty and p.default is not None \
          and f"{path}.{p.name}" not in not_the_key:
        problems.append(f"{path}({p.name}={p.default!r}): a default for {', '.join(keys)}; make it required "
                        "or take the section")
  return problems


def test_no_public_signature_declares_a_default_of_the_tree():
  signatures = _public_signatures()
  assert {"tunixlike.checkpoint.Checkpointer", "tunixlike.rewards.combine.CombinedReward",
          "tunixlike.sampler.driver.RolloutDriver.stop", "tunixlike.mesh.make_meshes"} <= set(signatures)
  problems = _restated_defaults(signatures, NOT_THE_KEY)
  assert not problems, "\n".join(problems)
  flagged = {p.split("(")[0] + "." + p.split("(")[1].split("=")[0] for p in _restated_defaults(signatures)}
  assert set(NOT_THE_KEY) <= flagged, f"no longer named like a key: {sorted(set(NOT_THE_KEY) - flagged)}"


def test_a_default_in_a_signature_that_restates_a_key_is_found():
  def stop(timeout_s: float = 60.0): ...  # distributed.timeout_s, eval.timeout_s

  class Coordinator:
    def __init__(self, *, max_turns: int = 8, save_every_steps: int = 0, mode: str = "full", seed=None, keep: int):
      ...  # rl.env_max_turns, checkpoint.every_steps; `mode` names no key; None is "not given"; no default

  problems = _restated_defaults({"stop": inspect.signature(stop), "Coordinator": inspect.signature(Coordinator)})
  assert [p.split("=")[0] for p in problems] == ["stop(timeout_s", "Coordinator(max_turns",
                                                 "Coordinator(save_every_steps"]
  assert "rl.env_max_turns" in problems[1] and "checkpoint.every_steps" in problems[2], problems


@pytest.mark.parametrize("path", sorted(path for path, cls in _library_configs().items()
                                         if issubclass(cls, settings.FromConfig)))
def test_library_configs_built_from_the_defaults_are_the_cli_defaults(path):
  """Library users (the Python API) get the same defaults as CLI users: `from_config(Config())`."""
  cls = _library_configs()[path]
  keys = {f.name: f.metadata["tree_key"] for f in dataclasses.fields(cls) if "tree_key" in f.metadata}
  required = {f.name: 1 for f in dataclasses.fields(cls) if "tree_key" not in f.metadata
              and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
  run = config_lib.replace(config_lib.Config(), lora=dict(rank=4))  # LoRAConfig needs adapters
  built = cls.from_config(run, **required)
  for name, key in keys.items():
    section, _, leaf = key.rpartition(".")
    assert getattr(built, name) == getattr(getattr(run, section), leaf), (name, key)


def test_the_library_collapse_guard_and_pipeline_are_the_clis():
  """The two defaults that once disagreed (a spike guard off, prompts never filtered)."""
  from tunixlike.data.pipeline import PipelineConfig
  from tunixlike.rl.collapse import CollapseConfig
  run = config_lib.Config()
  assert CollapseConfig.from_config(run, vocab_size=83).spike_factor == run.rl.collapse_spike_factor == 1000.0
  assert PipelineConfig.from_config(run).max_prompt_tokens == run.data.max_prompt_length == 64


def test_model_keys_take_their_defaults_from_the_model_description():
  from tunixlike.models.config import ModelConfig
  model = config_lib.Config().model
  for f in dataclasses.fields(ModelConfig):
    if hasattr(model, f.name) and f.default is not dataclasses.MISSING:
      assert getattr(model, f.name) == f.default, f.name


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
    ("data", "train_size", 0, "data.train_size=0: must be an int >= 1"),
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


# ---- rules that read several sections: each checked in one place, for files and in-memory inputs alike --
def test_a_group_must_fit_the_decode_slots_checked_by_the_sampler_section():
  message = r"sampler.max_concurrent_decodes: 4 decode slots \(per process\) are fewer than algo.group_size=8"
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.replace(config_lib.Config(), sampler=dict(max_concurrent_decodes=4))
  with pytest.raises(config_lib.ConfigError, match=message):  # the same check, on one process's share
    SamplerConfig(max_concurrent_decodes=4, group_size=8)


def test_the_cosine_warm_up_is_checked_by_the_optim_section():
  from tunixlike.learner import optimizer
  from tunixlike.learner.config import OptimConfig
  from tunixlike.rl import build
  message = r"optim.warmup_steps=10: cosine decays to 0 at rl.num_steps=10: must be less"
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.replace(config_lib.Config(), optim=dict(schedule="cosine", warmup_steps=10), rl=dict(num_steps=10))
  with pytest.raises(config_lib.ConfigError, match=message):
    OptimConfig(schedule="cosine", warmup_steps=10, total_steps=10)
  # The supervised stage alone (rl.num_steps=0) still builds a learner: its never-used schedule is valid.
  sft = config_lib.replace(config_lib.Config(), optim=dict(schedule="cosine", warmup_steps=10, learning_rate=1e-3),
                              rl=dict(num_steps=0))
  optimizer.make_schedule(build.learner_config(sft).optim)


class _Env:
  pass


def _agent(base_url, api_key, episode_id, row):
  return None


@pytest.mark.parametrize("cfg_changes, inputs, message", [
    ({}, dict(env=_Env, agent=_agent), r"rl.agent='<in memory>:_agent': and rl.env='<in memory>:_Env' are both set"),
    ({"rl": {"env": "calculator"}}, dict(agent=_agent), r"rl.agent='<in memory>:_agent': and rl.env='calculator'"),
    ({"warm_start": {"max_steps": 5}}, dict(dataset=[{"prompt": "1+1="}]),
     r"warm_start.max_steps=5: the supervised stage on your own data needs its answers"),
    ({"sampler": {"record_sampling_mask": True}}, dict(agent=_agent),
     r"sampler.record_sampling_mask=True: is not supported with rl.agent"),
])
def test_inputs_given_in_memory_go_through_the_configs_checks(cfg_changes, inputs, message):
  """`tunixlike.train(dataset=..., env=..., agent=...)`: `build.with_inputs` puts them in place of
  data.train / rl.env / rl.agent, so the config's one check of each rule sees them."""
  from tunixlike.rl import build
  cfg = config_lib.replace(config_lib.Config(), **cfg_changes)
  with pytest.raises(config_lib.ConfigError, match=message):
    build.with_inputs(cfg, **inputs)
  with pytest.raises(config_lib.ConfigError, match=message):  # build checks them before anything is built
    build.build(cfg, **inputs)


def test_inputs_given_in_memory_that_the_config_allows_pass():
  from tunixlike.rl import build
  cfg = build.with_inputs(config_lib.Config(), dataset=[{"prompt": "1+1=", "answer": "2"}], agent=_agent)
  assert cfg.data.train == "<in memory>:list" and cfg.rl.agent == "<in memory>:_agent"


def test_choice_lists_are_their_registries():
  """data.task, learner.offload and rl.env's built-in names are checked against the registries the run uses."""
  from tunixlike.data import tasks
  from tunixlike.learner import offload
  from tunixlike.rewards.envs import CalculatorEnv
  from tunixlike.rl import build
  from tunixlike.rl.config import BUILT_IN_ENVS
  assert config_lib.TASKS is tasks.TASKS and offload.COMPONENTS is config_lib.OFFLOAD_COMPONENTS
  for name in tasks.TASKS:
    config_lib.replace(config_lib.Config(), data=dict(task=name))
  for name in BUILT_IN_ENVS:
    assert build.env_factory(config_lib.replace(config_lib.Config(), rl=dict(env=name))) is CalculatorEnv
  with pytest.raises(config_lib.ConfigError, match="rl.env='chess': must be 'calculator' or an import path"):
    config_lib.replace(config_lib.Config(), rl=dict(env="chess"))
