"""A realistic model size: load, compile, memory, sampler, learner and sync of a Qwen2.5-shaped checkpoint.

  python benchmarks/scale.py [--size 0.5b|1.5b|50m|long|tiny] [--layout split|colocated] [--dtype bfloat16]
      [--batches 64,256] [--prompt-len 64] [--new-tokens 128] [--train-batch 8] [--train-seq 512]
      [--hf-generate] [--out FILE] [--quick]

Prints one JSON object (and writes it to --out). A random checkpoint is written by transformers
itself (safetensors, `--dtype` on disk) beside a byte-level BPE tokenizer in the Qwen2 format
(`models.testing`), in a child process, so that this process's peak RSS is the loader's alone.
Then, as a run does with `model.hf_path`:
  * load: `models.from_pretrained` onto the learner mesh (FSDP over `fsdp`), parameters in `--dtype`;
    the seconds, and the process's peak RSS while loading (sampled every 5 ms, and the kernel's
    high-water mark) against the budget 1.5 x the checkpoint's bytes + the learner state's bytes
    (on CPU the learner state lives in host memory);
  * learner: the real `Learner.train_step` (GRPO ppo_clip, token-level TIS, AdamW) on
    `--train-batch` rows of `--train-seq` tokens: the first step's seconds (compile included) and
    the best step of the rest; MFU = model FLOPs/s (`tunixlike.flops`) / the peak of a `--dtype`
    matmul measured in the same run on the learner's devices;
  * sync: `weight_sync.sync` of the learner's parameters to the sampler's shardings, as
    `WeightSync.sync` does (median milliseconds, waited for);
  * sampler: the engine with the paged KV cache, static batches of `--batches` prompts of
    `--prompt-len` random tokens, exactly `--new-tokens` new tokens each (no stop token): the first
    run's seconds (compile included) and the decode tokens/s of the next;
  * `--hf-generate`: transformers' `generate` on the same checkpoint, same batches and lengths, in a
    child process before JAX takes the device (CUDA when torch sees it), for a side-by-side ratio.
Layouts: `split` (default on CPU: 8 devices, 4 sampler replicas + 4 learner FSDP) or `colocated`
(both sides on every device: one GPU). Sizes: 0.5b = Qwen2.5-0.5B's shape (hidden 896, 24 layers,
14 heads, 2 KV heads, ffn 4864, vocab 151936, tied); 1.5b = Qwen2.5-1.5B's; 50m = a 47M Qwen2-shaped
model (the CI size); long = the 16K-completion run of configs/long_context_grpo.py; tiny = a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import threading
import time

import harness  # benchmarks/harness.py: the shared flags, devices and JSON report
import learner_timing

SIZES = {
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864,
                 vocab_size=151936, rope_theta=1e6, max_position_embeddings=32768),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                 intermediate_size=8960, vocab_size=151936, rope_theta=1e6, max_position_embeddings=32768),
    "50m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=2048,
                vocab_size=32768, rope_theta=1e6, max_position_embeddings=4096),
    # configs/long_context_grpo.py: a Qwen2-shaped model small enough for 16K-token completions on CPU, whose
    # 65,536-row embedding (a 1,024-token tokenizer, as Qwen2.5's table outgrows its tokenizer) makes a random
    # model's stop token rare (1 in 65,536 per token): its completions run to the length limit.
    "long": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=65536, rope_theta=1e6, max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=2048, rope_theta=1e4, max_position_embeddings=512),
}


# Each shape flag's default, for the figures and for --quick (a smoke test).
SHAPES = {
    "full": dict(size="0.5b", batches="64,256", prompt_len=64, new_tokens=128, train_batch=8, train_seq=512, steps=3,
                 syncs=5),
    "quick": dict(size="tiny", batches="8,16", prompt_len=16, new_tokens=16, train_batch=4, train_seq=64, steps=1,
                  syncs=2),
}


def _shape(name: str, what: str) -> str:
  return f"{what} (default {SHAPES['full'][name]}; --quick: {SHAPES['quick'][name]})"


def _flags(p):
  p.add_argument("--size", default=None, choices=sorted(SIZES), help=_shape("size", "the model's shape"))
  p.add_argument("--layout", default=None, choices=("split", "colocated"),
                 help="default: colocated on one device, else split into halves")
  p.add_argument("--sampler-tensor", type=int, default=1,
                 help="mesh.sampler_tensor: 4 holds one copy of the weights over 4 sampler devices, not one per replica")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="weights, compute, checkpoint")
  # The shapes' defaults are in SHAPES: a flag given explicitly wins over --quick's.
  p.add_argument("--batches", default=None, help=_shape("batches", "decode batch sizes (comma-separated)"))
  p.add_argument("--prompt-len", type=int, default=None, help=_shape("prompt_len", "prompt tokens"))
  p.add_argument("--new-tokens", type=int, default=None, help=_shape("new_tokens", "decoded tokens per prompt"))
  p.add_argument("--train-batch", type=int, default=None, help=_shape("train_batch", "learner rows"))
  p.add_argument("--train-seq", type=int, default=None, help=_shape("train_seq", "tokens per learner row"))
  p.add_argument("--steps", type=int, default=None, help=_shape("steps", "timed learner steps after the first"))
  p.add_argument("--syncs", type=int, default=None, help=_shape("syncs", "timed weight syncs"))
  p.add_argument("--hf-generate", action="store_true", help="also time transformers' generate (same batches)")
  p.add_argument("--skip-learner-step", action="store_true",
                 help="build the learner (its state is what syncs) but time no train step: on CPU a 0.5B step's "
                      "compilation took over 17 GB of host memory, more than a shared 24 GB machine has")
  p.add_argument("--checkpoint", default=None, help="an existing directory written by this script (skips writing)")
  p.add_argument("--write", default=None, help=argparse.SUPPRESS)  # child: write the checkpoint here and exit
  p.add_argument("--hf-generate-only", default=None, help=argparse.SUPPRESS)  # child: time generate on this dir


def _parse(argv=None):
  a = harness.parse(__doc__, _flags, argv, quick="small shapes (and the tiny size unless --size)")
  for name, default in SHAPES["quick" if a.quick else "full"].items():
    if getattr(a, name) is None:
      setattr(a, name, default)
  a.batches = [int(b) for b in str(a.batches).split(",")]
  return a


ARGS = _parse()


def write_checkpoint(path: str, size: str, dtype: str) -> None:
  """The child that writes: transformers' own random checkpoint and a Qwen2-format tokenizer."""
  from tunixlike.models import testing
  sizes = dict(SIZES[size])
  testing.write_random_hf_checkpoint(path, "qwen2", tie_embeddings=True, seed=0, std=0.02, dtype=dtype,
                                     llama3_rope=False, **sizes)
  testing.write_bpe_tokenizer(path)


