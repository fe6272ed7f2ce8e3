"""tunixlike vs TRL's GRPOTrainer: GRPO from the same checkpoint, on the same data and reward, for the
same wall-clock budget, scored by one evaluator.

  python benchmarks/vs_trl.py [--tasks addition,countdown] [--budget-s 180] [--out FILE] [--quick]

Per task (addition: configs/addition_grpo.py; countdown: examples/countdown/config.py):
  1. The start: the task config's supervised stage (`python -m tunixlike.sft`, which stops at its
     warm_start.target_accuracy), exported as a Hugging Face directory (`python -m tunixlike.export`).
     Both sides start from these weights.
  2. tunixlike: `python -m tunixlike.train --config.model.hf_path=START --config.warm_start.max_steps=0`
     with the settings below, on --tunixlike-devices (default 1 sampler + 1 learner CPU device, its
     fastest layout on 2 cores), sent SIGINT --budget-s after its process started (it finishes the
     step it is in and saves a checkpoint), then its newest checkpoint exported. Before it, a start-up
     probe with an empty JAX compilation cache (stopped after its first RL step): the cold start. The
     run then starts from the cache the probe filled: the warm start.
  3. TRL: `trl.GRPOTrainer` (TRL_VERSION, CPU, no vLLM, --torch-threads 1: its fastest here) in its own
     virtual environment (--trl-venv, made on first use with `python -m venv --system-site-packages`
     and `pip install trl==TRL_VERSION`, the system torch and transformers pinned; offline afterwards),
     stopped by a callback at the end of the first step that ends --budget-s after its process
     started, then `save_model`.
  4. One evaluator for the start and both ends: transformers (torch) greedy decoding of the held-out
     prompts (the task's held-out split, read as tunixlike's evals read it, token ids as both trained
     on), up to sampler.max_new_tokens, scored by the config's first reward (the 0/1 accuracy).
     gain_ratio = tunixlike's gain / TRL's gain (null when TRL's gain <= 0: no ratio means anything).

Matched (the JSON's `matched`, per task): the prompts (every training and held-out prompt's token ids
under TRL's tokenization checked equal to tunixlike's; TRL's trainer checks its own on the first rows),
completions ending at the same <eos>, the reward (tunixlike's own reward functions, called from TRL),
group size (`num_generations`), prompts per optimizer step (`per_device_train_batch_size` = prompts x
group size, one generation batch per step), temperature, top-k/top-p, max_completion_length, the loss's
clip range and aggregation (`loss_type`), advantage scaling (`scale_rewards`), the KL coefficient
(`beta`), updates per batch (`num_iterations`), Adam (b1, b2, eps, no weight decay), the gradient clip,
warm-up and learning rate. The learning rate and temperature are those the task config's own job uses
(the built-in model after its supervised stage: `rl.starting_point`), not a model.hf_path run's choice
for a pretrained model. Both run a constant rate after the config's warm-up (a cosine decays to 0 at a
planned last step, and a budget plans none), for at most 10^6 steps. What still differs is listed in
`differences`: tunixlike samples asynchronously (a batch may come from the policy one version back,
importance-weighted) on its own engine; TRL generates synchronously with `generate`, which also means
different random samples.

Start-up: seconds from the process start to the end of its first RL step (tunixlike: its first learner
record in metrics.jsonl; TRL: its first `on_step_end`). tunixlike's is split by its console lines
(`startup_profile`): imports and build (the run's first line), the held-out evaluation at step 0, then
the first RL step (compiling the sampler and learner programs). Samples/s: completions trained per
second between the first and last RL step (`samples_per_s`), and over the whole budget
(`samples_per_s_budget`). The machine may be shared: the load average and each process's CPU seconds
are recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASKS = {"addition": ROOT / "configs" / "addition_grpo.py", "countdown": ROOT / "examples" / "countdown" / "config.py"}
# The newest TRL on PyPI (2026-10) when written; its GRPOTrainer runs here with transformers 5.24 and torch 2.13.
TRL_VERSION = "1.16.0"
DEFAULT_VENV = pathlib.Path("~/.cache/tunixlike/bench").expanduser() / f"trl-{TRL_VERSION}"
MAX_STEPS = 10**6  # both sides: the budget stops them, not a step count
CONFIG_DEVICES = 8  # the supervised stage: the configs' own 4 sampler + 4 learner virtual CPU devices
T0_ENV = "VS_TRL_T0"  # the TRL process's start (the parent's clock), for its budget and timings
# A pipeline record's fields that tunixlike adds to the data's own columns.
PIPELINE_FIELDS = ("prompt_text", "prompt_token_ids", "num_prompt_tokens", "epoch")
# quick: the first 1,024 training prompts (each run formats and checks all it reads), 16 held-out ones.
QUICK_DATA = {"data.train_size": 1024, "data.num_eval_examples": 16}


def _flags(p):
  p.add_argument("--tasks", default="addition,countdown", help=f"comma-separated, of {sorted(TASKS)}")
  p.add_argument("--budget-s", type=float, default=None, help="wall clock of each RL run (default 180; quick 20)")
  p.add_argument("--eval-prompts", type=int, default=None,
                 help="held-out prompts scored (default the config's data.num_eval_examples; quick 16)")
  p.add_argument("--learning-rate", type=float, default=None,
                 help="optim.learning_rate of both sides (default: the task config's own job's)")
  p.add_argument("--workdir", default=None, help="where the checkpoints and logs go (default: a new temp dir)")
  # 1+1: tunixlike's fastest layout on 2 cores (benchmarks/async_vs_sync.py), as TRL gets its fastest threads;
  # the configs' own 4+4 made 0.7x the samples/s on addition (2,667 vs 3,738, 2026-12-06).
  p.add_argument("--tunixlike-devices", default="1+1", help="RL runs' mesh.sampler_devices+mesh.learner_devices")
  p.add_argument("--trl-venv", default=str(DEFAULT_VENV), help="TRL's virtual environment (made if missing)")
  # One: at these sizes torch's fastest on 2 shared cores; with 2, OpenMP's spinning threads ran a
  # forward+backward 10-30x slower whenever other work held the cores (0.5-1.4 s vs 15 ms, 2026-12-06).
  p.add_argument("--torch-threads", type=int, default=1, help="torch threads of TRL and of the evaluator")
  p.add_argument("--trl-run", default=None, help=argparse.SUPPRESS)  # the TRL side, run inside its venv


def parse(argv=None) -> argparse.Namespace:
  args = harness.parse(__doc__, _flags, argv, quick="budget 20 s a side, a 10-step supervised stage, 16 held-out "
                       "prompts, 8 prompts a step", seed="the runs' seed (config key seed, TRL's seed)")
  unknown = sorted(set(args.tasks.split(",")) - set(TASKS))
  if unknown or not args.tasks:
    raise SystemExit(f"vs_trl: --tasks={args.tasks!r}: unknown {unknown}; choose from {sorted(TASKS)}")
  if args.budget_s is None:
    args.budget_s = 20.0 if args.quick else 180.0
  try:
    args.sampler_devices, args.learner_devices = (int(n) for n in args.tunixlike_devices.split("+"))
  except ValueError:
    raise SystemExit(f"vs_trl: --tunixlike-devices={args.tunixlike_devices!r}: expected S+L, e.g. 1+1") from None
  return args


# ---- settings ----------------------------------------------------------------------------------------
def flag_value(v) -> str:
  return str(v).lower() if isinstance(v, bool) else str(v)


def sft_overrides(quick: bool, seed: int) -> dict:
  """The supervised stage: the task config's own (it stops at warm_start.target_accuracy); quick: 10 steps."""
  out = {"seed": seed, "rl.num_steps": 0, "log.progress_bar": False, "log.tensorboard": False}
  if quick:
    out.update({"warm_start.max_steps": 10, "warm_start.eval_every": 5, **QUICK_DATA})
  return out


