"""The layout is chosen once, at the entry (`tunixlike.layouts`); rl alone starts only its own."""

import os

import jax
import pytest

import tunixlike
from tunixlike import layouts
from tunixlike.rl import build, trainer
from tunixlike.rl.in_process import InProcess

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                    "addition_grpo.py:size=tiny")


def test_the_entry_picks_the_in_process_transport_and_the_build_asks_it(tmp_path):
  cfg = tunixlike.load_config(TINY, {"mesh.layout": "colocated", "mesh.sampler_devices": 8, "mesh.learner_devices": 0})
  transport = layouts.start(cfg, str(tmp_path))
  assert isinstance(transport, InProcess) and transport.learns
  assert (transport.decoders, transport.data_shard) == (jax.process_count(), (0, 1))
  meshes = transport.meshes()  # what the build places the model and the engines on
  assert (meshes.sampler.devices.size, meshes.learner.devices.size, meshes.colocated) == (8, 8, True)


def test_rl_alone_refuses_whole_sampler_hosts_in_one_line(tmp_path):
  # Whole hosts start with their rendezvous before JAX does: only the entry point can start them.
  cfg = tunixlike.load_config(TINY, {"mesh.sampler_hosts": 1})
  line = r"^mesh.sampler_hosts=1: whole sampler hosts are started by the entry point"
  with pytest.raises(ValueError, match=line):
    build.start_processes(cfg)
  with pytest.raises(trainer.SetupError, match=line):
    trainer.run(cfg, str(tmp_path))
  assert not os.listdir(tmp_path)  # refused before the workdir is touched
