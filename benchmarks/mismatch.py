"""Train-inference mismatch: importance ratios pi_learner / mu_sampler, with and without "Keep
Sampling Mask", and MoE routing disagreement with and without "Keep Routing" (routing replay).

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
concentrates its mass and the truncated tail is lighter).

Routing (key "routing"): a random MoE model of the same shape (top-2 of 16 experts; --quick: of 8)
samples with `sampler.record_routing`; the fp32 learner then scores the batch with and without
replaying the recorded experts (algo.keep_routing), in three settings:
  float32_sampler/staleness=0:  same weights, same precision (decode with a KV cache vs full forward);
  bfloat16_sampler/staleness=0: bf16 sampler weights + activations (router logits stay fp32 math on
                                bf16 weights), fp32 learner;
  float32_sampler/staleness=1:  the learner is one Adam step (--lr) ahead of the sampler's weights.
Per setting: routing disagreement (fraction of (token, MoE layer) whose learner top-k set differs
from the sampler's, and of tokens with at least one such layer; `learner.routing.disagreement` over
positions that predict a completion token, as the train step reports it) and the IS-ratio statistics
above. With replay the learner runs the sampler's experts, so its disagreement is counterfactual
(how often replay overrode the router).
"""

from __future__ import annotations

import time

import harness


def _flags(p):
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--group", type=int, default=4, help="completions per prompt")
  p.add_argument("--new-tokens", type=int, default=64, help="tokens per completion (no early stop)")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0, help="top-k applied together with top_p (0 = off)")
  p.add_argument("--lr", type=float, default=5e-4, help="Adam step of the staleness=1 routing setting")


ARGS = harness.parse(__doc__, _flags, quick="tiny model and workload", seed="the random weights and prompts")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tunixlike import config as config_lib, models  # noqa: E402
from tunixlike.learner import AlgoConfig, Learner, LearnerConfig, OptimConfig  # noqa: E402
from tunixlike.learner import routing as routing_lib  # noqa: E402
from tunixlike.learner.batch import assemble_batch  # noqa: E402
from tunixlike.learner.group_advantages import AdvantageConfig  # noqa: E402
from tunixlike.sampler import Engine, PromptRequest, RolloutDriver, SamplerConfig  # noqa: E402

# Groups no reward stage scored get their advantages in assemble_batch: the run's algo keys at their defaults.
UNSCORED = AdvantageConfig.from_config(config_lib.Config())

SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
QUICK_SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position_embeddings=256)
MOE = dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, qk_norm=True)
QUICK_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, qk_norm=True)
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