def rl_overrides(task_config, start_hf: str, args) -> dict:
  """tunixlike's RL run: the task config from the exported start, stopped by the budget, not by a step
  count, with every setting TRL is matched to explicit. The learning rate and temperature are those of
  the task config's own job (the built-in model after its supervised stage, `rl.starting_point`), not
  the ones a run from a model.hf_path would choose for a pretrained model."""
  from tunixlike.rl import starting_point
  own, _ = starting_point.resolved(resolved(task_config, {}))
  lr = args.learning_rate if args.learning_rate is not None else own.optim.learning_rate
  out = {"seed": args.seed, "model.hf_path": start_hf, "warm_start.max_steps": 0, "optim.learning_rate": lr,
         "sampler.temperature": own.sampler.temperature, "optim.schedule": "constant", "rl.num_steps": MAX_STEPS,
         "mesh.sampler_devices": args.sampler_devices, "mesh.learner_devices": args.learner_devices,
         # No evaluation or checkpoint inside the budget (TRL does neither); the SIGINT saves the last state.
         "eval.every_steps": 0, "checkpoint.every_steps": 0, "log.progress_bar": False, "log.tensorboard": False}
  if args.quick:
    out.update({"rl.prompts_per_step": 8, **QUICK_DATA})
  return out


def resolved(task_config, overrides: dict):
  """The run's validated Config: the task config with `overrides` applied as the CLI applies them."""
  from tunixlike import config as config_lib
  raw = config_lib.load(task_config)
  for key, value in overrides.items():
    *path, name = key.split(".")
    holder = raw
    for part in path:
      holder = holder[part]
    holder[name] = value
  return config_lib.from_config_dict(raw)


LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}


