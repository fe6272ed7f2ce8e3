"""Learner train-step throughput and model FLOPs utilisation (MFU) on this machine.

  python benchmarks/learner_step.py [--devices 2] [--batch 8] [--seq 256] [--steps 3] [--out FILE] [--quick]

Prints one JSON object. Two models (fp32, random weights, Qwen2-style with tied embeddings):
  sampler_bench: the model of benchmarks/sampler_throughput.py (4 layers, hidden 256, ffn 1024,
                 4 heads, 2 KV heads, vocab 512; ~4M params);
  m60:           ~57M params (8 layers, hidden 768, ffn 2048, 12 heads, 4 KV heads, vocab 8192).
Each step is the real `Learner.train_step` (GRPO ppo_clip loss, token-level TIS, AdamW, grad
clipping, chunked log-probs and entropy) on the learner mesh: ('fsdp', 'tensor') = (devices, 1).

model FLOPs per token = 6 * N_matmul + 12 * L * (H * D_head) * T (PaLM, arXiv 2204.02311, app. B):
N_matmul counts every weight used in a matmul (the tied embedding once, as the unembedding); the
attention term counts QK^T and AV over the full T (the causal half is not subtracted). Work the
step does beyond that (softmax/entropy over V, norms, the recomputed unembedding of the chunked
log-probs, the optimizer) is not counted, so MFU is a lower bound of hardware utilisation.
peak_matmul_flops_per_s: the best of a 4096^3 fp32 jitted matmul on one device and the same
batched over all devices (data parallel), measured before and after each model in this run (the
best of all measurements is used). mfu = model_flops_per_s / peak. On a shared machine the load
average is reported: figures taken under load are noisy.
"""

from __future__ import annotations


import harness
import learner_timing


def _flags(p):
  p.add_argument("--devices", type=int, default=2, help="CPU devices = learner fsdp axis")
  p.add_argument("--batch", type=int, default=8, help="rows per step")
  p.add_argument("--seq", type=int, default=256, help="tokens per row (prompt 32 + completion)")
  p.add_argument("--micro-batches", type=int, default=1)
  p.add_argument("--steps", type=int, default=3, help="timed steps (best of them is reported)")


ARGS = harness.parse(__doc__, _flags, quick="small shapes, one layer per model")
harness.host_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from tunixlike import flops, models  # noqa: E402
from tunixlike.learner import AlgoConfig, Learner, LearnerConfig, OptimConfig  # noqa: E402
from tunixlike.mesh import LEARNER_RULES  # noqa: E402

MODELS = {
    "sampler_bench": dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=64, qkv_bias=True),
    "m60": dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12,
                num_kv_heads=4, head_dim=64, qkv_bias=True),
}
PROMPT_LEN = 32


def peak_matmul_flops(devices, n=4096) -> dict:
  """FLOP/s of a large fp32 matmul: one device, and one per device in parallel."""
  return flops.peak_matmul_flops(devices, n=n, dtype=jnp.float32)


def flops_per_token(cfg: models.ModelConfig, seq: int) -> tuple[float, int]:
  return flops.train_flops_per_token(cfg, seq), flops.matmul_params(cfg)


def bench_model(name: str, sizes: dict, mesh: Mesh, batch: int, seq: int, steps: int) -> dict:
  cfg = models.ModelConfig(**sizes, max_position_embeddings=max(seq, 512))
  model = models.create_sharded(cfg, mesh, LEARNER_RULES, seed=ARGS.seed)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  lcfg = LearnerConfig(algo=AlgoConfig(loss="ppo_clip", is_mode="tis"),
                       optim=OptimConfig(learning_rate=1e-5, micro_batches=ARGS.micro_batches),
                       logprob_chunk_size=128)
  learner = Learner(model, lcfg, mesh=mesh, rules=LEARNER_RULES)
  placed = learner.put_batch(learner_timing.synthetic_batch(np.random.default_rng(ARGS.seed), cfg.vocab_size,
                                                            batch, seq, PROMPT_LEN))
  _, compile_s, times, metrics = learner_timing.timed_steps(learner, placed, steps)
  step_s = min(times)
  fpt, n_matmul = flops_per_token(cfg, seq)
  tokens = batch * seq
  return {
      "params": int(n_params), "matmul_params": int(n_matmul), "batch": batch, "seq": seq,
      "tokens_per_step": tokens, "step_s": step_s, "step_s_all": times, "first_step_s_incl_compile": compile_s,
      "tokens_per_s": tokens / step_s, "model_flops_per_token": fpt, "model_flops_per_s": fpt * tokens / step_s,
      "loss_finite": bool(np.isfinite(float(metrics["loss"]))),
  }


def main():
  devices = jax.devices()[:ARGS.devices]
  batch, seq, steps = (ARGS.batch, ARGS.seq, ARGS.steps) if not ARGS.quick else (4, 64, 1)
  n = 1024 if ARGS.quick else 4096
  # The machine may be shared: the peak is measured before and after every model and the best
  # figure is used, so a busy moment during one peak measurement cannot inflate the MFU.
  peaks = [peak_matmul_flops(devices, n=n)]
  mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tensor"))
  results = {}
  for name, sizes in MODELS.items():
    if ARGS.quick:  # the layers are unrolled: compiling the step is most of a smoke run, per layer
      sizes = dict(sizes, num_layers=1)
    results[name] = bench_model(name, sizes, mesh, batch, seq, steps)
    peaks.append(peak_matmul_flops(devices, n=n))
  peak = max(peaks, key=lambda p: p["peak"])
  for r in results.values():
    r["mfu"] = r["model_flops_per_s"] / peak["peak"]
  large = max(results, key=lambda k: results[k]["params"])
  out = {
      "benchmark": "learner_step", "devices": len(devices),
      "mesh": {"fsdp": len(devices), "tensor": 1}, "dtype": "float32",
      "larger_model": large,
      "tokens_per_s": results[large]["tokens_per_s"],
      "model_flops_per_s": results[large]["model_flops_per_s"],
      "peak_matmul_flops_per_s": peak["peak"], "peak_matmul_detail": peak,
      "peak_matmul_measurements": [p["peak"] for p in peaks],
      "mfu": results[large]["mfu"], "mfu_target": 0.25, "mfu_target_met": results[large]["mfu"] >= 0.25,
      "models": results,
  }
  harness.report(out, ARGS)


if __name__ == "__main__":
  main()