def _cast(params, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def routing_mismatch(a, sizes, prompts) -> dict:
  """Routing disagreement and IS ratios with and without Keep Routing (see the module docstring)."""
  cfg = models.ModelConfig(**sizes, **(QUICK_MOE if a.quick else MOE))
  make = lambda: models.Transformer(cfg, rngs=nnx.Rngs(a.seed))
  params = nnx.split(make())[1]
  rows, seq = a.prompts * a.group, PROMPT_LEN + a.new_tokens
  learners = {keep: Learner(make(), LearnerConfig(algo=AlgoConfig(keep_routing=keep, sampling_temperature=a.temperature),
                                                  optim=OptimConfig(learning_rate=a.lr), logprob_chunk_size=64))
              for keep in (False, True)}

  @jax.jit
  def router_logits(state, tokens_bt, routing_btlk):
    model = nnx.merge(learners[False].graphdef, state.params, state.frozen)
    return model.hidden_states(tokens_bt, routing_btlk=routing_btlk, return_aux=True)[1].router_logits_btlx

  def score(batch, state) -> dict:
    m_bt = batch["loss_mask"] > 0
    predicts_bt = np.concatenate([m_bt[:, 1:], np.zeros_like(m_bt[:, :1])], axis=1)  # position t predicts t+1
    entry, logps = dict(tokens=int(m_bt.sum())), {}
    for keep, learner in learners.items():
      name = "with_replay" if keep else "without_replay"
      logps[keep] = np.asarray(learner.token_logprobs(state, learner.put_batch(batch)))[0]
      logits = router_logits(state, batch["tokens"], batch["routing"] if keep else None)
      layer_frac, any_layer = map(np.asarray, routing_lib.disagreement(logits, jnp.asarray(batch["routing"])))
      entry[name] = dict(routing_disagreement=float(layer_frac[predicts_bt].mean()),
                         routing_token_disagreement=float(any_layer[predicts_bt].mean()),
                         **ratio_stats((logps[keep] - batch["behaviour_logprobs"])[m_bt]))
      if not keep:  # completion tokens whose forward ran other experts than the sampler's (token t <- position t-1)
        flipped_bt = np.concatenate([np.zeros_like(m_bt[:, :1]), any_layer[:, :-1] > 0], axis=1) & m_bt
    # What replay changes: the learner's log-prob of the same token, replayed vs not.
    effect = np.abs(logps[True] - logps[False])
    entry["replay_effect"] = dict(
        flipped_tokens=int(flipped_bt.sum()), mean_abs_logp_change=float(effect[m_bt].mean()),
        max_abs_logp_change=float(effect[m_bt].max()),
        mean_abs_logp_change_flipped=float(effect[flipped_bt].mean()) if flipped_bt.any() else 0.0)
    return entry

  def batch_from(dtype):
    s_model = models.Transformer(cfg.replace(dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(a.seed))
    s_cfg = SamplerConfig(max_concurrent_decodes=min(rows, 16), max_prefill_length=PROMPT_LEN,
                          max_new_tokens=a.new_tokens, temperature=a.temperature, record_routing=True,
                          group_size=a.group, steps_per_call=8, attend_bucket=32, seed=a.seed)
    groups = sample(s_model, _cast(params, dtype), s_cfg, prompts)
    for g in groups:  # rewards 0..G-1: non-zero advantages for the staleness=1 step
      g.rewards = np.arange(g.group_size, dtype=np.float32)
    return assemble_batch(groups, num_rows=rows, seq_buckets=(seq,), sampling_mask=False, routing=True,
                          unscored=UNSCORED)

  out = {}
  f32 = batch_from("float32")
  state0 = learners[True].state
  out["float32_sampler/staleness=0"] = score(f32, state0)
  out["bfloat16_sampler/staleness=0"] = score(batch_from("bfloat16"), state0)
  # One Adam step on the sampled batch (replayed routing), then score the same batch.
  state1, metrics = learners[True].train_step(state0, learners[True].put_batch(f32), jax.random.PRNGKey(a.seed))
  out["float32_sampler/staleness=1"] = score(f32, state1)
  out["float32_sampler/staleness=1"]["train_step_routing_disagreement"] = float(metrics["routing_disagreement"])
  return dict(settings=out, model=dict(sizes, **(QUICK_MOE if a.quick else MOE),
                                       params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))),
              learner="fp32 Learner.token_logprobs, with and without algo.keep_routing", lr=a.lr)


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
      algo=AlgoConfig(keep_sampling_mask=keep, sampling_temperature=a.temperature),
      optim=OptimConfig(learning_rate=a.lr), logprob_chunk_size=64))
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
      batch = assemble_batch(groups, num_rows=rows, seq_buckets=(seq,), sampling_mask=True, routing=False,
                             unscored=UNSCORED)
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
      routing=routing_mismatch(a, sizes, prompts),
      setup=dict(model=dict(sizes, params=n_params, weights=f"random init (seed {a.seed})"),
                 learner="fp32 Learner.token_logprobs (chunked unembedding), same weights as the sampler",
                 band=list(BAND), temperature=a.temperature, top_k=a.top_k, top_ps=list(TOP_PS), prompts=a.prompts,
                 group=a.group, prompt_tokens=PROMPT_LEN, new_tokens=a.new_tokens,
                 wall_s=round(time.perf_counter() - t0, 1)),
  )
  harness.report(out, a)


if __name__ == "__main__":
  main()