def grpo_config(cfg) -> dict:
  """TRL's GRPOConfig arguments matched to tunixlike's run `cfg` (raises on what TRL cannot match)."""
  a, o, s = cfg.algo, cfg.optim, cfg.sampler
  if s.max_new_tokens is None:  # a run sizes it from the data at start-up; TRL needs it up front
    raise SystemExit("vs_trl: the task config leaves sampler.max_new_tokens to the run: set it")
  if a.advantage not in SCALE_REWARDS or a.estimator != "grpo_family" or a.loss not in ("ppo_clip", "dapo"):
    raise SystemExit(f"vs_trl: algo.advantage={a.advantage!r} / algo.loss={a.loss!r} has no TRL counterpart here")
  loss_type = LOSS_TYPES[a.resolved_aggregation]
  if loss_type == "dr_grpo" and a.norm_length != s.max_new_tokens:
    raise SystemExit("vs_trl: TRL's dr_grpo normalises by max_completion_length: set algo.norm_length to it")
  return dict(
      num_generations=a.group_size,
      # One generation batch per optimizer step: prompts_per_step groups of group_size completions.
      per_device_train_batch_size=cfg.rl.prompts_per_step * a.group_size, gradient_accumulation_steps=1,
      max_completion_length=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
      beta=a.kl_coef, epsilon=a.eps_low_value, epsilon_high=a.eps_high_value, loss_type=loss_type,
      scale_rewards=SCALE_REWARDS[a.advantage], num_iterations=o.updates_per_batch, mask_truncated_completions=False,
      learning_rate=o.learning_rate, lr_scheduler_type="constant_with_warmup", warmup_steps=o.warmup_steps,
      optim="adamw_torch", adam_beta1=o.b1, adam_beta2=o.b2, adam_epsilon=o.eps, weight_decay=o.weight_decay,
      max_grad_norm=o.grad_clip if o.grad_clip > 0 else 1e9, max_steps=MAX_STEPS, seed=cfg.seed,
      # CPU in float32 like tunixlike (GRPOConfig's defaults are bf16 and gradient checkpointing).
      use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False,
      logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
      log_completions=False, shuffle_dataset=True)


def matched(cfg, trl_args: dict) -> dict:
  """The settings both sides ran with, in tunixlike's names and TRL's."""
  a, o, s = cfg.algo, cfg.optim, cfg.sampler
  return {
      "group_size": a.group_size, "prompts_per_step": cfg.rl.prompts_per_step,
      "completions_per_step": cfg.rl.prompts_per_step * a.group_size, "temperature": s.temperature,
      "top_k": s.top_k, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens, "learning_rate": o.learning_rate,
      "schedule": "constant after a linear warm-up from 0", "warmup_steps": o.warmup_steps, "adam_b1": o.b1,
      "adam_b2": o.b2, "adam_eps": o.eps, "weight_decay": o.weight_decay, "grad_clip": o.grad_clip,
      "kl_coef": a.kl_coef, "clip_eps": [a.eps_low_value, a.eps_high_value], "loss": a.loss,
      "aggregation": a.resolved_aggregation, "advantage": a.advantage, "updates_per_batch": o.updates_per_batch,
      "seed": cfg.seed, "trl": {k: trl_args[k] for k in (
          "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length",
          "temperature", "top_k", "top_p", "learning_rate", "lr_scheduler_type", "warmup_steps", "optim",
          "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm", "beta", "epsilon",
          "epsilon_high", "loss_type", "scale_rewards", "num_iterations", "bf16")},
  }


def differences(cfg) -> list[str]:
  a = cfg.algo
  out = [f"tunixlike samples asynchronously (rl.max_staleness={cfg.rl.max_staleness}): a batch may come from a "
         "policy up to that many versions behind the learner" + (f", importance-weighted per token ({a.is_mode}, "
                                                                  f"cap {a.is_cap})" if a.is_mode != "none" else "")
         + "; TRL generates each batch with the current policy, then trains on it (on-policy, ratio 1)",
         f"advantages: both (r - mean) / std within the group (unbiased std); the std's epsilon is 1e-6 in "
         "tunixlike, 1e-4 in TRL",
         "sampling: tunixlike's own engine (jax) vs transformers generate (torch): the same distribution, other random "
         "draws; the data order is shuffled by each side's own seeded sampler",
         "numerics: jax/XLA vs torch float32 kernels (matmul order, softmax), so the same update differs in rounding",
         f"cores: tunixlike decodes and trains at once on {cfg.mesh.sampler_devices} + {cfg.mesh.learner_devices} "
         "virtual XLA CPU devices; TRL generates, then trains, on its torch threads"]
  if cfg.optim.share_prompts:
    out.append("tunixlike trains one row per group (optim.share_prompts: the prompt once, then its answers); the "
               "loss and gradients are those of a row per answer, as TRL computes them")
  return out


# ---- data --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
  ids: list[int]  # the prompt's token ids, <bos> first: what both sides decode from
  text: str  # the formatted prompt (what tunixlike's rewards get as the prompt)
  columns: dict  # the data's own columns (id, prompt, answer, numbers, target, ...)

  @property
  def reward_columns(self) -> dict:
    """The columns tunixlike hands the rewards (`rl.prompts.request_for`: not the id and prompt fields)."""
    from tunixlike.rewards.loader import NOT_COLUMNS
    return {k: v for k, v in self.columns.items() if k not in NOT_COLUMNS}