def hf_generate(path: str, a) -> dict:
  """The child that times transformers' `generate`: same batches, prompt and completion lengths."""
  import numpy as np
  import torch
  import transformers
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype)).to(device).eval()
  vocab = SIZES[a.size]["vocab_size"]
  out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
         "transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation}
  rng = np.random.default_rng(0)
  for batch in a.batches:
    x = torch.as_tensor(rng.integers(0, vocab, size=(batch, a.prompt_len)), dtype=torch.long, device=device)

    def run(n):
      if device == "cuda":
        torch.cuda.synchronize()
      t0 = time.perf_counter()
      with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
      if device == "cuda":
        torch.cuda.synchronize()
      assert y.shape == (batch, a.prompt_len + n), y.shape
      return time.perf_counter() - t0

    run(4)  # warm-up (kernels, allocator)
    dt = run(a.new_tokens)
    out[f"batch_{batch}"] = {"decode_tokens_per_s": batch * a.new_tokens / dt, "seconds": dt}
  return out


if ARGS.write is not None:
  write_checkpoint(ARGS.write, ARGS.size, ARGS.dtype)
  sys.exit(0)
if ARGS.hf_generate_only is not None:
  print(json.dumps(hf_generate(ARGS.hf_generate_only, ARGS)))
  sys.exit(0)

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  harness.host_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from flax import nnx  # noqa: E402

from tunixlike import flops, mesh as mesh_lib, models  # noqa: E402
from tunixlike.learner import AlgoConfig, Learner, LearnerConfig, OptimConfig  # noqa: E402
from tunixlike.rl import weight_sync  # noqa: E402
from tunixlike.sampler import Engine, PromptRequest, RolloutDriver, SamplerConfig  # noqa: E402


class PeakRSS:
  """The process's largest resident set while the block runs, sampled every `every_s` seconds."""

  def __init__(self, every_s: float = 0.005):
    self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
    self._proc = psutil.Process()

  def __enter__(self):
    self.before = self.peak = self._proc.memory_info().rss
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()
    return self

  def _watch(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, self._proc.memory_info().rss)
      time.sleep(self.every_s)

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self._proc.memory_info().rss)


