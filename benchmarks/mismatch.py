"""Train-inference mismatch at staleness 0: importance ratios pi_learner / mu_sampler, with and
without "Keep Sampling Mask".

  python benchmarks/mismatch.py [--prompts 16] [--group 4] [--new-tokens 64] [--quick] [--out FILE]

Prints one JSON object (and writes it to --out). The real sampler (`Engine` + `RolloutDriver`,
recording the packed top-k / top-p kept set of every token) samples completions with the same
weights the learner holds, so every difference between the learner's logprob and the sampler's
logprob of a token is mismatch, not staleness. For each sampler precision (float32, and bfloat16
activations + weights as a bf16 sampler would run) and top_p in {1.0, 0.8}, the fp32 `Learner`
scores the same batch twice (`Learner.token_logprobs`, the proximal logprobs of the loss):
  without_mask: log softmax(logits / T) over the whole vocabulary (what a learner that ignores
                the sampler's truncation computes);
  with_mask:    renormalised over the sampler's recorded kept set (algo.keep_sampling_mask).
Statistics over every completion token: mean ratio, mean and max |log ratio|, and the fraction of
ratios outside [0.9, 1.1] (the band TRL #6789 / #7269 report).
Model: the sampler benchmark's Qwen2-style shape (4 layers, hidden 256, vocab 512, fp32) with random
weights; --quick uses a 2-layer, vocab-128 model and a few prompts (a smoke test, not the figures).
Random weights give flat next-token distributions, so top_p=0.8 keeps most of the vocabulary and
drops about 20% of the mass on every token: a worst case for the unmasked ratio (a trained model
concentrates its mass and the truncated tail is lighter). MoE routing disagreement is not measured
here yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--group", type=int, default=4, help="completions per prompt")
  p.add_argument("--new-tokens", type=int, default=64, help="tokens per completion (no early stop)")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0, help="top-k applied together with top_p (0 = off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true", help="tiny model and workload: a smoke test")
  p.add_argument("--out", default=None, help="also write the JSON object to this file")
  return p.parse_args()


ARGS = _parse()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tunixlike import models  # noqa: E402
from tunixlike.learner import AlgoConfig, Learner, LearnerConfig  # noqa: E402
from tunixlike.learner.batch import assemble_batch  # noqa: E402
from tunixlike.sampler import Engine, PromptRequest, RolloutDriver, SamplerConfig  # noqa: E402

SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
QUICK_SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position_embeddings=256)
PROMPT_LEN = 16
TOP_PS = (1.0, 0.8)
BAND = (0.9, 1.1)


def ratio_stats(log_ratio: np.ndarray) -> dict[str, float]:
  """IS-ratio statistics of log(pi_learner / mu_sampler) over tokens."""
  ratio = np.exp(log_ratio.astype(np.float64))
  return dict(mean_ratio=float(ratio.mean()), mean_log_ratio=float(log_ratio.mean()),
              mean_abs_log_ratio=float(np.abs(log_ratio).mean()), max_abs_log_ratio=float(np.abs(log_ratio).max()),
              frac_outside_band=float(np.mean((ratio < BAND[0]) | (ratio > BAND[1]))))


def sample(model, params, cfg: SamplerConfig, prompts) -> list:
  engine = Engine(model, cfg)
  out = []
  requests = [PromptRequest(prompt_id=i, token_ids=p) for i, p in enumerate(prompts)]
  RolloutDriver(engine, engine.load_params(params), source=iter(requests), sink=out.append).run(max_wall_s=1800)
  for g in out:
    g.rewards = np.zeros(g.group_size, np.float32)  # the ratios do not depend on rewards
  return sorted(out, key=lambda g: g.prompt_id)


def main():
  a = ARGS
  if a.quick:
    a.prompts, a.group, a.new_tokens = 4, 2, 16
  sizes = QUICK_SIZES if a.quick else SIZES
  cfg = models.ModelConfig(**sizes)
  learner_model = lambda: models.Transformer(cfg, rngs=nnx.Rngs(a.seed))
  params = nnx.split(learner_model())[1]  # fp32 weights: the learner's, handed to every sampler
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  vocab = cfg.vocab_size
  rng = np.random.default_rng(a.seed)
  prompts = [rng.integers(0, vocab, size=PROMPT_LEN).astype(np.int32) for _ in range(a.prompts)]
  rows = a.prompts * a.group
  seq = PROMPT_LEN + a.new_tokens

  learners = {keep: Learner(learner_model(), LearnerConfig(
      algo=AlgoConfig(keep_sampling_mask=keep, sampling_temperature=a.temperature), logprob_chunk_size=64))
              for keep in (False, True)}
  t0 = time.perf_counter()
  settings = {}
  for dtype in ("float32", "bfloat16"):
    # A bf16 sampler: bf16 weights (cast from the learner's, as weight sync would) and activations.
    s_model = models.Transformer(cfg.replace(dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(a.seed))
    s_params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    for top_p in TOP_PS:
      s_cfg = SamplerConfig(max_concurrent_decodes=min(rows, 16), max_prefill_length=PROMPT_LEN,
                            max_new_tokens=a.new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=top_p,
                            record_sampling_mask=True, group_size=a.group, steps_per_call=8, attend_bucket=32,
                            seed=a.seed)
      groups = sample(s_model, s_params, s_cfg, prompts)
      batch = assemble_batch(groups, num_rows=rows, seq_buckets=(seq,), sampling_mask=True)
      completion = batch["loss_mask"] > 0
      kept = np.unpackbits(batch["sampling_mask"][completion], axis=-1, count=vocab).sum(-1)
      entry = dict(tokens=int(completion.sum()), kept_vocab_frac=float(kept.mean() / vocab))
      for keep, learner in learners.items():
        logp = np.asarray(learner.token_logprobs(learner.state, learner.put_batch(batch)))[0]
        log_ratio = (logp - batch["behaviour_logprobs"])[completion]
        entry["with_mask" if keep else "without_mask"] = ratio_stats(log_ratio)
      settings.setdefault(f"{dtype}_sampler", {})[f"top_p={top_p}"] = entry

  out = dict(
      settings=settings,
      headline={f"{d}_sampler/top_p=0.8/{m}/frac_outside_band": settings[f"{d}_sampler"]["top_p=0.8"][m][
          "frac_outside_band"] for d in ("float32", "bfloat16") for m in ("without_mask", "with_mask")},
      routing="not measured yet",
      setup=dict(model=dict(sizes, params=n_params, weights=f"random init (seed {a.seed})"),
                 learner="fp32 Learner.token_logprobs (chunked unembedding), same weights as the sampler",
                 band=list(BAND), temperature=a.temperature, top_k=a.top_k, top_ps=list(TOP_PS), prompts=a.prompts,
                 group=a.group, prompt_tokens=PROMPT_LEN, new_tokens=a.new_tokens, wall_s=round(time.perf_counter() - t0, 1),
                 jax=jax.__version__, devices=len(jax.devices()), platform=jax.devices()[0].platform, quick=a.quick),
  )
  text = json.dumps(out, indent=1)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text)
  print(text)


if __name__ == "__main__":
  main()
