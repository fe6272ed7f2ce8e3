"""Long rollouts: the paged KV cache against the contiguous one under the same KV memory budget.

  python benchmarks/long_rollouts.py [--requests 32] [--max-tokens 8192] [--budget-slots 4] [--slots 32]
      [--lengths 512,2048,8192] [--out FILE] [--quick]

Prints one JSON object. Model: the one of benchmarks/sampler_throughput.py (4 layers, hidden 256,
4 heads, 2 KV heads of 64, vocab 512, fp32, random weights): a token's K and V take 4 KB.
(a) Long-tailed workload: `--requests` prompts of 32 tokens whose completion limits are spread
    geometrically over [64, --max-tokens] (as many in 64-128 as in 4096-8192; shuffled), temperature
    1, no early stop. The budget is what `--budget-slots` contiguous slots of prompt + max-tokens
    positions take: contiguous decodes that many sequences at once; paged gets the same bytes as a
    block pool (`sampler.kv_cache_bytes`) and `--slots` slots, so how many decode at once depends on
    their lengths, and the youngest are preempted (and recomputed) when the pool runs dry.
    Reported: tokens/s of each, their ratio, mean live sequences per decode step, preemptions; with
    `--repeats R`, R paired runs (contiguous, then paged) and the pair of median ratio.
(b) Prompt sharing: a group of G = 8 samples of a 2048-token prompt inserted into a paged cache;
    `prompt_kv_bytes_per_group_ratio` = distinct blocks holding the group's prompt positions over
    the blocks of one sample's prompt (the contiguous cache holds G copies: ratio 8).
(c) The short fixed workload of sampler_throughput.py (16 prompts of 32 tokens, 128 new tokens, 16
    slots, no budget pressure): paged tokens/s over contiguous.
(d) `--lengths`: tokens/s of each layout as the completion length grows (`--budget-slots`
    sequences of exactly that length, the budget sized for them).
One device, one sampler replica. Every timed run follows a warm-up run of the same requests (so no
compilation is timed; asserted from JAX's trace events).
"""

from __future__ import annotations

import sys
import time

import harness


def _flags(p):
  p.add_argument("--requests", type=int, default=32, help="prompts of the long-tailed workload")
  p.add_argument("--max-tokens", type=int, default=8192, help="longest completion limit")
  p.add_argument("--min-tokens", type=int, default=64, help="shortest completion limit")
  p.add_argument("--budget-slots", type=int, default=4, help="the budget in contiguous slots of the longest sequence")
  p.add_argument("--slots", type=int, default=32, help="decode slots of the paged engine")
  p.add_argument("--block-size", type=int, default=32, help="sampler.kv_block_size")
  p.add_argument("--steps-per-call", type=int, default=8)
  p.add_argument("--repeats", type=int, default=1, help="paired timed runs of (a): contiguous then paged, each time")
  p.add_argument("--lengths", default="", help="comma-separated completion lengths for the growth table")
  p.add_argument("--skip-short", action="store_true", help="leave out the short fixed workload (c)")


ARGS = harness.parse(__doc__, _flags, quick="small workloads, a one-layer model")
harness.host_devices(1)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tunixlike import mesh as mesh_lib  # noqa: E402
from tunixlike import models  # noqa: E402
from tunixlike.sampler import PromptRequest, RolloutDriver, SamplerConfig, make_engine  # noqa: E402
from tunixlike.sampler.blocks import blocks_for  # noqa: E402

SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
             num_kv_heads=2, head_dim=64, qkv_bias=True, tie_embeddings=True)
PROMPT_LEN = 32
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def _model(max_positions: int):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), mesh_lib.SAMPLER_AXES)
  # --quick: one layer (unrolled: compiling each attention window's decode program is most of a smoke
  # run); no stop token, so the lengths decoded, and every count reported, do not depend on the weights
  sizes = dict(SIZES, num_layers=1) if ARGS.quick else SIZES
  cfg = models.ModelConfig(max_position_embeddings=max_positions, **sizes)
  return models.create_sharded(cfg, mesh, mesh_lib.SAMPLER_RULES, seed=ARGS.seed), mesh


def _run(engine, params, prompts, limits):
  """One driver run over every request; (tokens/s, driver stats)."""
  out = []
  requests = [PromptRequest(prompt_id=i, token_ids=p, max_new_tokens=int(m))
              for i, (p, m) in enumerate(zip(prompts, limits))]
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out.append)
  t0 = time.perf_counter()
  driver.run(max_wall_s=7200)
  dt = time.perf_counter() - t0
  tokens = sum(g.num_tokens for g in out)
  assert tokens == int(np.sum(limits)), (tokens, int(np.sum(limits)))
  return tokens / dt, driver.stats


