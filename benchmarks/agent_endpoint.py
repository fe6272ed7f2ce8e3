"""Agent endpoint: tokens/s served over HTTP to agents vs the same workload in process, in one run.

  python benchmarks/agent_endpoint.py [--agents 64] [--prompts 32] [--tokens 64] [--repeats 5]
      [--out FILE] [--quick]

Prints one JSON object. Model: the sampler benchmark's size (4 layers, hidden 256, ffn 1024, 4 heads,
2 KV heads, fp32) over the character tokenizer, random weights, `--slots` decode slots on one device.
Workload: `--prompts` prompts x G = 8 samples, `--tokens` new tokens each (no EOS, so both modes
decode exactly the same tokens). With more agents than slots, as in agent RL (agents spend time in
their own code and tools), requests queue for slots instead of each wave of finished agents leaving
the slots empty while the next ones send their requests. In process: a `RolloutDriver` samples the groups. Endpoint: an
`AgentDriver` runs one agent per sample, `--agents` at once, each a function that sends one
chat completion with the official `openai` client (one client shared by all agents) to the run's
server (Starlette on uvicorn) and returns its reward: every token goes through the real HTTP path
and is recorded.
`endpoint_vs_inprocess` is the endpoint's wall time over the in-process one (median of `--repeats`
timed runs each, after a warm-up run of each that compiles every program).
"""

from __future__ import annotations

import ssl
import statistics
import threading
import time

import harness


def _flags(p):
  p.add_argument("--agents", type=int, default=64, help="agents (episodes) running at once")
  p.add_argument("--slots", type=int, default=32, help="decode slots (both modes)")
  p.add_argument("--prompts", type=int, default=32, help="prompts per run (x 8 samples)")
  p.add_argument("--tokens", type=int, default=64, help="new tokens per sample")
  p.add_argument("--repeats", type=int, default=5)


ARGS = harness.parse(__doc__, _flags, quick="4 prompts x 8 samples of 16 tokens, 1 repeat, a one-layer model")
harness.host_devices(1)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
from flax import nnx  # noqa: E402

from tunixlike import config as config_lib, models  # noqa: E402
from tunixlike.agents.driver import AgentConfig, AgentDriver  # noqa: E402
from tunixlike.data import char_tokenizer  # noqa: E402
from tunixlike.sampler import Engine, PromptRequest, SamplerConfig  # noqa: E402
from tunixlike.sampler.driver import RolloutDriver  # noqa: E402

G = 8


def _requests(tok, n):
  rng = np.random.default_rng(ARGS.seed)
  out = []
  for i in range(n):
    text = f"{rng.integers(100, 999)}+{rng.integers(100, 999)}="
    out.append(PromptRequest(prompt_id=i, token_ids=np.asarray(tok.encode(text), np.int32), prompt_text=text))
  return out


_SSL = ssl.create_default_context()  # loading the CA bundle is most of a client's construction cost
_local = threading.local()


def _client(base_url, api_key):
  """One client per agent thread: a shared client's connection pool is one lock and a scan over
  every connection per request, which 64 threads contend for."""
  if getattr(_local, "base_url", None) != (base_url, api_key):
    _local.base_url = (base_url, api_key)
    _local.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120,
                                  http_client=openai.DefaultHttpxClient(verify=_SSL))
  return _local.client


def _agent(tokens):
  def run_episode(base_url, api_key, episode_id, row):
    client = _client(base_url, api_key)
    reply = client.chat.completions.create(model="policy", max_tokens=tokens,
                                           messages=[{"role": "user", "content": row["prompt_text"]}],
                                           extra_headers={"X-Episode-Id": episode_id})
    return float(len(reply.choices[0].message.content) > 0)  # the episode's reward
  return run_episode


def _timed(make_driver):
  out = []
  driver = make_driver(out.append)
  t0 = time.perf_counter()
  try:
    driver.run(max_wall_s=600)
  finally:
    seconds = time.perf_counter() - t0
    driver.stop(timeout_s=config_lib.Config().rl.wait_timeout_s)
  tokens = sum(int(c.loss_mask.sum()) for g in out for c in g.completions)
  return seconds, tokens, driver.stats


def main():
  prompts, tokens = (4, 16) if ARGS.quick else (ARGS.prompts, ARGS.tokens)
  repeats = 1 if ARGS.quick else ARGS.repeats
  tok = char_tokenizer.build()
  # --quick: one layer (unrolled: compiling the decode programs is most of a smoke run; no EOS, so both modes
  # decode the same tokens whatever the weights)
  cfg = models.tiny_config(vocab_size=tok.vocab_size, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                           intermediate_size=1024, num_layers=1 if ARGS.quick else 4)
  model = models.Transformer(cfg, rngs=nnx.Rngs(ARGS.seed))
  slots = ARGS.slots
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "tensor"))
  engine = Engine(model, SamplerConfig(max_prefill_length=32, max_new_tokens=tokens, max_concurrent_decodes=slots,
                                       steps_per_call=8, attend_bucket=32, min_prefill_bucket=32, eos_ids=(),
                                       group_size=G), mesh)
  params = engine.load_params()
  engine.warmup(params)
  requests = _requests(tok, prompts)

  def inprocess(sink):
    return RolloutDriver(engine, params, source=iter(requests), sink=sink)

  def endpoint(sink):
    return AgentDriver(engine, params, source=iter(requests), sink=sink, agent=_agent(tokens), tokenizer=tok,
                       agent_config=AgentConfig.from_config(config_lib.Config(), max_turns=1, workers=ARGS.agents,
                                                            episode_timeout_s=600))

  runs = {"inprocess": [], "endpoint": []}
  for name, make in (("inprocess", inprocess), ("endpoint", endpoint)):
    _timed(make)  # warm-up: the server's and clients' first requests, any program not yet compiled
  for _ in range(repeats):  # interleaved, so that a change in the machine's load hits both
    for name, make in (("inprocess", inprocess), ("endpoint", endpoint)):
      seconds, n_tokens, stats = _timed(make)
      expected = prompts * G * tokens
      if n_tokens != expected:
        raise RuntimeError(f"{name}: {n_tokens} tokens decoded, expected {expected}")
      refused = getattr(stats, "refused_requests", 0)
      if refused or getattr(stats, "aborted_episodes", 0):
        raise RuntimeError(f"{name}: {refused} refused requests, {stats.aborted_episodes} aborted episodes")
      runs[name].append({"seconds": round(seconds, 3), "tokens_per_s": round(n_tokens / seconds, 1)})
  med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
  n_tokens = prompts * G * tokens
  harness.report(dict(
      endpoint_tok_s=round(n_tokens / med["endpoint"], 1), inprocess_tok_s=round(n_tokens / med["inprocess"], 1),
      endpoint_vs_inprocess=round(med["endpoint"] / med["inprocess"], 3), runs=runs,
      workload=dict(prompts=prompts, samples_per_prompt=G, new_tokens=tokens, agents=ARGS.agents, slots=slots,
                    requests_per_run=prompts * G, quick=ARGS.quick, repeats=repeats),
      model=dict(layers=cfg.num_layers, hidden=256, ffn=1024, heads=4, kv_heads=2, vocab=tok.vocab_size)), ARGS,
      indent=2)


if __name__ == "__main__":
  main()