def task_rows(cfg, tok, split: str, limit: int | None = None) -> list[Row]:
  """The task's prompts as tunixlike's runs read them (`rl.build.build`): the split's rows after the
  length filter, formatted and tokenized by the same pipeline, in file order (the held-out evaluation's
  order; training shuffles)."""
  from tunixlike.data import pipeline, tasks
  task = tasks.for_run(cfg.data)
  pipe_cfg = pipeline.PipelineConfig.from_config(cfg, shard_index=0, shard_count=1, shuffle=False, num_epochs=1)
  pipe = pipeline.from_task(task, tok, split=split, size=cfg.data.train_size if split == "train" else None,
                            config=pipe_cfg)
  n = pipe.num_examples if limit is None else min(limit, pipe.num_examples)
  out = []
  for i in range(n):
    r = pipe.dataset[i]
    out.append(Row([int(x) for x in r["prompt_token_ids"]], r["prompt_text"],
                   {k: v for k, v in r.items() if k not in PIPELINE_FIELDS}))
  return out


def trl_prompts(hf_dir: str, rows: list[Row]) -> tuple[list[str], str]:
  """The prompt strings that TRL's tokenization turns into exactly each row's ids, and which form that
  is: the formatted text when the tokenizer adds <bos> itself, else the text after the <bos> token's.
  Raises when neither gives every row's ids."""
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  forms = {"formatted text (the tokenizer adds <bos>)": [r.text for r in rows],
           "<bos> token text + formatted text": [tok.decode(r.ids, skip_special_tokens=False) for r in rows]}
  for form, texts in forms.items():
    # As TRL 1.16 tokenizes a plain-text prompt (GRPOTrainer._tokenize_prompts): with the tokenizer's
    # default add_special_tokens=True, so the character tokenizer's post-processor adds <bos> itself.
    if tok(text=texts)["input_ids"] == [r.ids for r in rows]:
      return texts, form
  raise SystemExit(f"vs_trl: no prompt string gives TRL tunixlike's prompt ids (e.g. {rows[0].ids} for "
                   f"{rows[0].text!r})")


def jsonable(v):
  return v.tolist() if hasattr(v, "tolist") else v


# ---- the evaluator -----------------------------------------------------------------------------------
def greedy_completions(hf_dir: str, rows: list[Row], max_new_tokens: int, batch: int = 256) -> tuple[list[str], int]:
  """Greedy completions of `rows` (their exact ids, no padding: rows are batched by prompt length), cut at
  the first stop token; and how many reached max_new_tokens without one."""
  import torch
  import transformers
  from tunixlike.data import tokenizer as tokenizer_lib
  tok = tokenizer_lib.load(hf_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  by_length: dict[int, list[int]] = {}
  for i, r in enumerate(rows):
    by_length.setdefault(len(r.ids), []).append(i)
  out, truncated = [""] * len(rows), 0
  with torch.no_grad():
    for length, index in sorted(by_length.items()):
      for start in range(0, len(index), batch):
        part = index[start:start + batch]
        x = torch.tensor([rows[i].ids for i in part])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)[:, length:].tolist()
        for i, ids in zip(part, y):
          stop = next((k for k, t in enumerate(ids) if t in tok.stop_ids), None)
          truncated += stop is None
          out[i] = tok.decode(ids[:stop])  # skip_special_tokens, as both trainers' rewards see it
  return out, truncated


def accuracy(cfg, rows: list[Row], completions: list[str]) -> float:
  """The mean of the config's first reward (the 0/1 verifier tunixlike's evals score with)."""
  from tunixlike import rewards as rewards_lib
  from tunixlike.data import tasks
  terms = tasks.reward_terms(cfg.rewards, tasks.for_run(cfg.data))
  verifier = rewards_lib.CombinedReward(list(terms)[:1], timeout_s=cfg.rl.reward_timeout_s)
  columns = {k: [r.reward_columns[k] for r in rows] for k in rows[0].reward_columns}
  scores, _ = verifier([r.text for r in rows], completions, **columns)
  return float(scores.mean())


def evaluate(cfg, hf_dir: str, rows: list[Row]) -> dict:
  t = time.monotonic()
  completions, truncated = greedy_completions(hf_dir, rows, cfg.sampler.max_new_tokens)
  return {"accuracy": accuracy(cfg, rows, completions), "truncated": truncated, "eval_s": time.monotonic() - t,
          "examples": [{"prompt": r.text, "completion": c} for r, c in zip(rows[:3], completions)]}


