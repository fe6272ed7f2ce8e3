"""What a resume may change, and logs cut back to the restored step."""

import json

import pytest

from tunixlike import config as config_lib
from tunixlike.rl import resume


def test_only_resumable_keys_may_change():
  cfg = config_lib.Config()
  saved = json.loads(json.dumps(config_lib.Config().__dict__, default=lambda o: o.__dict__))
  later = config_lib.replace(cfg, rl=dict(num_steps=500, wait_timeout_s=9.0), log=dict(tensorboard=False),
                             checkpoint=dict(every_steps=7), mesh=dict(sampler_devices=2), eval=dict(every_steps=3))
  assert resume.config_changes(saved, later) == []
  other = config_lib.replace(cfg, data=dict(task="reverse"), optim=dict(learning_rate=1e-5), seed=3)
  assert resume.config_changes(saved, other) == ["data.task: 'addition' -> 'reverse'",
                                                 "optim.learning_rate: None -> 1e-05", "seed: 0 -> 3"]
  with pytest.raises(resume.IncompatibleResume, match=r"ck/3 was trained with other settings; resuming would "
                     r"change data.task: 'addition' -> 'reverse'.*model shape num_layers: 2 -> 4"):
    resume.check_compatible({"config": saved, "model": {"num_layers": 2}}, other, {"num_layers": 4}, "ck/3")


def test_logs_are_cut_back_to_the_checkpoint(tmp_path):
  metrics = [{"step": 0, "time_s": 1.0, "warm_start/steps": 9}, {"step": 0, "time_s": 2.0, "eval/accuracy": 0.1},
             {"step": 0, "time_s": 3.0, "loss": 0.5}, {"step": 1, "time_s": 4.0, "loss": 0.4},
             {"step": 2, "time_s": 5.0, "eval/accuracy": 0.3}, {"step": 2, "time_s": 6.0, "loss": 0.3},
             {"step": 3, "time_s": 7.0, "loss": 0.2}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics) + '{"step": 4, "ti')
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"step": s, "trained": [s]}) + "\n" for s in range(4)))
  assert resume.cut_logs(str(tmp_path), 2) == 5.0  # the wall clock continues from the eval at step 2
  kept = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert kept == metrics[:5]  # steps 0-1, and step 2's eval (saved with its checkpoint), not its training
  assert [json.loads(l)["step"] for l in (tmp_path / "prompts.jsonl").read_text().splitlines()] == [0, 1]
  assert resume.cut_logs(str(tmp_path), None) == 0.0  # no checkpoint: a fresh start keeps nothing
  assert (tmp_path / "metrics.jsonl").read_text() == "" and (tmp_path / "prompts.jsonl").read_text() == ""


def test_a_key_is_resumable_when_its_field_or_section_says_so():
  from tunixlike import settings
  from tunixlike.config import Config
  keys = set(settings.resumable_keys(Config))
  assert {"rl.num_steps", "sampler.warmup", "mesh.sampler_devices", "log.trace"} <= keys  # field; sections
  assert not keys & {"algo.loss", "optim.learning_rate", "data.task", "sampler.temperature", "seed"}
