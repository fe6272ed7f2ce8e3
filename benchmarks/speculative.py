"""Speculative decoding from sibling samples (sampler.speculative): a long-tailed GRPO batch, plain
vs speculative, on the same weights and keys; and the main job end to end with it on and off.

  python benchmarks/speculative.py [--workdir RUN] [--prompts 16] [--repeats 3] [--e2e-repeats 1] [--no-e2e]
                                  [--quick] [--out FILE]

Prints one JSON object (and writes it to --out).

Batch ("batch"): the sampler alone (`PagedEngine` + `RolloutDriver`, the main job's sampler mesh of 4
devices, its group size G = 8, temperature 1), `--prompts` held-out prompts of the addition task in
one batch, with long-tailed completion lengths: the task's answers are 4 tokens, so EOS is ignored
and each group's limit is drawn from a long tail (`--short` tokens for most groups, `--long` for one
in `--long-every`, as when a batch waits for its last, longest completions). Two models:
  trained: the main job's policy after its RL stage (the final checkpoint of `--workdir`, else of
           the plain end-to-end run below), whose G samples of a prompt agree;
  random:  the same architecture with random weights, whose samples share nothing.
With --warmup both engines first compile every decode program (`Engine.warmup`, as sampler.warmup
does; `warmup_s`). Per model, plain and speculative decoding alternate (`--repeats` each; without
--warmup the first of each is left out as compilation) on the same weights, prompts and noise keys;
per mode its fastest run (the machine is shared; each speculative run's drafter starts from the seconds
per call and the recent draft acceptance the earlier runs of that model measured, not from their
texts, as one driver of a run learns them once for every batch): `batch_s` (time to finish the batch),
`tokens_per_s`, generate calls, `busy_s` (time in the engine's calls, results fetched), `forwards`
(model forwards: decode or verify steps), `positions` (slot positions those forwards computed: decode
width x replicas x 1, or draft_tokens + 1 for a verify step), `calls_by_width` (plain / verifyN calls
per decode width, slots per replica; N: the call's verify steps), and for speculative runs the draft
acceptance, tokens per decode step (per live slot and forward), verify calls and `draft_s` (the
drafter's host work: lookups, the gate, its bookkeeping); `runs`: every run; `call_ms`: the ms per
call of each kind at each width as the speculative runs' drafters measured them (what the gate uses;
`verifyN`: a verify call of N verify steps). `identical_tokens`: every
completion's tokens equal; `max_logprob_difference`: the largest difference of a token's logprob
(fp32 sums in another order: the verify forward's are not the decode step's). `ratio_batch_s`:
speculative over plain (targets: trained <= 0.67, random <= 1.05).

End to end ("e2e", unless --no-e2e): the main job (configs/addition_grpo.py, run by rl_step.py's
`_run`) with sampler.kv_layout='paged', plain and with sampler.speculative, alternated
`--e2e-repeats` times, per mode the run of median s/step (and every run's s/step): held-out accuracy
at the first and last eval, s/step (metrics.jsonl's `time_s` over the RL steps after the first 10
and outside evals, as determinism.py measures it), and at the last step the draft acceptance, tokens
per decode step, verify calls, `draft_frac` (the share of the RL stage's wall time the drafter's host
work took on the sampler thread: what drafting costs where no draft is verified, measured within the
run) and `sampler_busy_frac` (the share in the engine's calls). The run is asynchronous, so the two
runs' batches differ by thread timing: accuracy is compared, not completions.
Without --workdir and with --no-e2e the plain main job runs once for its policy. --quick: the tiny
variant's policy (unless --workdir), 4 prompts, short limits, 2 + 2 runs, no end-to-end runs (a
smoke test).
"""

from __future__ import annotations

import collections
import functools
import pathlib
import statistics
import tempfile
import time

import harness


