import asyncio
import threading
import time

import pytest

from tunixlike.rewards.envs import EnvRunner, EnvTimeout


def _drain(runner, n, timeout_s=5.0):
  out, deadline = {}, time.monotonic() + timeout_s
  while len(out) < n:
    assert time.monotonic() < deadline, f"only {len(out)} of {n} calls reported"
    for ticket, value, error in runner.poll():
      assert ticket not in out, "a call was reported twice"
      out[ticket] = (value, error)
    time.sleep(0.005)
  return out


def test_results_errors_and_async_functions():
  runner = EnvRunner(num_workers=2, timeout_s=2.0)

  async def coro(x):
    await asyncio.sleep(0.01)
    return x * 3

  def boom():
    raise ValueError("bad env")

  tickets = [runner.submit(lambda: "ok"), runner.submit(boom), runner.submit(coro, 5)]
  out = _drain(runner, 3)
  assert out[tickets[0]] == ("ok", None)
  assert out[tickets[1]][0] is None and isinstance(out[tickets[1]][1], ValueError)
  assert out[tickets[2]] == (15, None)
  assert runner.pending == 0 and runner.poll() == []
  runner.close()


def test_submit_and_poll_never_block_and_calls_run_in_parallel():
  """Four calls meet at a barrier, which only opens while all four run at once, and then hold on
  until released: submit and poll returned while every call was still running."""
  runner = EnvRunner(num_workers=4, timeout_s=30.0)
  together, release = threading.Barrier(4, timeout=10), threading.Event()

  def call(i):
    together.wait()  # a BrokenBarrierError (reported as the call's error) if the calls ran one by one
    release.wait(10)
    return i

  tickets = [runner.submit(call, i) for i in range(4)]
  assert runner.poll() == [] and runner.pending == 4
  release.set()
  out = _drain(runner, len(tickets), timeout_s=20)
  assert [out[t] for t in tickets] == [(i, None) for i in range(4)]
  runner.close()


def test_timeout_is_reported_once_and_a_stuck_worker_is_replaced():
  runner = EnvRunner(num_workers=1, timeout_s=0.2)
  release = threading.Event()
  stuck = runner.submit(release.wait, 10)
  time.sleep(0.05)  # let the only worker pick up the stuck call first
  quick = runner.submit(lambda: 42)
  out = _drain(runner, 2)
  assert isinstance(out[stuck][1], EnvTimeout) and "0.2 s" in str(out[stuck][1])
  assert out[quick] == (42, None)  # ran on the replacement worker despite the stuck one
  assert runner.timeouts == 1
  release.set()  # the abandoned call now returns: its late result is dropped, not reported
  time.sleep(0.1)
  assert runner.poll() == []
  runner.close()


@pytest.mark.parametrize("kw", [dict(num_workers=0), dict(timeout_s=0), dict(num_workers=1.5)])
def test_bad_settings(kw):
  with pytest.raises(ValueError, match="EnvRunner"):
    EnvRunner(**{"timeout_s": 30.0, **kw})
