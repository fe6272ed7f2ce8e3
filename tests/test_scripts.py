"""Launch scripts: syntax, --help, --dry-run command lines, and errors that name the bad setting.

No script is ever run for real here (this machine has no GCP access): every call passes --dry-run,
and the printed commands ("+ cmd ...", shell-quoted) are parsed back with shlex and checked.
"""

import os
import shlex
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
NAMES = ["tpu_vm_create.sh", "tpu_vm_setup.sh", "tpu_vm_run.sh", "gpu_multinode.sh"]
# Settings the scripts read; cleared so the caller's environment cannot change what is tested.
SETTINGS = ["PROJECT", "ZONE", "TPU_NAME", "ACCELERATOR_TYPE", "RUNTIME_VERSION", "QUEUED", "QUEUED_RESOURCE",
            "SPOT", "BUCKET", "CONFIG", "RUN_NAME", "WORKDIR", "LOG_DIR", "REMOTE_DIR", "VENV", "REPO_URL",
            "REPO_REF", "PYTHON_VERSION", "JAX_TPU_INDEX", "EXTRA_PIP", "GPUS_PER_NODE", "NNODES", "PORT",
            "PYTHON", "COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "DRY_RUN", "SLURM_JOB_ID",
            "SLURM_JOB_NUM_NODES", "SLURM_GPUS_ON_NODE", "SLURM_SUBMIT_DIR", "SAMPLER_HOSTS",
            "TUNIXLIKE_HOSTS_SECRET_FILE"]


def _run(name, *args, env=None, cwd=None):
  full_env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
  full_env.update(env or {})
  return subprocess.run(["bash", os.path.join(SCRIPTS, name), *args], env=full_env, cwd=cwd or ROOT,
                        capture_output=True, text=True, timeout=60)


def _commands(result) -> list[list[str]]:
  """The argv of every command the script printed (lines "+ ..."), parsed as a shell would."""
  assert result.returncode == 0, result.stderr
  return [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]


def _flags(argv: list[str]) -> dict[str, str]:
  return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


@pytest.mark.parametrize("name", NAMES)
def test_syntax_executable_strict_mode_and_help(name):
  path = os.path.join(SCRIPTS, name)
  assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
  assert os.stat(path).st_mode & stat.S_IXUSR, f"{name} is not executable"
  text = open(path).read()
  assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
  result = _run(name, "--help")
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines()[0] == text.splitlines()[1][2:]  # the header, without "# "
  assert "--dry-run" in result.stdout and "SBATCH" not in result.stdout
  bad = _run(name, "--no-such-flag", "--dry-run")
  assert bad.returncode == 2 and "--no-such-flag" in bad.stderr and not bad.stdout.startswith("+")
  assert subprocess.run(["bash", "-n", os.path.join(SCRIPTS, "_common.sh")]).returncode == 0


def test_create_single_host_and_pod_slice():
  (cmd,) = _commands(_run("tpu_vm_create.sh", "--dry-run",
                          env={"PROJECT": "proj", "ZONE": "us-west4-a", "TPU_NAME": "one",
                               "ACCELERATOR_TYPE": "v5litepod-8"}))
  assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "one"]
  assert _flags(cmd) == {"zone": "us-west4-a", "project": "proj", "accelerator-type": "v5litepod-8",
                         "version": "v2-alpha-tpuv5-lite"}
  (cmd,) = _commands(_run("tpu_vm_create.sh", "--dry-run", env={"ACCELERATOR_TYPE": "v4-16", "SPOT": "1"}))
  assert _flags(cmd) == {"zone": "us-central2-b", "accelerator-type": "v4-16", "version": "tpu-ubuntu2204-base"}
  assert "--spot" in cmd and "--project" not in " ".join(cmd)  # no PROJECT: gcloud's default
  (cmd,) = _commands(_run("tpu_vm_create.sh", "--dry-run",
                          env={"ACCELERATOR_TYPE": "v5p-16", "QUEUED": "1", "TPU_NAME": "pod",
                               "RUNTIME_VERSION": "custom-rt"}))
  assert cmd[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "pod-qr"]
  assert _flags(cmd)["node-id"] == "pod" and _flags(cmd)["accelerator-type"] == "v5p-16"
  assert _flags(cmd)["runtime-version"] == "custom-rt"  # the environment overrides the default
  bad = _run("tpu_vm_create.sh", "--dry-run", env={"ACCELERATOR_TYPE": "tpu9-8"})
  assert bad.returncode == 2 and "ACCELERATOR_TYPE='tpu9-8'" in bad.stderr and "RUNTIME_VERSION" in bad.stderr