def _timed(engine, params, prompts, limits, warm: bool = True) -> dict:
  if warm:
    _run(engine, params, prompts, limits)  # warm-up: compiles every program these requests need
  traced = []
  listener = lambda event, secs, fun_name="", **kw: traced.append(fun_name) if event == TRACE_EVENT else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    tok_s, stats = _run(engine, params, prompts, limits)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not traced, f"a timed run compiled {traced}"
  steps = stats.generate_calls * engine.config.steps_per_call
  return dict(tok_s=round(tok_s, 1), mean_live=round(stats.live_slot_steps / max(steps, 1), 2),
              preemptions=stats.preemptions, decode_steps=steps)


def attend_bucket(max_tokens: int) -> int:
  """`sampler.attend_bucket` for both layouts: 32 up to 2K tokens, then 1/64 of the longest
  completion, so the contiguous engine has about 65 windows (each a decode program and two resize
  programs; 32 would mean 257 at 8K, more than this machine's compiler memory held)."""
  return max(32, 1 << max(0, (max_tokens - 1).bit_length() - 6))


def _engines(model, mesh, max_tokens: int, budget_slots: int, paged_slots: int, a):
  common = dict(max_prefill_length=PROMPT_LEN, max_new_tokens=max_tokens, temperature=1.0,
                steps_per_call=a.steps_per_call, attend_bucket=attend_bucket(max_tokens))
  contiguous = make_engine(model, SamplerConfig(max_concurrent_decodes=budget_slots, **common), mesh)
  probe = SamplerConfig(max_concurrent_decodes=paged_slots, kv_layout="paged", kv_block_size=a.block_size, **common)
  block_bytes = make_engine(model, probe, mesh).block_bytes
  budget = budget_slots * blocks_for(contiguous.config.cache_length, a.block_size) * block_bytes
  paged = make_engine(model, SamplerConfig(max_concurrent_decodes=paged_slots, kv_layout="paged",
                                           kv_block_size=a.block_size, kv_cache_bytes=budget, **common), mesh)
  return contiguous, paged, budget


