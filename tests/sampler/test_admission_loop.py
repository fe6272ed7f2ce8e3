"""The one admission loop (`sampler.admission.Admission`) on its own: the gates it asks in order,
the start order it gives, the groups it keeps in flight, and the prompts it refuses."""

import dataclasses

import numpy as np
import pytest

from tunixlike.sampler import PromptRequest
from tunixlike.sampler.admission import Admission
from tunixlike.sampler.driver_api import DriverError, DriverStats
from tunixlike.sampler.engine import PromptError


@dataclasses.dataclass
class G:
  seq: int
  request: PromptRequest
  ids: np.ndarray


def _request(i, n=3, **kw):
  return PromptRequest(prompt_id=i, token_ids=np.arange(1, n + 1, dtype=np.int32), **kw)


def _admission(engine, source, asked, *, closed=lambda: False, allow=lambda v: True, first_seq=0):
  def may_start(version):
    asked.append(version)
    return allow(version)
  return Admission(engine, source, stats=DriverStats(), may_start=may_start, closed=closed, first_seq=first_seq)


def test_groups_get_start_orders_and_stay_in_flight_until_done(make_engine):
  asked = []
  adm = _admission(make_engine(), [_request(0), None, _request(1), _request(2)], asked, first_seq=5)
  a = adm.admit(3, G)
  assert (a.seq, a.request.prompt_id) == (5, 0) and asked == [3]
  assert adm.admit(3, G) is None and not adm.exhausted  # None: nothing yet, try later
  b, c = adm.admit(4, G), adm.admit(4, G)
  assert [b.seq, c.seq] == [6, 7] and adm.next_seq == 8
  assert adm.admit(4, G) is None and adm.exhausted
  assert adm.admit(4, G) is None and len(asked) == 5  # exhausted: admission is not even asked
  adm.done(6)
  assert [g.seq for g in adm.groups()] == [5, 7]


def test_a_closed_or_refused_admission_takes_no_prompt(make_engine):
  asked, closed, allowed = [], [True], [False]
  adm = _admission(make_engine(), iter([_request(0), _request(1)]), asked, closed=lambda: closed[0],
                   allow=lambda v: allowed[0])
  assert adm.admit(0, G) is None and asked == []  # a hold or drain swap: the staleness bound is not asked
  closed[0] = False
  assert adm.admit(0, G) is None and asked == [0]  # refused
  allowed[0] = True
  assert adm.admit(0, G).request.prompt_id == 0 and adm.admit(0, G).request.prompt_id == 1


def test_prompts_are_checked_and_truncated(make_engine):
  engine = make_engine(max_prefill_length=16, truncate_long_prompts=True)
  adm = _admission(engine, iter([_request(0, n=20), _request(1, max_new_tokens=99), "text"]), [])
  g = adm.admit(0, G)
  assert g.ids.tolist() == list(range(5, 21)) and adm.stats.truncated_prompts == 1  # the last 16 kept
  with pytest.raises(PromptError, match=r"prompt 1: max_new_tokens=99 outside \[1, sampler.max_new_tokens=12\]"):
    adm.admit(0, G)
  with pytest.raises(TypeError, match="prompt source yielded str, expected PromptRequest"):
    adm.admit(0, G)
  strict = _admission(make_engine(max_prefill_length=16), iter([_request(0, n=20)]), [])
  with pytest.raises(PromptError, match="prompt 0 has 20 tokens > sampler.max_prefill_length=16"):
    strict.admit(0, G)


def test_a_group_taken_back_must_start_before_the_next_one(make_engine):
  adm = _admission(make_engine(), iter([]), [], first_seq=3)
  adm.take_back(G(2, _request(0), None))
  assert [g.seq for g in adm.groups()] == [2]
  with pytest.raises(DriverError, match="resumed group 3 starts after first_seq=3"):
    adm.take_back(G(3, _request(1), None))
