"""The by-host layout's checks on one process (its meshes are tested on several: test_cross_host.py)."""

import pytest

from tunixlike import mesh as mesh_lib
from tunixlike.hosts import layout


def test_one_process_cannot_be_split_into_whole_hosts():
  with pytest.raises(mesh_lib.MeshError, match=r"mesh.sampler_hosts=1 must be >= 1 and leave a learner host "
                                               r"among the 1 processes"):
    layout.make_host_layout(1, sampler_tensor=1, learner_tensor=1)
  with pytest.raises(mesh_lib.MeshError, match="mesh.sampler_hosts=0"):
    layout.make_host_layout(0, sampler_tensor=1, learner_tensor=1)


def test_send_order_feeds_each_relay_before_it_sends():
  import types
  from tunixlike.hosts import transfer
  chain = types.SimpleNamespace(learner_hosts=(0,), sampler_hosts=(1, 2, 3), senders={1: 2, 2: 0, 3: 1})
  assert transfer.send_order(chain) == [2, 1, 3]
  loop = types.SimpleNamespace(learner_hosts=(0,), sampler_hosts=(1, 2), senders={1: 2, 2: 1})
  with pytest.raises(ValueError, match=r"sampler hosts \[1, 2\] never get the weights"):
    transfer.send_order(loop)


def test_the_cli_refuses_whole_sampler_hosts_it_cannot_make(tmp_path):
  # One process: no host is left to train. Colocated: whole hosts share no devices. Both one line, exit 2.
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cases = [(["--config.mesh.sampler_hosts=1", f"--workdir={tmp_path}"],
            "mesh.sampler_hosts=1 must leave a learner host among the 1 processes"),
           (["--config.mesh.sampler_hosts=1", "--config.mesh.layout=colocated", "--check_only"],
            "mesh.sampler_hosts=1: needs mesh.layout='split'")]
  for args, expected in cases:
    out = subprocess.run([sys.executable, "-m", "tunixlike.train", "--config", "configs/addition_grpo.py:size=tiny",
                          "--config.warm_start.max_steps=0", *args], cwd=root, capture_output=True, text=True,
                         timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and expected in lines[0], out.stderr[-2000:]