def long_tail(model, mesh, rng, a) -> dict:
  prompts = [rng.integers(0, SIZES["vocab_size"], size=PROMPT_LEN).astype(np.int32) for _ in range(a.requests)]
  limits = np.round(np.geomspace(a.min_tokens, a.max_tokens, a.requests)).astype(int)
  rng.shuffle(limits)
  contiguous, paged, budget = _engines(model, mesh, a.max_tokens, a.budget_slots, a.slots, a)
  params = contiguous.load_params()
  pairs = [(_timed(contiguous, params, prompts, limits, warm=i == 0), _timed(paged, params, prompts, limits, warm=i == 0))
           for i in range(a.repeats)]
  ratios = [p["tok_s"] / c["tok_s"] for c, p in pairs]
  c, p = pairs[int(np.argsort(ratios)[len(ratios) // 2])]  # the pair with the median ratio
  return dict(paged_tok_s=p["tok_s"], contiguous_tok_s=c["tok_s"],
              paged_vs_contiguous=round(p["tok_s"] / c["tok_s"], 3),
              concurrent_paged=p["mean_live"], concurrent_contiguous=c["mean_live"],
              concurrency_ratio=round(p["mean_live"] / c["mean_live"], 2), preemptions=p["preemptions"],
              runs_contiguous_paged_tok_s=[(c_["tok_s"], p_["tok_s"]) for c_, p_ in pairs],
              kv_cache_bytes=budget, paged_blocks=paged.num_blocks, decode_steps=dict(paged=p["decode_steps"],
                                                                                     contiguous=c["decode_steps"]),
              limits=dict(min=int(limits.min()), median=int(np.median(limits)), max=int(limits.max()),
                          tokens=int(limits.sum())))


def prompt_sharing(model, mesh, a, group: int = 8, prompt_len: int = 2048) -> dict:
  cfg = SamplerConfig(max_concurrent_decodes=group, max_prefill_length=prompt_len, max_new_tokens=64,
                      group_size=group, kv_layout="paged", kv_block_size=a.block_size, temperature=1.0,
                      steps_per_call=a.steps_per_call)
  engine = make_engine(model, cfg, mesh)
  params = engine.load_params()
  prompt = np.arange(prompt_len, dtype=np.int32) % SIZES["vocab_size"]
  state = engine.bulk_insert(engine.prefill(params, prompt), engine.init_decode_state(), list(range(group)),
                             keys=np.zeros((group, 2), np.uint32))
  prompt_blocks = blocks_for(prompt_len - 1, a.block_size)  # blocks of the prefilled positions
  distinct = {b for s in range(group) for b in state.tables.slots[s].blocks[:prompt_blocks]}
  return dict(prompt_kv_bytes_per_group_ratio=round(len(distinct) / prompt_blocks, 3), group_size=group,
              prompt_tokens=prompt_len, prompt_blocks_shared=len(distinct), prompt_blocks_one_sample=prompt_blocks)


def short_fixed(model, mesh, rng, a) -> dict:
  """sampler_throughput.py's fixed workload, both layouts, no budget pressure (paired repeats)."""
  n, new = (16, 128) if not a.quick else (8, 32)
  prompts = [rng.integers(0, SIZES["vocab_size"], size=PROMPT_LEN).astype(np.int32) for _ in range(n)]
  limits = np.full(n, new)
  common = dict(max_concurrent_decodes=n, max_prefill_length=PROMPT_LEN, max_new_tokens=new, temperature=1.0,
                steps_per_call=8, attend_bucket=32)
  contiguous = make_engine(model, SamplerConfig(**common), mesh)
  paged = make_engine(model, SamplerConfig(kv_layout="paged", kv_block_size=a.block_size, **common), mesh)
  params = contiguous.load_params()
  for engine in (contiguous, paged):
    _run(engine, params, prompts, limits)
  ratios, runs = [], []
  for _ in range(5 if not a.quick else 1):
    c, p = _run(contiguous, params, prompts, limits)[0], _run(paged, params, prompts, limits)[0]
    ratios.append(p / c)
    runs.append((round(c), round(p)))
  return dict(short_paged_vs_contiguous=round(float(np.median(ratios)), 3), runs_contiguous_paged=runs)


def growth(model, mesh, rng, a) -> list[dict]:
  rows = []
  for length in [int(x) for x in a.lengths.split(",") if x]:
    prompts = [rng.integers(0, SIZES["vocab_size"], size=PROMPT_LEN).astype(np.int32) for _ in range(a.budget_slots)]
    limits = np.full(a.budget_slots, length)
    contiguous, paged, _ = _engines(model, mesh, length, a.budget_slots, a.budget_slots, a)
    params = contiguous.load_params()
    c, p = _timed(contiguous, params, prompts, limits), _timed(paged, params, prompts, limits)
    rows.append(dict(completion_tokens=length, sequences=a.budget_slots, contiguous_tok_s=c["tok_s"],
                     paged_tok_s=p["tok_s"], paged_vs_contiguous=round(p["tok_s"] / c["tok_s"], 3)))
    print(rows[-1], file=sys.stderr, flush=True)
  return rows


def main():
  a = ARGS
  if a.quick:
    a.requests, a.max_tokens, a.min_tokens, a.slots, a.budget_slots = 8, 256, 16, 8, 2
  rng = np.random.default_rng(a.seed)
  longest = max([a.max_tokens, 2048 + 64] + [int(x) for x in a.lengths.split(",") if x]) + PROMPT_LEN + 64
  model, mesh = _model(longest)
  out = long_tail(model, mesh, rng, a)
  out.update(prompt_sharing(model, mesh, a, prompt_len=256 if a.quick else 2048))
  if not a.skip_short:
    out.update(short_fixed(model, mesh, rng, a))
  if a.lengths:
    out["growth"] = growth(model, mesh, rng, a)
  out["targets"] = dict(paged_vs_contiguous=1.5, concurrency_ratio=3.0, prompt_kv_bytes_per_group_ratio=1.2,
                        short_paged_vs_contiguous=0.9)
  out["setup"] = dict(devices=1, paged_slots=a.slots, budget_slots=a.budget_slots, block_size=a.block_size,
                      steps_per_call=a.steps_per_call, requests=a.requests, repeats=a.repeats, prompt_tokens=PROMPT_LEN,
                      spread=f"geometric over [{a.min_tokens}, {a.max_tokens}]")
  harness.report(out, a, indent=2)


if __name__ == "__main__":
  main()