# ---- processes ---------------------------------------------------------------------------------------
class Child:
  """A subprocess whose console lines are kept with their time since its start, and its CPU seconds."""

  def __init__(self, cmd: list[str], env: dict, log: pathlib.Path):
    self.log = log
    self.lines: list[tuple[float, str]] = []
    self._cpu = _children_cpu()
    self._load = os.getloadavg()[0]  # the machine is shared: what else ran beside this process
    self.t0 = time.time()
    self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, T0_ENV: repr(self.t0)}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    with open(self.log, "w") as f:
      for line in self.proc.stdout:
        self.lines.append((time.time() - self.t0, line.rstrip("\n")))
        f.write(line)

  def elapsed(self) -> float:
    return time.time() - self.t0

  def first_line(self, prefix: str) -> float | None:
    return next((t for t, line in list(self.lines) if line.startswith(prefix)), None)

  def wait(self, timeout_s: float = 600, check: bool = True) -> dict:
    code = self.proc.wait(timeout=timeout_s)
    self._reader.join(timeout=10)
    if code != 0 and check:
      tail = "\n".join(line for _, line in self.lines[-25:])
      raise RuntimeError(f"{' '.join(self.proc.args[:4])}... exited {code} (log {self.log}):\n{tail}")
    return {"exit_code": code, "wall_s": round(self.elapsed(), 2), "cpu_s": round(_children_cpu() - self._cpu, 2),
            "load_1min": [round(self._load, 2), round(os.getloadavg()[0], 2)]}


def _children_cpu() -> float:
  u = resource.getrusage(resource.RUSAGE_CHILDREN)
  return u.ru_utime + u.ru_stime


def tunixlike_env(cache: pathlib.Path, devices: int = CONFIG_DEVICES) -> dict:
  env = dict(os.environ, XLA_FLAGS=harness.xla_flags(devices), PYTHONUNBUFFERED="1",
             TUNIXLIKE_COMPILATION_CACHE=str(cache))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # it would win over the run's own cache (cold, then warm)
  return env


def cli(module: str, config, overrides: dict, workdir: pathlib.Path) -> list[str]:
  return [sys.executable, "-m", module, "--config", str(config),
          *(f"--config.{k}={flag_value(v)}" for k, v in overrides.items()), f"--workdir={workdir}"]


def export(workdir: pathlib.Path, out: pathlib.Path, env: dict) -> str:
  subprocess.run([sys.executable, "-m", "tunixlike.export", "--workdir", str(workdir), "--out", str(out)], cwd=ROOT,
                 env=env, check=True, capture_output=True, text=True)
  return str(out)


def start_checkpoint(task_config, w: pathlib.Path, quick: bool, seed: int) -> tuple[str, dict]:
  """The supervised stage of the task config, exported: the Hugging Face directory both sides start from."""
  env = tunixlike_env(w / "jax-cache-sft")
  child = Child(cli("tunixlike.sft", task_config, sft_overrides(quick, seed), w / "sft"), env, w / "sft.log")
  times = child.wait()
  from tunixlike import metrics as metrics_lib
  records = metrics_lib.read_jsonl(str(w / "sft" / "metrics.jsonl"))
  steps = next((r["warm_start/steps"] for r in records if "warm_start/steps" in r), None)
  acc = next((r["eval/accuracy"] for r in records if "eval/accuracy" in r and r["step"] == 0), None)
  return export(w / "sft", w / "start_hf", env), {"supervised_steps": steps, "tunixlike_held_out_accuracy": acc,
                                                   **times}


def learner_records(workdir: pathlib.Path) -> list[dict]:
  from tunixlike import metrics as metrics_lib
  path = workdir / "metrics.jsonl"
  return [r for r in metrics_lib.read_jsonl(str(path)) if "learner/step_s" in r] if path.exists() else []


def run_tunixlike(task_config, overrides: dict, workdir: pathlib.Path, cache: pathlib.Path, budget_s: float | None
                  ) -> dict:
  """One RL run, interrupted at `budget_s` after its start (None: right after its first RL step, a
  start-up probe). Returns its start-up, learner records, exit code, wall and CPU seconds."""
  env = tunixlike_env(cache, overrides["mesh.sampler_devices"] + overrides["mesh.learner_devices"])
  child = Child(cli("tunixlike.train", task_config, overrides, workdir), env, workdir.with_suffix(".log"))
  first = None
  while child.proc.poll() is None:
    if first is None and learner_records(workdir):
      first = child.elapsed()  # the first learner record is out (checked every 50 ms)
    if (budget_s is None and first is not None) or (budget_s is not None and child.elapsed() >= budget_s):
      break
    time.sleep(0.05)
  stopped = child.elapsed()
  child.proc.send_signal(signal.SIGINT)  # finishes the step it is in, saves a checkpoint, exits 0
  # A run that stopped itself (a collapse, unlearning: exit 1) is reported, its newest checkpoint evaluated.
  times = child.wait(check=False)
  banner, eval0 = child.first_line("tunixlike: task"), child.first_line("eval at step 0")
  steps = learner_records(workdir)
  return {"first_step_s": first, "stopped_at_s": round(stopped, 2), **times, "steps": steps,
          "startup_profile": {"imports_and_build_s": banner, "step0_eval_s": _minus(eval0, banner),
                              "first_rl_step_s": _minus(first, eval0)}}