def test_setup_runs_everything_on_all_workers(tmp_path):
  env = {"TPU_NAME": "pod", "ZONE": "europe-west4-a", "TMPDIR": str(tmp_path)}
  cmds = _commands(_run("tpu_vm_setup.sh", "--dry-run", env=env))
  tar, scp, *ssh = cmds
  assert tar[0] == "tar" and tar[tar.index("-C") + 1] == ROOT and "--exclude=.git" in tar
  assert not os.path.exists(tmp_path / "tunixlike-src.tgz")  # dry run: nothing packed
  assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "pod:tunixlike-src.tgz" in scp
  for cmd in [scp, *ssh]:
    assert "--worker=all" in cmd and _flags(cmd)["zone"] == "europe-west4-a"
  for cmd in ssh:
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod"]
  remote = [_flags(c)["command"] for c in ssh]
  assert "tar -xzf ~/tunixlike-src.tgz -C ~/tunixlike" in remote[0]
  install = remote[1]
  assert ('pip install ~/tunixlike "jax[tpu]" -f https://storage.googleapis.com/jax-releases/libtpu_releases.html'
          in install)  # the package, not an editable checkout
  assert "pip install -e" not in install
  assert "python3.11 -m venv ~/tunixlike-venv" in install
  assert "import jax" in remote[2] and "jax.device_count()" in remote[2]
  # A git checkout instead of the tarball; libtpu from PyPI only.
  cmds = _commands(_run("tpu_vm_setup.sh", "--dry-run",
                        env={**env, "REPO_URL": "https://example.com/t.git", "REPO_REF": "v1", "JAX_TPU_INDEX": ""}))
  assert all(c[0] == "gcloud" for c in cmds) and len(cmds) == 3
  assert "git clone --depth 1 --branch v1 https://example.com/t.git ~/tunixlike" in _flags(cmds[0])["command"]
  assert "libtpu_releases" not in _flags(cmds[1])["command"]


def test_run_on_all_workers_with_gs_workdir_and_per_worker_logs(tmp_path):
  env = {"TPU_NAME": "pod", "BUCKET": "gs://my-bucket", "CONFIG": "configs/addition_grpo.py:size=tiny",
         "RUN_NAME": "r1", "PROJECT": "proj"}
  mkdir, ssh = _commands(_run("tpu_vm_run.sh", "--dry-run", "--", "--config.rl.max_staleness=2",
                              "--config.data.name=a b", env=env, cwd=tmp_path))
  assert mkdir == ["mkdir", "-p", "logs/r1"] and not os.path.exists(tmp_path / "logs")
  assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod"] and "--worker=all" in ssh
  flags = _flags(ssh)
  assert flags["output-directory"] == "logs/r1" and flags["project"] == "proj"
  remote = shlex.split(flags["command"])  # what each worker's shell runs
  assert remote[:3] == ["cd", "~/tunixlike", "&&"]
  train = remote[3:remote.index("2>&1")]
  assert train[:4] == ["~/tunixlike-venv/bin/python", "-P", "-m", "tunixlike.train"]  # -P: the installed package
  assert _flags(train) == {"config": "configs/addition_grpo.py:size=tiny", "workdir": "gs://my-bucket/tunixlike/r1",
                           "config.rl.max_staleness": "2", "config.data.name": "a b"}
  # Default run name from the config and the time; an explicit WORKDIR needs no bucket.
  (_, ssh) = _commands(_run("tpu_vm_run.sh", "--dry-run", env={"WORKDIR": "gs://b/w"}, cwd=tmp_path))
  assert "--workdir=gs://b/w" in shlex.split(_flags(ssh)["command"])
  assert "--config=addition_grpo" in shlex.split(_flags(ssh)["command"])  # a shipped config, by name
  assert _flags(ssh)["output-directory"].startswith("logs/addition_grpo-")
  bad = _run("tpu_vm_run.sh", "--dry-run", cwd=tmp_path)
  assert bad.returncode == 2 and "BUCKET is not set" in bad.stderr


