"""The narrow engine protocol: `Engine` and `PagedEngine` both implement `EngineAPI`, and the driver
(with each of its episode kinds' paths: batched refill, preemption and resume, speculative verify)
calls nothing else of an engine."""

import pytest

from sampler_prompts import random_prompts
from tunixlike.sampler import PromptRequest, RolloutDriver
from tunixlike.sampler.engine_api import EngineAPI

NAMES = {n for n in vars(EngineAPI) if not n.startswith("_")} | set(EngineAPI.__annotations__)
PAGED = dict(kv_layout="paged", kv_block_size=4)


class OnlyTheProtocol:
  """An engine seen through `EngineAPI` alone: any other attribute is an error naming it."""

  def __init__(self, engine):
    self._engine = engine

  def __getattr__(self, name):
    if name not in NAMES:
      raise AttributeError(f"the driver used engine.{name}, which is not in EngineAPI")
    return getattr(self._engine, name)


def _run(engine, params, requests):
  out = []
  driver = RolloutDriver(engine, params, source=iter(requests), sink=out.append)
  driver.run(max_wall_s=300)
  return {g.prompt_id: [c.token_ids.tolist() for c in g.completions] for g in out}, driver.stats


def test_both_engines_implement_the_protocol(make_engine):
  assert {"prefill_many", "insert_many", "generate", "verify", "release", "reserve"} <= NAMES
  for engine in (make_engine(), make_engine(**PAGED)):
    assert isinstance(engine, EngineAPI)
  with pytest.raises(AttributeError, match="engine.load_params, which is not in EngineAPI"):
    OnlyTheProtocol(make_engine()).load_params()


@pytest.mark.parametrize("kw", [
    dict(),  # contiguous, batched refill
    dict(slot_groups=2),  # contiguous, one sample at a time (plan_insert / move)
    dict(**PAGED, kv_cache_bytes=None),  # paged: its pool sized below to preempt
    dict(**PAGED, speculative=True, draft_tokens=4),  # verify / decode_width
], ids=["contiguous", "slot_groups", "paged_preempting", "speculative"])
def test_the_driver_calls_nothing_outside_the_protocol(make_engine, kw):
  kw = dict(kw, temperature=0.0, group_size=2)
  if kw.get("kv_cache_bytes", 0) is None:
    roomy = make_engine(**{k: v for k, v in kw.items() if k != "kv_cache_bytes"})
    kw["kv_cache_bytes"] = 10 * roomy.block_bytes  # 4 slots must take turns: preemption
  engine = make_engine(**kw)
  params = engine.load_params()
  requests = [PromptRequest(prompt_id=i, token_ids=p) for i, p in enumerate(random_prompts(6, seed=2))]
  want, _ = _run(engine, params, requests)
  got, stats = _run(OnlyTheProtocol(engine), params, requests)
  assert got == want and len(got) == 6
  if "kv_cache_bytes" in kw:
    assert stats.preemptions > 0
  if kw.get("speculative"):
    assert stats.verify_calls > 0
