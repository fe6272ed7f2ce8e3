"""Train with async RL.

  python -m tunixlike.train --config configs/addition_grpo.py --workdir runs/addition
  python -m tunixlike.train --config gsm8k_grpo:size=tiny --config.rl.max_staleness=2 --workdir DIR
  python -m tunixlike.train --list_configs

`--config` is a Python file with `get_config(arg)` (`file.py:arg` selects a variant), or the name of one
that ships with tunixlike (`--list_configs`), which works from any directory once tunixlike is installed;
any key can be overridden with `--config.section.key=value`. Running again with the same --workdir resumes.
A bad flag, unknown key, wrong type or invalid value prints one line naming it and exits with status 2.
`--check_only` stops there, after also checking the run's inputs (`tunixlike.preflight`): the data files, the
columns the config names, the prompts' lengths and one call of each reward.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

from absl import flags
from ml_collections import config_flags

from tunixlike import cli, compilation_cache, config as config_lib, shipped_configs

_CONFIG = cli.refuse_none(config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py[:variant]) or a shipped config's name (addition_grpo[:variant]; "
    "--list_configs).", lock_config=True))
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl, TensorBoard "
                               "events and plots. Reusing it resumes the run.")
_LIST_CONFIGS = flags.DEFINE_bool("list_configs", False, "Print the configs that ship with tunixlike (the names "
                                   "--config takes) and where their files are, then exit.")
_CHECK_ONLY = flags.DEFINE_bool("check_only", False, "Validate the config, read the first rows of the data and call "
                                "each reward once on one (no JAX backend, no model), then exit.")


PROG = "tunixlike.train"


def device_count_error(raw) -> str | None:
  """A mesh that does not add up to this machine's devices, which a run reports before any rule the
  config derives from the mesh (--check_only never starts a JAX backend; several processes see each
  other's devices only once jax.distributed runs, so this is left to the run then)."""
  if _CHECK_ONLY.value:
    return None
  import jax
  from tunixlike import distributed, mesh
  d = raw.get("distributed") or {}
  if any(d.get(k) for k in ("coordinator_address", "num_processes", "auto_detect")) or \
      os.environ.get(distributed.ENV_NUM_PROCESSES, "1") not in ("", "1"):
    return None
  m = raw.get("mesh") or {}
  sizes = (m.get("sampler_devices"), m.get("learner_devices"))
  if not all(type(n) is int and n > 0 for n in sizes):
    return None  # the validation error names the key
  try:
    mesh.split_devices(*sizes, jax.devices())
  except mesh.MeshError as e:
    return str(e)
  return None


def parse(argv: list[str], prog: str = PROG) -> tuple[config_lib.Config | None, str | None]:
  """Parses flags into a validated Config (None only with --list_configs); exits with status 2 and one
  clear line on bad input."""
  cfg = cli.parse_config(prog, argv, _CONFIG, first_check=device_count_error)
  if cfg is None and not _LIST_CONFIGS.value:
    cli.fail(prog, "--config is required (e.g. --config addition_grpo; --list_configs names the shipped ones)")
  return cfg, _WORKDIR.value


def main(argv: list[str] | None = None, *, prog: str = PROG, module=None, check=lambda cfg: None):
  """`prog` and `module` name another command built on this one (`tunixlike.sft`); `check(cfg)`
  returns its complaint about a valid config, or None."""
  argv = list(sys.argv if argv is None else argv)
  if cli.wants_help(argv):
    print(cli.usage(module or sys.modules[__name__]))
    return
  cfg, workdir = parse(argv, prog)
  if _LIST_CONFIGS.value:
    print(shipped_configs.table())
    return
  complaint = check(cfg)
  if complaint:
    cli.fail(prog, complaint)
  if _CHECK_ONLY.value:
    from tunixlike import preflight  # noqa: PLC0415 (reads the data and loads the rewards: only when asked)
    try:
      checked = preflight.check(cfg)
    except preflight.PreflightError as e:
      cli.fail(prog, str(e))
    print(f"config OK; {checked}")
    return
  if workdir is None:
    cli.fail(prog, "--workdir is required")
  _watched(cfg, prog)
  compilation_cache.enable()  # before any compile: a second start loads its programs (TUNIXLIKE_COMPILATION_CACHE)
  from tunixlike import checkpoint, layouts, mesh
  from tunixlike.multi_agent import trainer as multi_agent_trainer
  from tunixlike.rl import trainer  # heavy imports only once the config is known to be good
  # Orbax's async writes leave failed asyncio tasks behind when a save fails (a full disk): their
  # "exception was never retrieved" tracebacks, and the writes that complete after their event loop
  # closed, would bury the one line that says what happened.
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  sys.unraisablehook = _without_closed_loops
  from tunixlike.metrics import LogWriteError
  from tunixlike.rl.collapse import PolicyCollapse
  from tunixlike.rl.unlearning import Unlearning
  from tunixlike.rl.runtime import NonFiniteLoss
  from tunixlike.hosts import learner_host
  from tunixlike.hosts.kv import HostTimeout
  from tunixlike.models.sharding import ShardingError
  from tunixlike.rl.preemption import StartupInterrupted
  try:
    run = layouts.run if cfg.multi_agent.env is None else multi_agent_trainer.run  # several policies: their own stages
    run(cfg, workdir, on_second_interrupt=lambda: interrupted(prog, workdir),
        on_host_fault=functools.partial(_host_fault, prog))
  except StartupInterrupted as e:  # nothing to save yet: exit now, as the signal's default would (128 + its number)
    cli.exit_now(prog, str(e), 128 + e.signum)
  except (NonFiniteLoss, PolicyCollapse, Unlearning, LogWriteError, checkpoint.CheckpointWriteError) as e:
    cli.fail(prog, str(e), status=1)  # the run stopped itself, and says why
  except HostTimeout as e:  # a host died or hangs: exit now (JAX's shutdown would wait for that host)
    cli.exit_now(prog, str(e), 1, before_exit=functools.partial(learner_host.leave_after_fault, str(e), e.host))
  except (mesh.MeshError, ShardingError, checkpoint.CheckpointError, config_lib.ConfigError, trainer.SetupError) as e:
    cli.fail(prog, str(e))
  except KeyboardInterrupt:  # Ctrl-C before the run's own handler was installed
    interrupted(prog, workdir)


def _host_fault(prog: str, line: str, host: int | None) -> None:
  """A sampler host failed while this learner host is stuck in a collective or transfer: exit now,
  after telling the other hosts (JAX's shutdown would wait for the host at fault)."""
  from tunixlike.hosts import learner_host  # noqa: PLC0415 (imported already by the run)
  cli.exit_now(prog, line, 1, before_exit=functools.partial(learner_host.leave_after_fault, line, host))


def _watched(cfg: config_lib.Config, prog: str) -> None:
  """Whole hosts: every process runs under a watcher that says in one line why JAX's coordination
  service stopped it (`hosts.watch`); this returns in the run itself."""
  from tunixlike import distributed
  from tunixlike.hosts import watch
  if watch.watched():
    watch.die_with_parent()
    return
  try:
    d = distributed.resolve(cfg.distributed)
  except ValueError as e:
    cli.fail(prog, str(e))
  if cfg.mesh.sampler_hosts and (d.num_processes or 1) > 1:
    sys.exit(watch.supervise(prog, d.process_id or 0, d.coordinator_address))


def _without_closed_loops(unraisable, default=sys.unraisablehook):
  """Drops the 'Event loop is closed' errors of writes that finish after a failed save's loop closed
  (a full disk: one traceback per array); the save's failure itself is reported once, by the run."""
  if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
    default(unraisable)


def interrupted(prog: str = PROG, workdir: str | None = None):
  """A second Ctrl-C: stop waiting for the current step, exit 130 at once (`cli.exit_now`), saying
  what the workdir keeps (a directory listing: this runs in a signal handler)."""
  from tunixlike import checkpoint  # noqa: PLC0415 (imported already by the run this interrupts)
  step = None if workdir is None else checkpoint.last_saved_step(checkpoint.workdir_checkpoints(workdir))
  if step is not None:
    kept = f"the checkpoint of step {step} is kept; the same command resumes from it"
  elif workdir is not None and checkpoint.last_saved_step(os.path.join(workdir, checkpoint.WARM_START_SUBDIR)) \
      is not None:
    kept = "the interrupted warm start's checkpoint is kept; the same command resumes it"
  else:
    kept = "no checkpoint was saved yet; the same command starts the run again"
  cli.exit_now(prog, f"interrupted (a second Ctrl-C); {kept}", 130)


if __name__ == "__main__":
  main()