def _flags(p):
  p.add_argument("--workdir", default=None, help="a finished main-job run to take the trained policy from "
                 "(default: the plain end-to-end run's)")
  p.add_argument("--prompts", type=int, default=16, help="groups in the batch (G = the main job's 8 samples each)")
  p.add_argument("--short", type=int, default=16, help="completion limit of most groups")
  p.add_argument("--long", type=int, default=512, help="completion limit of the long tail")
  p.add_argument("--long-every", type=int, default=8, help="one group in this many gets --long")
  p.add_argument("--repeats", type=int, default=3, help="runs of each mode per model, alternated (the first of "
                 "each left out)")
  p.add_argument("--draft-tokens", type=int, default=None, help="sampler.draft_tokens (default: the key's default)")
  p.add_argument("--no-e2e", action="store_true", help="skip the main job's end-to-end runs")
  p.add_argument("--e2e-repeats", type=int, default=1, help="end-to-end runs of each mode, alternated (the "
                 "median s/step per mode is reported)")
  p.add_argument("--warmup", action="store_true", help="compile every decode program of both engines first "
                 "(`Engine.warmup`, as sampler.warmup does)")


ARGS = harness.parse(__doc__, _flags, quick="4 prompts, short limits, no end-to-end runs",
                     seed="the batch's noise keys and the random model's weights")
harness.host_devices(8)

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import determinism  # noqa: E402
import rl_step  # noqa: E402
from tunixlike import checkpoint as checkpoint_lib, config as config_lib, models  # noqa: E402
from tunixlike.data import pipeline  # noqa: E402
from tunixlike.learner import state as state_lib  # noqa: E402
from tunixlike.rl import build, weight_sync  # noqa: E402
from tunixlike.rl.prompts import requests_for  # noqa: E402
from tunixlike.sampler import RolloutDriver, drafts as drafts_lib, make_engine, speculative  # noqa: E402

PAGED = ["--config.sampler.kv_layout=paged"]
TARGETS = {"trained": 0.67, "random": 1.05}