def _minus(a, b):
  return None if a is None or b is None else round(a - b, 2)


def rl_summary(steps: int, first_s: float | None, last_s: float | None, completions_per_step: int,
               budget_s: float, rewards: list[float]) -> dict:
  """Steps, completions trained per second after the first step and over the budget, training reward."""
  span = None if first_s is None or last_s is None else last_s - first_s
  out = {"rl_steps": steps, "samples": steps * completions_per_step,
         "samples_per_s": (steps - 1) * completions_per_step / span if span and steps > 1 else None,
         "samples_per_s_budget": steps * completions_per_step / budget_s,
         "first_step_s": None if first_s is None else round(first_s, 2)}
  if rewards:
    k = min(10, len(rewards))
    out.update(train_reward_first=round(sum(rewards[:k]) / k, 4), train_reward_last=round(sum(rewards[-k:]) / k, 4))
  return out


def bench_tunixlike(task_config, overrides, w: pathlib.Path, cfg, budget_s: float) -> tuple[dict, str]:
  cache = w / "jax-cache-rl"  # empty: the probe starts cold and fills it for the run
  probe = run_tunixlike(task_config, overrides, w / "tunixlike_probe", cache, None)
  run = run_tunixlike(task_config, overrides, w / "tunixlike", cache, budget_s)
  steps = run.pop("steps")
  per_step = cfg.rl.prompts_per_step * cfg.algo.group_size
  # The learner records' own clock (time_s) gives the spacing of the steps; the first one's arrival, this one's.
  last = run["first_step_s"] + steps[-1]["time_s"] - steps[0]["time_s"] if steps and run["first_step_s"] else None
  out = {**rl_summary(len(steps), run["first_step_s"], last, per_step, budget_s, [r["reward/mean"] for r in steps]),
         "first_step_s_warm": run["first_step_s"], "first_step_s_cold": probe["first_step_s"],
         "startup_profile_warm": run["startup_profile"], "startup_profile_cold": probe["startup_profile"],
         "stopped_at_s": run["stopped_at_s"], "exit_code": run["exit_code"], "wall_s": run["wall_s"],
         "cpu_s": run["cpu_s"],
         "load_1min": run["load_1min"], "probe_wall_s": probe["wall_s"], "probe_cpu_s": probe["cpu_s"],
         "sampler_tokens_per_s": steps[-1].get("sampler/tokens_per_s") if steps else None}
  return out, export(w / "tunixlike", w / "tunixlike_hf", tunixlike_env(cache))