def nbytes(tree) -> int:
  """Bytes of every array of `tree`, every shard counted (what the devices hold)."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def decode_run(engine, params, prompts, new_tokens: int) -> tuple[float, float]:
  """(seconds, decode tokens/s) of one static batch: every slot filled once, no early stop."""
  out = []
  requests = [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=new_tokens) for i, p in enumerate(prompts)]
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out.append, static_batching=True)
  t0 = time.perf_counter()
  driver.run(max_wall_s=1800)
  dt = time.perf_counter() - t0
  tokens = sum(g.num_tokens for g in out)
  assert tokens == len(prompts) * new_tokens, (tokens, len(prompts) * new_tokens)
  return dt, tokens / dt


def learner_figures(learner, cfg, a, peak) -> dict:
  b, t = a.train_batch, a.train_seq
  batch = learner.put_batch(learner_timing.synthetic_batch(np.random.default_rng(a.seed), cfg.vocab_size, b, t,
                                                           prompt_len=min(64, t // 2)))
  state, first, times, metrics = learner_timing.timed_steps(learner, batch, a.steps)
  learner.state = state
  step_s = min(times) if times else first
  model_flops = flops.train_flops_per_token(cfg, t) * b * t / step_s
  return {"batch": b, "seq": t, "first_step_s_incl_compile": round(first, 3), "step_s": round(step_s, 4),
          "step_s_all": [round(x, 4) for x in times], "tokens_per_s": round(b * t / step_s, 1),
          "model_flops_per_s": model_flops, "mfu": model_flops / peak, "mfu_target": 0.35,
          "loss_finite": bool(np.isfinite(float(metrics["loss"])))}


def sampler_figures(meshes, learner, a, sync: dict, decode: dict, report) -> None:
  """Fills `sync` and `decode` (figures per batch; `report()` after each): one engine per batch
  size, its params synced from the learner."""
  vocab = learner.model(learner.state).cfg.vocab_size
  rng = np.random.default_rng(1)
  for batch in a.batches:
    cfg = SamplerConfig(max_concurrent_decodes=batch, max_prefill_length=a.prompt_len,
                        max_new_tokens=a.new_tokens, temperature=1.0, steps_per_call=8, kv_layout="paged",
                        min_prefill_bucket=min(a.prompt_len, 64))
    trained = learner.model(learner.state)  # the learner's current arrays (the loaded ones were donated)
    engine = Engine(trained, cfg, meshes.sampler)
    source = nnx.split(trained)[1]
    if not sync:  # the runtime's full sync (WeightSync.sync in its full mode), waited for
      times = []
      for _ in range(a.syncs + 1):  # each copy dropped before the next (two would hold 2x the sampler's bytes)
        synced, ms = weight_sync.sync(source, engine.param_shardings)
        times.append(ms)
        del synced
      sync.update(ms=float(np.median(times[1:])), ms_all=[round(x, 2) for x in times], first_ms=times[0],
                  target_ms=50.0)
      report()
    params, _ = weight_sync.sync(source, engine.param_shardings)
    sync["bytes_delivered"] = nbytes(params)
    prompts = [rng.integers(0, vocab, size=a.prompt_len).astype(np.int32) for _ in range(batch)]
    first_s, _ = decode_run(engine, params, prompts, a.new_tokens)
    seconds, tok_s = decode_run(engine, params, prompts, a.new_tokens)
    decode[f"batch_{batch}"] = {"first_run_s_incl_compile": round(first_s, 3), "seconds": round(seconds, 3),
                                "decode_tokens_per_s": round(tok_s, 1)}
    del params, engine
    report()


def _partial(out: dict, a) -> None:
  """What is measured so far, written to --out after each stage (a run stopped by a time limit keeps it)."""
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps({**out, "partial": True}) + "\n")


def main():
  a = ARGS
  out: dict = {"benchmark": "scale", "size": a.size, "dtype": a.dtype, "backend": None}
  with tempfile.TemporaryDirectory(prefix="tunixlike-scale-") as tmp:
    path = a.checkpoint or tmp
    t0 = time.perf_counter()
    if a.checkpoint is None:
      subprocess.run([sys.executable, __file__, "--write", path, "--size", a.size, "--dtype", a.dtype], check=True)
    out["write_s"] = round(time.perf_counter() - t0, 2)
    weights = sum(f.stat().st_size for f in pathlib.Path(path).glob("*.safetensors"))
    if a.hf_generate:  # before JAX takes the accelerator's memory
      child = subprocess.run([sys.executable, __file__, "--hf-generate-only", path, "--size", a.size,
                              "--dtype", a.dtype, "--batches", ",".join(map(str, a.batches)),
                              "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens)],
                             capture_output=True, text=True)
      # A failure here is recorded, not fatal: the rest of the figures still come.
      out["hf_generate"] = (json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0
                            else {"error": child.stderr[-3000:]})
      _partial(out, a)

    devices = jax.devices()
    out["backend"], out["devices"] = jax.default_backend(), f"{len(devices)} x {devices[0].device_kind}"
    layout = a.layout or ("colocated" if len(devices) == 1 else "split")
    half = len(devices) // 2
    sizes = (len(devices), 0) if layout == "colocated" else (half, len(devices) - half)
    meshes = mesh_lib.make_meshes(*sizes, sampler_tensor=a.sampler_tensor, learner_tensor=1, layout=layout)
    out["layout"] = {"layout": layout, "sampler": dict(meshes.sampler.shape), "learner": dict(meshes.learner.shape)}

    with PeakRSS() as rss:
      t0 = time.perf_counter()
      model = models.from_pretrained(path, mesh=meshes.learner, rules=mesh_lib.LEARNER_RULES, dtype=a.dtype)
      jax.block_until_ready(nnx.state(model))
      load_s = time.perf_counter() - t0
  cfg = model.cfg
  params = nnx.state(model)
  out["params"] = int(sum(x.size for x in jax.tree.leaves(params)))
  out["checkpoint_bytes"] = weights
  out["load_s"] = round(load_s, 2)

  lcfg = LearnerConfig(algo=AlgoConfig(loss="ppo_clip", is_mode="tis"),
                       optim=OptimConfig(learning_rate=1e-6))
  learner = Learner(model, lcfg, mesh=meshes.learner, rules=mesh_lib.LEARNER_RULES)
  state_bytes = nbytes(learner.state)
  on_host = out["backend"] == "cpu"
  budget = 1.5 * weights + (state_bytes if on_host else 0)
  out["load_memory"] = {
      "rss_before_bytes": rss.before, "rss_peak_bytes": rss.peak, "rss_growth_bytes": rss.peak - rss.before,
      "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      "learner_state_bytes": state_bytes, "budget_bytes": budget,
      "budget": "1.5 x checkpoint bytes" + (" + learner state bytes (on CPU the devices' memory is the host's)"
                                            if on_host else ""),
      "within_budget": rss.peak - rss.before <= budget}

  _partial(out, a)
  # --quick: a 1024^3 matmul (a smoke test's peak: 2048^3 took 6 CPU-s of a CI run on 2 cores)
  peak = flops.peak_matmul_flops(list(meshes.learner.devices.flat), n=1024 if a.quick else 2048 if on_host else 8192,
                                 dtype=jnp.dtype(a.dtype))
  out["peak_matmul"] = peak
  try:  # e.g. out of device memory: recorded, and the sync and sampler figures still come
    if a.skip_learner_step:
      raise RuntimeError("not run (--skip-learner-step)")
    with PeakRSS() as rss_train:
      out["learner"] = learner_figures(learner, cfg, a, peak["peak"])
    out["learner"]["rss_peak_bytes"] = rss_train.peak
  except Exception as e:  # noqa: BLE001
    out["learner"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "first_step_s_incl_compile": None}
  _partial(out, a)
  out["sync"], out["sampler"] = {}, {}
  sampler_figures(meshes, learner, a, out["sync"], out["sampler"], lambda: _partial(out, a))
  if "hf_generate" in out and "error" not in out["hf_generate"]:
    out["decode_vs_hf_generate"] = {
        k: round(out["sampler"][k]["decode_tokens_per_s"] / out["hf_generate"][k]["decode_tokens_per_s"], 3)
        for k in out["sampler"]}
    out["decode_vs_hf_generate_target"] = 2.0
  out["compile_s"] = {"learner_first_step": out["learner"].get("first_step_s_incl_compile"),
                      **{f"sampler_{k}_first_run": v["first_run_s_incl_compile"] for k, v in out["sampler"].items()}}
  out["setup"] = dict(prompt_len=a.prompt_len, new_tokens=a.new_tokens, batches=a.batches, kv_layout="paged")
  harness.report(out, a)


if __name__ == "__main__":
  main()