def e2e(tmp: pathlib.Path) -> dict:
  """The main job, plain and with speculation (paged cache both), alternated `--e2e-repeats` times:
  per mode its median run by s/step, and every run's s/step."""
  runs = {"plain": [], "speculative": []}
  for repeat in range(ARGS.e2e_repeats):
    for mode, flags in (("plain", PAGED), ("speculative", PAGED + ["--config.sampler.speculative=true"])):
      t0 = time.monotonic()
      records = rl_step._run(rl_step.REPO, tmp / f"{mode}{repeat or ''}", None, False, flags, ARGS.seed)
      steps = [r for r in records if "learner/busy_frac" in r]
      evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
      run = {"s_per_step": round(determinism.rl_s_per_step(records, 10), 4), "accuracy_before": evals[0],
             "accuracy_after": evals[-1], "wall_s": round(time.monotonic() - t0, 1),
             "tokens_per_s": round(steps[-1]["sampler/tokens_per_s"], 1)}
      if mode == "speculative":
        run.update(draft_acceptance=round(steps[-1]["sampler/draft_acceptance"], 3),
                   tokens_per_decode_step=round(steps[-1]["sampler/tokens_per_decode_step"], 3),
                   verify_calls=steps[-1]["sampler/verify_calls"],
                   draft_frac=round(steps[-1]["sampler/draft_frac"], 4),
                   sampler_busy_frac=round(steps[-1]["sampler/busy_frac"], 4))
      runs[mode].append(run)
  out = {mode: {**sorted(rs, key=lambda r: r["s_per_step"])[(len(rs) - 1) // 2],
                "s_per_step_runs": [r["s_per_step"] for r in rs]} for mode, rs in runs.items()}
  out["ratio_s_per_step"] = round(out["speculative"]["s_per_step"] / out["plain"]["s_per_step"], 3)
  out["accuracy_after_difference"] = round(out["speculative"]["accuracy_after"] - out["plain"]["accuracy_after"], 3)
  return out


def load(workdir: str):
  """(setup, trained model, random model, sampler config) of a finished main-job run."""
  ckpt = checkpoint_lib.Checkpointer(checkpoint_lib.workdir_checkpoints(workdir), read_only=True)
  step = ckpt.pick_step(None)
  cfg = config_lib.from_saved(ckpt.read_meta(step)["config"])
  setup = build.build(cfg, say=lambda *a: None, training=False)
  random_state = nnx.state(models.Transformer(setup.model.cfg, rngs=nnx.Rngs(ARGS.seed + 1)))
  trained, _ = state_lib.restore_policy_weights(ckpt, step, build.policy_model(setup), lora=False, ppo=False)
  ckpt.close()
  return setup, trained, random_state, build.sampler_config(setup.cfg, setup.tok, setup.transport.decoders)


def requests(setup, n: int):
  """n held-out prompts, every `--long-every`-th group with the long limit, the rest short."""
  pipe_cfg = build.pipeline_config(setup.cfg, setup.transport.data_shard, shuffle=False, num_epochs=1)
  records = list(zip(range(n), pipeline.from_task(setup.task, setup.tok, split="test", config=pipe_cfg)))
  out = requests_for([r for _, r in records])
  for i, r in enumerate(out):
    r.max_new_tokens = ARGS.long if i % ARGS.long_every == ARGS.long_every // 2 else ARGS.short
  return out


def decode(engine, params, reqs, learned: dict) -> tuple[dict, dict]:
  """One batch through a fresh driver: (stats, completions by prompt). A speculative driver's drafter
  starts from what the previous runs learned (`learned`: the seconds per call, updated in place, and
  the recent acceptance of all drafts), not from their texts: in a run one driver lives for every
  batch and learns these once, not once per batch."""
  got = []
  drafter = None
  if engine.config.speculative:
    drafter = drafts_lib.Drafter.from_config(engine.config, learned.setdefault("call_seconds", {}))
    drafter.recent_acceptance = learned.get("recent_acceptance", drafter.recent_acceptance)
  driver = RolloutDriver(engine, params, source=iter(reqs), sink=got.append, drafter=drafter)
  widths = collections.Counter()  # (verify call?, decode width) -> calls
  for verify in (False, True):  # counted on the way in; the engine's own method runs
    method = getattr(engine, "verify" if verify else "generate")
    setattr(engine, method.__name__, functools.partial(_counted, method, widths, verify))
  try:
    t0 = time.perf_counter()
    driver.run(max_wall_s=1800)
    batch_s = time.perf_counter() - t0
  finally:
    del engine.generate, engine.verify
  if drafter is not None:
    learned["recent_acceptance"] = drafter.recent_acceptance
  s = driver.stats
  per = engine.config.draft_tokens + 1  # positions per slot of a verify step
  stats = {"batch_s": round(batch_s, 3), "tokens_per_s": round(s.tokens_generated / batch_s, 1),
           "tokens": s.tokens_generated, "generate_calls": s.generate_calls, "busy_s": round(s.busy_time_s, 3),
           # model forwards (one per decode step of a call) and the slot positions they computed
           "forwards": sum(n for _, n in widths.items()) * engine.config.steps_per_call,
           "positions": sum(n * engine.replicas * w * (v * per + engine.config.steps_per_call - v)
                            for (v, w), n in widths.items()),
           "calls_by_width": {f"{f'verify{v}' if v else 'plain'}@{w}": n for (v, w), n in sorted(widths.items())}}
  if engine.config.speculative:
    stats.update(verify_calls=s.verify_calls, draft_acceptance=round(s.draft_acceptance, 3),
                 tokens_per_decode_step=round(s.tokens_per_decode_step, 3), draft_s=round(s.draft_s, 4))
  return stats, {g.prompt_id: g.completions for g in got}


def _counted(method, widths, verify, params, state, *args):
  engine = method.__self__
  steps = 0 if not verify else speculative.verify_steps(int((np.asarray(args[0]) != speculative.NO_DRAFT).sum(1).max()),
                                                        engine.config.steps_per_call, engine.config.draft_tokens)
  widths[steps, engine.decode_width(state)] += 1
  return method(params, state, *args)


def compare(a: dict, b: dict) -> dict:
  """Whether two runs' completions have the same tokens, and their logprobs' largest difference."""
  pairs = [(x, y) for k in a for x, y in zip(a[k], b.get(k, ()))]
  tokens = a.keys() == b.keys() and all(np.array_equal(x.token_ids, y.token_ids) for x, y in pairs)
  diff = max((float(np.abs(x.logprobs - y.logprobs).max()) for x, y in pairs if len(x.logprobs) == len(y.logprobs)),
             default=0.0)
  return {"identical_tokens": tokens, "max_logprob_difference": diff}


def batch(setup, trained, random_state, s_cfg) -> dict:
  reqs = requests(setup, ARGS.prompts)
  slots = ARGS.prompts * s_cfg.group_size
  base = dataclasses.replace(s_cfg, kv_layout="paged", speculative=False, eos_ids=(), max_new_tokens=max(ARGS.long, ARGS.short),
                             max_concurrent_decodes=slots, temperature=1.0, seed=ARGS.seed,
                             max_prefill_length=s_cfg.max_prefill_length)
  spec = dataclasses.replace(base, speculative=True, **({"draft_tokens": ARGS.draft_tokens} if ARGS.draft_tokens else {}))
  engines = {"plain": make_engine(trained, base, setup.meshes.sampler),
             "speculative": make_engine(trained, spec, setup.meshes.sampler)}
  out = {"warmup_s": {}}
  for name, state in (("trained", nnx.state(trained)), ("random", random_state)):
    params, _ = weight_sync.sync(state, engines["plain"].param_shardings)
    if name == "trained" and ARGS.warmup:  # every program compiled before the runs (sampler.warmup's way)
      for mode, engine in engines.items():
        t0 = time.perf_counter()
        engine.warmup(params)
        out["warmup_s"][mode] = round(time.perf_counter() - t0, 1)
    runs = {mode: [] for mode in engines}
    completions, learned = {}, {}
    for i in range(ARGS.repeats):
      for mode, engine in engines.items():  # alternated: a load change falls on both modes alike
        stats, completions[mode] = decode(engine, params, reqs, learned)
        runs[mode].append(stats)
    # Without --warmup the first run of each mode compiles (and a later one may still compile a program a
    # timed choice first reaches). The machine is shared: each mode's fastest run is its figure.
    best = {mode: min(r[0 if ARGS.warmup else 1:] or r, key=lambda s: s["batch_s"]) for mode, r in runs.items()}
    lengths = [len(c.token_ids) for cs in completions["plain"].values() for c in cs]
    out[name] = {**best, **compare(completions["plain"], completions["speculative"]),
                 "ratio_batch_s": round(best["speculative"]["batch_s"] / best["plain"]["batch_s"], 3),
                 "target": TARGETS[name], "runs": runs,
                 "completion_tokens": {"total": sum(lengths), "max": max(lengths),
                                       "median": statistics.median(lengths)}}
    out[name]["target_met"] = out[name]["ratio_batch_s"] <= TARGETS[name]
    # ms per call of each kind at each decode width (slots per replica), as the drafter measured them
    out[name]["call_ms"] = {f"{f'verify{v}' if v else 'plain'}@{w}": round(1e3 * t, 2)
                            for (v, w), t in sorted(learned.get("call_seconds", {}).items()) if t is not None}
  out["workload"] = {"prompts": ARGS.prompts, "group_size": s_cfg.group_size, "slots": slots,
                     "short": ARGS.short, "long": ARGS.long, "long_every": ARGS.long_every, "temperature": 1.0,
                     "draft_tokens": spec.draft_tokens, "draft_ngram": spec.draft_ngram,
                     "steps_per_call": spec.steps_per_call, "eos": "ignored (limits set the lengths)",
                     "repeats": ARGS.repeats}
  return out


def main():
  if ARGS.quick:
    ARGS.prompts, ARGS.short, ARGS.long, ARGS.long_every, ARGS.repeats, ARGS.no_e2e = 4, 8, 32, 2, 2, True
  out = {}
  with tempfile.TemporaryDirectory(prefix="speculative_") as tmp:
    if not ARGS.no_e2e:
      out["e2e"] = e2e(pathlib.Path(tmp))
    elif ARGS.workdir is None:  # the policy of a run of its own (--quick: the tiny variant's)
      rl_step._run(rl_step.REPO, pathlib.Path(tmp) / "plain", None, ARGS.quick, PAGED, ARGS.seed)
    workdir = ARGS.workdir or str(pathlib.Path(tmp) / "plain")
    out["batch"] = batch(*load(workdir))
    out["batch"]["policy"] = "--workdir" if ARGS.workdir else "the plain main-job run's final checkpoint"
  harness.report(out, ARGS, indent=2)


if __name__ == "__main__":
  main()