# ---- TRL -------------------------------------------------------------------------------------------------
def trl_python(venv: pathlib.Path) -> str:
  """The venv's python with trl==TRL_VERSION (made on first use; the system torch and transformers are
  reused and pinned, so pip neither downloads nor replaces them)."""
  import importlib.metadata
  py = venv / "bin" / "python"
  version = "import importlib.metadata as m; print(m.version('trl'))"
  if py.exists():
    got = subprocess.run([str(py), "-c", version], capture_output=True, text=True)
    if got.returncode == 0 and got.stdout.strip() == TRL_VERSION:
      return str(py)
  else:
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
  pins = venv / "pins.txt"
  pins.write_text("".join(f"{p}=={importlib.metadata.version(p)}\n" for p in ("torch", "transformers")))
  subprocess.run([str(py), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", "-c", str(pins)], check=True)
  return str(py)


def bench_trl(py: str, spec: dict, w: pathlib.Path, cfg, budget_s: float) -> tuple[dict, str]:
  spec_path = w / "trl_spec.json"
  spec_path.write_text(json.dumps(spec, indent=1))
  child = Child([py, str(pathlib.Path(__file__).resolve()), "--trl-run", str(spec_path)],
                dict(os.environ, PYTHONUNBUFFERED="1"), w / "trl.log")
  times = child.wait(timeout_s=budget_s + 600)
  result = json.loads((w / "trl_result.json").read_text())
  steps = result.pop("steps")
  per_step = cfg.rl.prompts_per_step * cfg.algo.group_size
  out = {**rl_summary(len(steps), steps[0]["t"] if steps else None, steps[-1]["t"] if steps else None, per_step,
                      budget_s, [s["reward"] for s in steps if s.get("reward") is not None]),
         **result, **times}
  return out, spec["out"]


def trl_run(spec_path: str) -> None:
  """The TRL side (run by the venv's python): GRPOTrainer from the start checkpoint, stopped by the budget."""
  t0 = float(os.environ[T0_ENV])
  spec = json.loads(pathlib.Path(spec_path).read_text())
  import datasets
  import torch
  import transformers
  import trl
  from tunixlike import rewards as rewards_lib
  imported = time.time() - t0
  steps: list[dict] = []

  class Budget(transformers.TrainerCallback):
    """Stops training at the end of the first step that ends past the budget; keeps each step's time and reward."""

    def on_step_end(self, args, state, control, **kw):
      steps.append({"step": state.global_step, "t": time.time() - t0})
      if time.time() - t0 >= spec["budget_s"]:
        control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kw):
      if steps and logs and "reward" in logs:
        steps[-1]["reward"] = logs["reward"]

  verifier = rewards_lib.CombinedReward(spec["reward_terms"], timeout_s=spec["reward_timeout_s"])
  columns = spec["reward_columns"]

  def tunixlike_reward(prompts, completions, completion_ids, prompt_text, **kw):
    """The run's reward terms, weighted, called as tunixlike calls them (prompt text, data columns, lengths)."""
    ends = ["eos" if ids and ids[-1] in stop_ids else "length" for ids in completion_ids]
    total, _ = verifier(list(prompt_text), list(completions), completion_lengths=[len(i) for i in completion_ids],
                        finish_reasons=ends, **{k: list(kw[k]) for k in columns})
    return [float(x) for x in total]

  with open(spec["train"]) as f:
    data = datasets.Dataset.from_list([json.loads(line) for line in f])
  torch.set_num_threads(spec["torch_threads"])
  tok = transformers.AutoTokenizer.from_pretrained(spec["start"])
  stop_ids = {tok.eos_token_id}
  model = transformers.AutoModelForCausalLM.from_pretrained(spec["start"], dtype=torch.float32)
  args = trl.GRPOConfig(output_dir=spec["out"] + ".trainer", **spec["grpo_config"])
  trainer = trl.GRPOTrainer(model=model, reward_funcs=tunixlike_reward, args=args, train_dataset=data,
                            processing_class=tok, callbacks=[Budget()])
  # The trainer's own tokenization of the first rows against tunixlike's ids (a private method: None if gone).
  check = spec["check_rows"]
  tokenize = getattr(trainer, "_tokenize_prompts", None)
  ids_equal = None if tokenize is None else tokenize([r["prompt"] for r in check])[0] == [r["ids"] for r in check]
  ready = time.time() - t0
  trainer.train()
  trained = time.time() - t0
  trainer.save_model(spec["out"])
  tok.save_pretrained(spec["out"])
  result = {"trl_version": trl.__version__, "imports_s": round(imported, 2), "trainer_ready_s": round(ready, 2),
            "stopped_at_s": round(trained, 2), "saved_at_s": round(time.time() - t0, 2),
            "prompt_ids_equal_in_trainer": ids_equal, "prompt_rows_checked_in_trainer": len(check), "steps": steps}
  pathlib.Path(spec["result"]).write_text(json.dumps(result))


# ---- one task ------------------------------------------------------------------------------------------
def bench_task(name: str, args, root: pathlib.Path, py: str | None) -> dict:
  w = root / name
  if w.exists():  # its runs would resume instead of starting fresh
    raise SystemExit(f"vs_trl: {w} exists: give a new --workdir")
  w.mkdir(parents=True)
  task_config = TASKS[name]
  t = time.monotonic()
  start_hf, start_info = start_checkpoint(task_config, w, args.quick, args.seed)
  overrides = rl_overrides(task_config, start_hf, args)
  cfg = resolved(task_config, overrides)
  from tunixlike.data import tokenizer as tokenizer_lib
  tok = tokenizer_lib.load(start_hf)
  eval_n = args.eval_prompts or (16 if args.quick else cfg.data.num_eval_examples)
  held_out = task_rows(cfg, tok, "test", eval_n)
  train = task_rows(cfg, tok, "train")
  texts, form = trl_prompts(start_hf, train + held_out)
  with open(w / "trl_train.jsonl", "w") as f:
    for r, text in zip(train, texts):
      f.write(json.dumps({**{k: jsonable(v) for k, v in r.columns.items()}, "prompt": text, "prompt_text": r.text})
              + "\n")
  trl_args = grpo_config(cfg)
  out = {"config": str(task_config.relative_to(ROOT)), "tunixlike_overrides": overrides,
         "matched": matched(cfg, trl_args), "differences": differences(cfg),
         "prompt_ids": {"equal": True, "rows_checked": len(train) + len(held_out), "trl_prompt": form,
                        "example": {"text": texts[0], "ids": train[0].ids}},
         "start": start_info, "eval_prompts": len(held_out)}
  tl, tl_hf = bench_tunixlike(task_config, overrides, w, cfg, args.budget_s)
  ends = {"start": start_hf, "tunixlike": tl_hf}
  out["tunixlike"] = tl
  if py is not None:
    from tunixlike.data import tasks
    spec = {"start": start_hf, "train": str(w / "trl_train.jsonl"), "out": str(w / "trl_hf"),
            "result": str(w / "trl_result.json"), "budget_s": args.budget_s, "grpo_config": trl_args,
            "reward_terms": [dict(t) if not isinstance(t, str) else t
                             for t in tasks.reward_terms(cfg.rewards, tasks.for_run(cfg.data))],
            "reward_timeout_s": cfg.rl.reward_timeout_s, "reward_columns": sorted(train[0].reward_columns),
            "torch_threads": args.torch_threads,
            "check_rows": [{"prompt": text, "ids": r.ids} for r, text in zip(train[:256], texts)]}
    out["trl"], ends["trl"] = bench_trl(py, spec, w, cfg, args.budget_s)
  import torch
  torch.set_num_threads(args.torch_threads)
  evals = {k: evaluate(cfg, hf, held_out) for k, hf in ends.items()}
  acc = {k: e["accuracy"] for k, e in evals.items()}
  gain = {k: acc[k] - acc["start"] for k in acc if k != "start"}
  out.update(held_out_accuracy=acc, gain=gain, evals=evals, **gain_ratio(gain))
  out["wall_s"] = round(time.monotonic() - t, 1)
  return out


def gain_ratio(gain: dict) -> dict:
  """tunixlike's gain over TRL's; null (with the reason) when TRL gained nothing or lost: no ratio means anything."""
  if "trl" not in gain:
    return {"gain_ratio": None, "gain_ratio_note": "TRL not run"}
  if gain["trl"] <= 0:
    return {"gain_ratio": None, "gain_ratio_note": f"TRL's gain is {gain['trl']:+.3f} (<= 0): no ratio"}
  return {"gain_ratio": gain["tunixlike"] / gain["trl"], "gain_ratio_note": "tunixlike gain / TRL gain"}


def notes(result: dict) -> list[str]:
  """What the figures say against the targets (gain ratio >= 3, first RL step within 15 s warm)."""
  load = harness.load_average()
  out = [f"machine: {os.cpu_count()} CPU cores, shared (loadavg {load['before'][0]:.1f} -> {load['after'][0]:.1f}); "
         "the two sides ran one after the other (each side's 1-minute load at its start and end: load_1min)"]
  for name, r in result["tasks"].items():
    a, tl, trl = r["held_out_accuracy"], r["tunixlike"], r.get("trl", {})
    line = (f"{name}: held-out accuracy start {a['start']:.3f}, tunixlike {a['tunixlike']:.3f} "
            f"({r['gain']['tunixlike']:+.3f}, {tl['rl_steps']} steps, {_fmt(tl['samples_per_s'])} samples/s, load "
            f"{tl['load_1min'][0]:.1f}->{tl['load_1min'][1]:.1f})")
    if trl:
      ratio, n = r["gain_ratio"], r["eval_prompts"]
      # Two binomial standard errors of the difference of the two final accuracies.
      two_se = 2 * (a["tunixlike"] * (1 - a["tunixlike"]) / n + a["trl"] * (1 - a["trl"]) / n) ** 0.5
      line += (f", TRL {a['trl']:.3f} ({r['gain']['trl']:+.3f}, {trl['rl_steps']} steps, "
               f"{_fmt(trl['samples_per_s'])} samples/s, load {trl['load_1min'][0]:.1f}->{trl['load_1min'][1]:.1f}); "
               f"tunixlike - TRL = {a['tunixlike'] - a['trl']:+.3f} (2 SE {two_se:.3f} on {n} prompts); gain ratio "
               + (f"{ratio:.2f} ({'meets' if ratio >= 3 else 'below'} target 3)" if ratio is not None
                  else f"null: {r['gain_ratio_note']}"))
    warm = tl["first_step_s_warm"]
    line += (f"; tunixlike's first RL step at {_fmt(warm)} s warm ({'meets' if warm and warm <= 15 else 'misses'} "
             f"target 15 s), {_fmt(tl['first_step_s_cold'])} s cold" + (f", TRL's at {_fmt(trl['first_step_s'])} s"
                                                                         if trl else ""))
    out.append(line)
  return out


def _fmt(v) -> str:
  return "n/a" if v is None else f"{v:.1f}"


def main():
  args = parse()
  if args.trl_run:
    return trl_run(args.trl_run)
  t0 = time.time()
  root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="vs_trl-")).resolve()
  py = trl_python(pathlib.Path(args.trl_venv).expanduser())
  names = args.tasks.split(",")
  result = {"benchmark": "vs_trl", "budget_s": args.budget_s, "trl_version": TRL_VERSION, "trl_venv": args.trl_venv,
            "tunixlike_devices": args.tunixlike_devices, "torch_threads": args.torch_threads, "workdir": str(root)}
  result["tasks"] = {n: bench_task(n, args, root, py) for n in names}
  result["gain_ratio"] = {n: result["tasks"][n]["gain_ratio"] for n in names}
  result["first_step_s_warm"] = {n: result["tasks"][n]["tunixlike"]["first_step_s_warm"] for n in names}
  result["wall_s"] = round(time.time() - t0, 1)
  result["notes"] = notes(result)
  harness.report(result, args)


if __name__ == "__main__":
  main()