def test_gpu_explicit_mode_sets_the_distributed_environment():
  (cmd,) = _commands(_run("gpu_multinode.sh", "--dry-run", "--coordinator=10.0.0.1:1234", "--num-processes=2",
                          "--process-id=1", "--", "--config.rl.max_staleness=1",
                          env={"WORKDIR": "/shared/run", "GPUS_PER_NODE": "4", "CONFIG": "configs/x.py"}))
  assert cmd[0] == "env"
  env = dict(a.split("=", 1) for a in cmd[1:5])
  assert env == {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
                 "JAX_LOCAL_DEVICE_IDS": "0,1,2,3"}
  assert cmd[5:8] == ["python3", "-m", "tunixlike.train"]
  assert _flags(cmd[8:]) == {"config": "configs/x.py", "workdir": "/shared/run", "config.rl.max_staleness": "1"}
  # The same through environment variables; explicit settings win inside a SLURM allocation.
  (cmd,) = _commands(_run("gpu_multinode.sh", "--dry-run", env={
      "COORDINATOR": "h:1", "NUM_PROCESSES": "3", "PROCESS_ID": "2", "WORKDIR": "w", "SLURM_JOB_ID": "7"}))
  assert cmd[0] == "env" and "JAX_PROCESS_ID=2" in cmd
  for args, env, message in [
      (["--coordinator=h:1", "--num-processes=2", "--process-id=2"], {"WORKDIR": "w"}, "PROCESS_ID='2'"),
      (["--coordinator=h", "--num-processes=2", "--process-id=0"], {"WORKDIR": "w"}, "COORDINATOR='h'"),
      (["--coordinator=h:1", "--num-processes=2", "--process-id=0"], {}, "WORKDIR is not set"),
      (["--coordinator=h:1", "--num-processes=2", "--process-id=0"], {"WORKDIR": "w", "GPUS_PER_NODE": "0"},
       "GPUS_PER_NODE='0'")]:
    bad = _run("gpu_multinode.sh", "--dry-run", *args, env=env)
    assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr)


