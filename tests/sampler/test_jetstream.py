"""Our engine served by JetStream's own orchestrator gives the same greedy tokens as our driver.

Needs the optional extra (pip install -e ".[jetstream]"); skipped when JetStream is not installed.
"""

import asyncio
import logging

import jax
import numpy as np
import pytest

_root_level, _root_handlers = logging.getLogger().level, list(logging.getLogger().handlers)
pytest.importorskip("jetstream.core.orchestrator",
                    reason="google-jetstream not installed (optional extra: pip install -e '.[jetstream]')")
from jetstream.core import orchestrator  # noqa: E402

# Importing JetStream's orchestrator sets the root logger to DEBUG with a stdout handler: every later
# test in this process would log each JAX compilation (and log to a closed stream at exit). Undo it.
logging.getLogger().setLevel(_root_level)
for _h in logging.getLogger().handlers[:]:
  if _h not in _root_handlers:
    logging.getLogger().removeHandler(_h)
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api  # noqa: E402

from sampler_prompts import random_prompts  # noqa: E402
from tunixlike.sampler import PromptRequest, RolloutDriver  # noqa: E402
from tunixlike.sampler.jetstream_adapter import JetStreamEngine  # noqa: E402

pytestmark = pytest.mark.jetstream

BOS = 1
NEW_TOKENS = 12


def _jetstream_decode(js_engine, params, prompts, timeout_s=300):
  """Runs every prompt through JetStream's Driver + LLMOrchestrator.Decode (token-id requests)."""
  driver = orchestrator.Driver(prefill_engines=[js_engine], generate_engines=[js_engine],
                               prefill_params=[params], generate_params=[params], interleaved_mode=True)
  client = orchestrator.LLMOrchestrator(driver=driver)

  async def one(ids):
    request = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[int(i) for i in ids]),
        max_tokens=NEW_TOKENS)
    out = []
    async for response in client.Decode(request):
      out.extend(response.stream_content.samples[0].token_ids)
    return out

  async def everything():  # all at once: more prompts than slots, so slots are refilled
    try:
      return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout_s)
    finally:
      # Stop JetStream's threads while the event loop still runs: a detokenize thread that posts a
      # last result to a closed loop raises, and JetStream then SIGKILLs the whole process.
      await asyncio.get_running_loop().run_in_executor(None, driver.stop)

  return asyncio.run(everything())


def test_adapter_is_a_jetstream_engine(make_engine):
  engine = make_engine(temperature=0.0, max_new_tokens=NEW_TOKENS)
  js = JetStreamEngine(engine, bos_id=BOS)
  assert isinstance(js, engine_api.Engine)
  assert js.max_concurrent_decodes == engine.max_concurrent_decodes
  assert js.build_tokenizer(js.get_tokenizer()).stop_tokens == set(engine.config.eos_ids)
  with pytest.raises(ValueError, match="bos_id=999"):
    JetStreamEngine(engine, bos_id=999)


def test_orchestrator_greedy_tokens_match_our_driver(make_engine, monkeypatch):
  # JetStream 0.2.2's orchestrator calls jax.tree_map, which JAX has removed; alias it for its code.
  if not hasattr(jax, "tree_map"):
    monkeypatch.setattr(jax, "tree_map", jax.tree.map, raising=False)
  engine = make_engine(temperature=0.0, max_new_tokens=NEW_TOKENS)
  params = engine.load_params()
  prompts = random_prompts(7, lengths=(3, 9, 15, 1, 6, 12, 4), seed=3)  # 7 prompts > 4 slots

  got = _jetstream_decode(JetStreamEngine(engine, bos_id=BOS), params, prompts)

  # JetStream prepends its BOS to token-id prompts; give our driver the same ids.
  out = []
  requests = [PromptRequest(prompt_id=i, token_ids=np.concatenate([[BOS], p]).astype(np.int32))
              for i, p in enumerate(prompts)]
  RolloutDriver(engine, params, source=iter(requests), sink=out.append).run(max_wall_s=300)
  want = {g.prompt_id: g.completions[0].token_ids.tolist() for g in out}
  for i, tokens in enumerate(got):
    assert len(tokens) == NEW_TOKENS, (i, tokens)
    assert tokens == want[i], f"prompt {i}: JetStream {tokens} vs driver {want[i]}"