def test_gpu_slurm_task_line_runs_with_each_tasks_ids(tmp_path):
  """The srun line's per-task command, executed with stand-ins for scontrol and python."""
  (cmd,) = _commands(_run("gpu_multinode.sh", "--dry-run", "--", "--config.rl.max_staleness=1",
                          env={"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "2",
                               "PORT": "23456", "PYTHON": str(tmp_path / "python")}))
  assert cmd[:2] == ["srun", "--nodes=3"] and "--ntasks-per-node=1" in cmd and cmd[-3:-1] == ["bash", "-c"]
  (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")
  (tmp_path / "python").write_text("#!/bin/sh\nenv | grep '^JAX_' | sort\necho \"ARGS $*\"\n")
  for f in ("scontrol", "python"):
    os.chmod(tmp_path / f, 0o755)
  outputs = []
  for procid in range(3):
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-c]",
           "SLURM_NTASKS": "3", "SLURM_PROCID": str(procid)}
    out = subprocess.run(["bash", "-c", cmd[-1]], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    outputs.append(out.stdout.splitlines())
  for procid, lines in enumerate(outputs):
    assert lines == ["JAX_COORDINATOR_ADDRESS=gpu-a:23456", "JAX_LOCAL_DEVICE_IDS=0,1", "JAX_NUM_PROCESSES=3",
                     f"JAX_PROCESS_ID={procid}",
                     "ARGS -m tunixlike.train --config=addition_grpo "
                     "--workdir=runs/addition_grpo-42 --config.rl.max_staleness=1"]


def _stand_ins(tmp_path, **scripts):
  for name, text in scripts.items():
    (tmp_path / name).write_text("#!/bin/sh\n" + text)
    os.chmod(tmp_path / name, 0o755)


def test_tpu_by_host_layout_each_worker_finds_its_id_and_the_coordinator(tmp_path):
  """The by-host layout's worker line, run as each worker's shell would, with stand-ins for the
  metadata server (curl) and the trainer (python), for both formats of the list of workers."""
  env = {"TPU_NAME": "pod", "WORKDIR": "gs://b/w", "SAMPLER_HOSTS": "2", "PORT": "9000"}
  result = _run("tpu_vm_run.sh", "--dry-run", "--", "--config.rl.max_staleness=1", env=env, cwd=tmp_path)
  assert "# by-host layout: the last 2 hosts decode (sampler hosts), the others train (learner hosts)" in (
      result.stdout.splitlines())
  _, secret, scp, ssh = _commands(result)
  # the run's secret drawn into the log directory, copied to every worker; on none's command line
  assert secret[:2] == ["bash", "-c"] and "umask 077" in secret[2] and "hosts_secret" in secret[2]
  assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in scp
  remote = _flags(ssh)["command"]
  assert "export TUNIXLIKE_HOSTS_SECRET_FILE=~/.tunixlike_hosts_secret" in remote
  train = shlex.split(remote)[shlex.split(remote).index("~/tunixlike-venv/bin/python"):]
  assert _flags(train)["config.mesh.sampler_hosts"] == "2" and _flags(train)["config.rl.max_staleness"] == "1"
  home = tmp_path / "home"
  (home / "tunixlike").mkdir(parents=True)
  (home / "tunixlike-venv" / "bin").mkdir(parents=True)
  _stand_ins(home / "tunixlike-venv" / "bin", python="env | grep '^JAX_' | sort\n")
  for endpoints, first in [("t1k-w-0:0:10.0.0.7,t1k-w-1:1:10.0.0.8,t1k-w-2:2:10.0.0.9,t1k-w-3:3:10.0.0.10", "10.0.0.7"),
                           ("host-a,host-b,host-c,host-d", "host-a")]:
    for worker in range(4):
      bin_dir = tmp_path / f"bin{worker}"
      bin_dir.mkdir(exist_ok=True)
      _stand_ins(bin_dir, curl=f"""case "$*" in
  *agent-worker-number) echo {worker} ;;
  *worker-network-endpoints) echo {endpoints} ;;
  *) exit 22 ;;
esac
""")
      out = subprocess.run(["bash", "-c", remote], env={"HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"},
                           capture_output=True, text=True, timeout=30)
      assert out.returncode == 0, out.stderr
      assert out.stdout.splitlines() == [f"JAX_COORDINATOR_ADDRESS={first}:9000", "JAX_NUM_PROCESSES=4",
                                         f"JAX_PROCESS_ID={worker}"]
  # Without SAMPLER_HOSTS nothing host-specific is added (JAX finds the cluster itself).
  (_, ssh) = _commands(_run("tpu_vm_run.sh", "--dry-run", env={"WORKDIR": "gs://b/w"}, cwd=tmp_path))
  assert "curl" not in _flags(ssh)["command"] and "sampler_hosts" not in _flags(ssh)["command"]


def test_gpu_by_host_layout_passes_the_sampler_host_count_once():
  missing = _run("gpu_multinode.sh", "--dry-run", "--coordinator=h:1", "--num-processes=2", "--process-id=0",
                 "--sampler-hosts=1", env={"WORKDIR": "w"})
  assert missing.returncode == 2 and "SAMPLER_HOSTS=1 needs TUNIXLIKE_HOSTS_SECRET_FILE" in missing.stderr
  env = {"WORKDIR": "w", "GPUS_PER_NODE": "2", "TUNIXLIKE_HOSTS_SECRET_FILE": "/shared/secret"}
  for args, extra in [(["--sampler-hosts=2"], {}), ([], {"SAMPLER_HOSTS": "2"}),
                      (["--", "--config.mesh.sampler_hosts=2"], {}),
                      (["--", "--config.mesh.sampler_hosts=2"], {"SAMPLER_HOSTS": "2"})]:
    for process, role in [(0, "learner"), (1, "learner"), (2, "sampler"), (3, "sampler")]:
      result = _run("gpu_multinode.sh", "--dry-run", "--coordinator=h:1", "--num-processes=4",
                    f"--process-id={process}", *args, env={**env, **extra})
      (cmd,) = _commands(result)
      assert [a for a in cmd if "sampler_hosts" in a] == ["--config.mesh.sampler_hosts=2"], (args, extra)
      comments = [l for l in result.stdout.splitlines() if l.startswith("#")]
      assert comments == ["# by-host layout: learner hosts 0-1, sampler hosts 2-3",
                          f"# this node (process {process}): {role} host"]
  (cmd,) = _commands(_run("gpu_multinode.sh", "--dry-run", "--sampler-hosts=1",
                          env={"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "2", "TUNIXLIKE_HOSTS_SECRET_FILE": "/s"}))
  assert cmd[0] == "srun" and cmd[-1].endswith("--config.mesh.sampler_hosts=1")
  for args, extra, message in [
      (["--sampler-hosts=4"], {}, "SAMPLER_HOSTS=4 leaves no learner host among 4 hosts"),
      (["--sampler-hosts=x"], {}, "SAMPLER_HOSTS='x' is not a non-negative integer"),
      (["--", "--config.mesh.sampler_hosts=1"], {"SAMPLER_HOSTS": "2"},
       "SAMPLER_HOSTS=2 and --config.mesh.sampler_hosts=1 disagree")]:
    bad = _run("gpu_multinode.sh", "--dry-run", "--coordinator=h:1", "--num-processes=4", "--process-id=0", *args,
               env={**env, **extra})
    assert bad.returncode == 2 and message in bad.stderr and "+ " not in bad.stdout, (args, bad.stderr)
