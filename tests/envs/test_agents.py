"""Agents served over HTTP: the real server (uvicorn), real clients (openai, httpx), the tiny model."""

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from tunixlike import config as config_lib
from tunixlike.agents.driver import AgentConfig, AgentDriver
from tunixlike.data.tokenizer import Tokenizer
from tunixlike.sampler import PromptRequest
from tunixlike.sampler.noise import _KEY_BLOCK, _sample_keys

RUN = config_lib.Config()  # the agent keys (rl.*) at their defaults
G = 2


def _requests(tokenizer, n):
  return [PromptRequest(prompt_id=i, token_ids=np.asarray(tokenizer.encode(f"2+{i}="), np.int32),
                        columns={"answer": str(2 + i)}, prompt_text=f"2+{i}=") for i in range(n)]


def _run(engine, tokenizer, agent, *, n=1, params=None, **ac):
  """Runs `agent` (given the driver too) on n prompts x G episodes; returns (driver, groups, episodes)."""
  out, holder, episodes = [], {}, {}

  def run_episode(base_url, api_key, episode_id, row):
    episodes[episode_id] = holder["driver"].episode(episode_id)
    return agent(base_url, api_key, episode_id, row)

  driver = AgentDriver(engine, engine.load_params() if params is None else params, source=iter(_requests(tokenizer, n)),
                       sink=out.append, agent=run_episode, tokenizer=tokenizer,
                       agent_config=AgentConfig.from_config(RUN, **{"max_turns": 3, "workers": 8, **ac}))
  holder["driver"] = driver
  try:
    driver.run(max_wall_s=120)
  finally:
    driver.stop(timeout_s=60)
  return driver, out, episodes


def _client(base_url, api_key, episode_id):
  return openai.OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Episode-Id": episode_id},
                       max_retries=0, timeout=60)


def _auth(api_key, episode_id=None):
  return {"Authorization": f"Bearer {api_key}", **({"X-Episode-Id": episode_id} if episode_id else {})}


def _episode(episodes, group_seq, index):
  """The episode `index` of the group admitted `group_seq`-th (ids are random)."""
  return next(e for e in episodes.values() if e.group.seq == group_seq and e.index == index)


def _direct_decode(engine, params, prompt_ids, key, max_new):
  """The same turn decoded with the Engine API alone: one slot, the same noise key."""
  state = engine.insert(engine.prefill(params, np.asarray(prompt_ids, np.int32)), engine.init_decode_state(), 0,
                        key=key, max_new_tokens=max_new)
  tokens, logprobs = [], []
  while True:
    state, result = engine.generate(params, state)
    host = jax.device_get(result)
    for k in np.flatnonzero(host.valid_ks[:, 0]):
      tokens.append(int(host.tokens_ks[k, 0]))
      logprobs.append(float(host.logprobs_ks[k, 0]))
    if host.done_s[0]:
      return tokens, logprobs


def _turns(chain):
  """(prompt ids, sampled ids, their logprobs) of each policy turn recorded in a chain."""
  mask = np.asarray(chain.loss_mask)
  out, i = [], 0
  while i < len(mask):
    if mask[i]:
      j = i
      while j < len(mask) and mask[j]:
        j += 1
      out.append((chain.prompt_ids + chain.tokens[:i], chain.tokens[i:j], chain.logprobs[i:j]))
      i = j
    else:
      i += 1
  return out


def _content(tokenizer, tokens):
  """What the server returns for a turn's tokens: all of them written out, but a final EOS."""
  return tokenizer.decode(tokens[:-1] if tokens[-1:] == [2] else tokens, skip_special_tokens=False)


def _two_turn_agent(stream, log):
  """Logs each turn's text (and logprobs) under (prompt id, episode index in its group, ...)."""
  def agent(base_url, api_key, episode_id, row):
    client = _client(base_url, api_key, episode_id)
    name = (row["prompt_id"], int(episode_id.rsplit("-", 1)[1]))
    messages = [{"role": "user", "content": row["prompt_text"]}]
    for turn in range(2):
      kw = dict(model="policy", messages=messages, max_tokens=6)
      if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
      else:
        reply = client.chat.completions.create(logprobs=True, **kw)
        text = reply.choices[0].message.content
        log[(*name, turn)] = [x.logprob for x in reply.choices[0].logprobs.content]
      log[(*name, "text", turn)] = text
      messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": "=4\n"}]
    return 1.0
  return agent


def test_recorded_turns_equal_a_direct_engine_decode_and_the_group_is_the_chain(make_engine, tokenizer):
  engine = make_engine(group_size=G)
  params = engine.load_params()
  log = {}
  driver, groups, episodes = _run(engine, tokenizer, _two_turn_agent(False, log), params=params)
  assert len(groups) == 1 and driver.stats.episodes == G and driver.stats.requests == 2 * G
  keys = np.asarray(_sample_keys(jax.random.PRNGKey(engine.config.seed), 0, G, _KEY_BLOCK, 3))[0]
  group = groups[0]
  np.testing.assert_array_equal(group.rewards, [1.0] * G)
  for i, completion in enumerate(group.completions):
    ep = _episode(episodes, 0, i)
    turns = [t for chain in ep.recording.chains for t in _turns(chain)]
    assert len(turns) == 2
    for number, (prompt, tokens, logprobs) in enumerate(turns):
      want_tokens, want_logprobs = _direct_decode(engine, params, prompt, keys[i, number], 6)
      assert tokens == want_tokens
      np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
      np.testing.assert_allclose(log[(0, i, number)], logprobs, atol=1e-6)  # what the client was told
      assert log[(0, i, "text", number)] == _content(tokenizer, tokens)
    # The group trains on the episode's last chain: the shared prompt, then everything after it.
    chain = ep.recording.chains[-1]
    assert list(group.prompt_token_ids) + list(completion.token_ids) == chain.ids
    head = len(chain.prompt_ids) - len(group.prompt_token_ids)
    assert list(completion.loss_mask) == [0] * head + chain.loss_mask
    assert completion.logprobs[completion.loss_mask == 1].tolist() == pytest.approx(
        [x for x, m in zip(chain.logprobs, chain.loss_mask) if m])
    # The tool result entered the chain as tokens the model did not write, tokenized once.
    if len(ep.recording.chains) == 1:
      assert tokenizer.decode(chain.tokens, skip_special_tokens=False).count("=4\n") == 1
  assert driver.stats.history_edits == sum(len(e.recording.chains) - 1 for e in episodes.values())


def test_streamed_and_non_streamed_answers_are_identical(make_engine, tokenizer):
  engine = make_engine(group_size=G)
  params = engine.load_params()
  plain, streamed = {}, {}
  _, groups_plain, _ = _run(engine, tokenizer, _two_turn_agent(False, plain), n=2, params=params)
  _, groups_streamed, _ = _run(engine, tokenizer, _two_turn_agent(True, streamed), n=2, params=params)
  texts = lambda log: {k: v for k, v in log.items() if "text" in k}
  assert texts(plain) == texts(streamed) and len(texts(plain)) == 2 * 2 * G
  by_id = lambda groups: {g.prompt_id: g for g in groups}
  for pid, g in by_id(groups_plain).items():
    h = by_id(groups_streamed)[pid]
    np.testing.assert_array_equal(g.prompt_token_ids, h.prompt_token_ids)
    for a, b in zip(g.completions, h.completions):
      np.testing.assert_array_equal(a.token_ids, b.token_ids)
      np.testing.assert_array_equal(a.logprobs, b.logprobs)
      np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_an_agent_that_edits_its_history_splits_its_episode_and_is_counted(make_engine, tokenizer):
  engine = make_engine(group_size=G)

  def agent(base_url, api_key, episode_id, row):
    client = _client(base_url, api_key, episode_id)
    first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2="}],
                                           max_tokens=4)
    # The next request rewrites the question: it does not extend what the model saw.
    client.chat.completions.create(model="policy", max_tokens=4, messages=[
        {"role": "user", "content": "3+3="}, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "ok"}])
    return 0.5

  driver, groups, episodes = _run(engine, tokenizer, agent)
  assert driver.stats.history_edits == G
  assert groups[0].reward_metrics["agent/history_edits"] == 1.0
  for ep, completion in zip((_episode(episodes, 0, i) for i in range(G)), groups[0].completions):
    assert len(ep.recording.chains) == 2
    assert tokenizer.decode(ep.recording.chains[1].prompt_ids).startswith("3+3=")
    # Trained: the second chain only, its prompt (after the shared part) masked out.
    assert list(groups[0].prompt_token_ids) + list(completion.token_ids) == ep.recording.chains[1].ids


def test_special_tokens_sampled_mid_answer_are_returned_so_the_history_extends_its_chain(make_engine, tokenizer):
  """The random model samples <pad> / <bos> / <unk> mid-answer: the content carries them written out, the
  agent sends the content back, and its next request extends the chain instead of splitting it."""
  engine = make_engine(group_size=G)
  log = {}
  driver, groups, episodes = _run(engine, tokenizer, _two_turn_agent(False, log), n=4)
  sampled = [t for ep in episodes.values() for chain in ep.recording.chains for _, t, _ in _turns(chain)]
  specials = {0, 1, 3}  # the char tokenizer's <pad>, <bos>, <unk>: not EOS (2)
  mid = [t for t in sampled if specials & set(t[:-1])]
  assert mid, "the seed no longer samples a special token mid-answer: pick another"
  texts = {k: v for k, v in log.items() if "text" in k}
  assert any(name in text for text in texts.values() for name in ("<pad>", "<bos>", "<unk>"))
  assert driver.stats.history_edits == 0 and driver.stats.requests == 2 * 4 * G
  assert all(len(ep.recording.chains) == 1 for ep in episodes.values())
  assert all(g.reward_metrics["agent/history_edits"] == 0.0 for g in groups)


def test_an_episode_whose_conversation_shares_no_first_token_with_its_group_is_counted_not_trained(make_engine,
                                                                                                  tokenizer):
  # A chat template without a leading BOS: conversations that open differently share no first token.
  templated = Tokenizer(tokenizer.hf, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>", unk_token="<unk>",
                        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
  engine = make_engine(group_size=G)

  def agent(base_url, api_key, episode_id, row):
    question = "2+2=" if episode_id.endswith("-0") else "9+9="  # the second episode asks something else
    _client(base_url, api_key, episode_id).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": question}], max_tokens=4)
    return 1.0

  driver, groups, episodes = _run(engine, templated, agent)
  (group,) = groups
  assert group.reward_metrics["agent/prompt_mismatch"] == 0.5  # a mean over the group's 2 episodes
  assert templated.decode(group.prompt_token_ids) == "2+2="  # the first episode's prompt is the group's
  kept, dropped = group.completions
  assert kept.loss_mask.sum() > 0
  assert dropped.finish_reason == "aborted" and len(dropped.token_ids) == 0  # not trained
  assert driver.stats.history_edits == 0


def test_bad_requests_get_clear_4xx_answers_and_the_run_goes_on(make_engine, tokenizer, capfd, caplog):
  engine = make_engine(group_size=G)
  answers = {}
  limit = 4096

  def agent(base_url, api_key, episode_id, row):
    http = httpx.Client(base_url=base_url, headers=_auth(api_key, episode_id), timeout=60)
    ok = {"model": "policy", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 4}
    tries = {
        "malformed_json": http.post("/chat/completions", content=b"{not json",
                                    headers={"content-type": "application/json"}),
        "unknown_model": http.post("/chat/completions", json={**ok, "model": "gpt-9"}),
        "too_long": http.post("/chat/completions", json={**ok, "messages": [{"role": "user", "content": "1" * 100}]}),
        "unknown_episode": http.post("/chat/completions", json=ok, headers={"X-Episode-Id": "nope"}),
        "no_episode": httpx.post(f"{base_url}/chat/completions", json=ok, headers=_auth(api_key)),
        "bad_role": http.post("/chat/completions", json={**ok, "messages": [{"role": "robot", "content": "x"}]}),
        "n_2": http.post("/chat/completions", json={**ok, "n": 2}),
        "clamped": http.post("/chat/completions", json={**ok, "temperature": 0.3, "max_tokens": 999}),
        "completion": http.post("/completions", json={"model": "policy", "prompt": "2+2=", "max_tokens": 3}),
        "reward": http.post(f"/episodes/{episode_id}/reward", json={"reward": 1.0}),
        "reward_again": http.post(f"/episodes/{episode_id}/reward", json={"reward": 1.0}),
        "reward_unknown": http.post("/episodes/nope/reward", json={"reward": 1.0}),
        "models": http.get("/models"),
        "no_key": httpx.post(f"{base_url}/chat/completions", json=ok, headers={"X-Episode-Id": episode_id}),
        "wrong_key": http.post("/chat/completions", json=ok, headers={"Authorization": "Bearer " + "x" * 43}),
        "too_large": http.post("/chat/completions", json={**ok, "user": "1" * limit}),
        "too_large_chunked": http.post("/chat/completions", content=iter([b"{" + b" " * limit, b"}"]),
                                       headers={"content-type": "application/json"}),
    }
    answers[episode_id] = {k: (r.status_code, r.json(), r.headers) for k, r in tries.items()}
    # A client that goes away while sending its body: one counted line, no traceback.
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as s:
      s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":".encode())
    time.sleep(0.5)  # the server notices before the group ends

  driver, groups, _ = _run(engine, tokenizer, agent, max_body_bytes=limit)
  assert len(groups) == 1  # the run went on
  for got in answers.values():
    status = {k: v[0] for k, v in got.items()}
    assert status == {"malformed_json": 400, "unknown_model": 404, "too_long": 400, "unknown_episode": 404,
                      "no_episode": 400, "bad_role": 400, "n_2": 400, "clamped": 200, "completion": 200,
                      "reward": 200, "reward_again": 409, "reward_unknown": 404, "models": 200, "no_key": 401,
                      "wrong_key": 401, "too_large": 413, "too_large_chunked": 413}
    message = lambda k: got[k][1]["error"]["message"]
    assert "not valid JSON" in message("malformed_json")
    assert "'gpt-9' does not exist" in message("unknown_model") and got["unknown_model"][1]["error"]["code"] == \
        "model_not_found"
    assert "max_prefill_length=64" in message("too_long")
    assert "unknown episode id 'nope'" in message("unknown_episode")
    assert "X-Episode-Id" in message("no_episode")
    assert "already has a reward" in message("reward_again")
    assert got["clamped"][2]["x-tunixlike-clamped"] == "temperature,max_tokens"
    assert got["clamped"][1]["usage"]["completion_tokens"] <= engine.config.max_new_tokens
    assert got["models"][1]["data"][0]["id"] == "policy"
    assert "API key" in message("no_key") and got["wrong_key"][1]["error"]["code"] == "invalid_api_key"
    assert all(f"rl.agent_max_body_bytes={limit}" in message(k) for k in ("too_large", "too_large_chunked"))
  assert driver.stats.refused_requests == 11 * G and driver.stats.clamped_requests == G
  assert driver.stats.unauthorized_requests == 2 * G and driver.stats.dropped_requests == G
  logged = capfd.readouterr().err + caplog.text
  assert "Exception in ASGI application" not in logged and "ClientDisconnect" not in logged
  assert f"a client disconnected before its request was read ({G} so far)" in caplog.text
  np.testing.assert_array_equal(groups[0].rewards, [1.0] * G)  # the posted reward, once
  assert groups[0].reward_metrics["agent/clamped_requests"] == 1.0


def test_a_client_gone_mid_stream_frees_its_slot_and_aborts_its_episode(make_engine, tokenizer):
  engine = make_engine(group_size=G, max_new_tokens=64, steps_per_call=1, eos_ids=())
  late = {}

  def agent(base_url, api_key, episode_id, row):
    body = {"model": "policy", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 64,
            "stream": episode_id.endswith("-0")}
    if not body["stream"]:
      httpx.post(f"{base_url}/chat/completions", json=body, headers=_auth(api_key, episode_id), timeout=60)
      time.sleep(4.0)  # keeps the group (and so the aborted episode's id) alive for the late request
      return 1.0
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body, headers=_auth(api_key, episode_id),
                      timeout=60) as response:
      for line in response.iter_lines():
        if line.startswith("data:") and json.loads(line[5:])["choices"][0]["delta"].get("content"):
          break  # gone after the first text: the connection closes here
    time.sleep(1.0)  # the episode is aborted meanwhile; a request now is refused
    r = httpx.post(f"{base_url}/chat/completions", json={**body, "stream": False},
                   headers=_auth(api_key, episode_id), timeout=60)
    late["answer"] = (episode_id, r.status_code, r.json()["error"]["message"])
    return 1.0

  driver, groups, episodes = _run(engine, tokenizer, agent)
  assert driver.stats.disconnects == 1 and driver.stats.aborted_episodes == 1 and driver.stats.agent_errors == 0
  episode_id, status, message = late["answer"]
  assert (status, message) == (409, f"episode {episode_id!r} is over (aborted)")
  first = groups[0].completions[0]
  assert first.finish_reason == "aborted" and first.loss_mask.sum() == 0  # no turn finished in it
  assert groups[0].completions[1].loss_mask.sum() == 64
  assert groups[0].reward_metrics["agent/disconnects"] == 0.5
  assert driver.is_idle and all(s is None for s in driver.slots)


def test_an_agent_that_raises_or_hangs_costs_its_episode_not_the_run(make_engine, tokenizer):
  engine = make_engine(group_size=G)

  def agent(base_url, api_key, episode_id, row):
    _client(base_url, api_key, episode_id).completions.create(model="policy", prompt=row["prompt_text"], max_tokens=3)
    if episode_id.endswith("-0"):
      raise RuntimeError("the agent's own bug")
    time.sleep(30)  # past episode_timeout_s

  driver, groups, _ = _run(engine, tokenizer, agent, n=2, episode_timeout_s=2.0)
  assert len(groups) == 2
  assert driver.stats.agent_errors == 2 and driver.stats.timeouts == 2 and driver.stats.aborted_episodes == 4
  for g in groups:
    assert [c.finish_reason for c in g.completions] == ["aborted", "aborted"]
    assert g.rewards is None  # no agent reward: the run's reward functions score the recorded text
    assert g.reward_metrics["agent/errors"] == 0.5 and g.reward_metrics["agent/timeouts"] == 0.5


def test_a_client_gone_before_its_answer_frees_its_slot_and_aborts_its_episode(make_engine, tokenizer):
  engine = make_engine(group_size=G, max_new_tokens=64, steps_per_call=1, eos_ids=())

  def agent(base_url, api_key, episode_id, row):
    body = {"model": "policy", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 64}
    try:  # episode 0 gives up long before 64 tokens are decoded, one at a time
      httpx.post(f"{base_url}/chat/completions", json=body, headers=_auth(api_key, episode_id),
                 timeout=0.03 if episode_id.endswith("-0") else 60)
    except httpx.ReadTimeout:
      pass
    time.sleep(1.0)  # the group stays open while the server notices
    return 1.0

  driver, groups, episodes = _run(engine, tokenizer, agent)
  assert driver.stats.disconnects == 1 and driver.stats.aborted_episodes == 1
  assert groups[0].completions[0].finish_reason == "aborted"
  assert groups[0].completions[1].loss_mask.sum() == 64
  assert driver.is_idle and all(s is None for s in driver.slots)


# Another local process that knows the server's address: blind reward posts and chat turns, to the
# episode ids the server used to give out ("{group}-{i}") and, without the key, to the live ones.
_INJECTOR = r"""
import json, sys, httpx
base_url, key, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
headers = {"Authorization": f"Bearer {key}"} if key else {}
chat = {"model": "policy", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 4}
status = []
with httpx.Client(base_url=base_url, headers=headers, timeout=30) as http:
  for episode_id in ids:
    status.append(http.post(f"/episodes/{episode_id}/reward", json={"reward": 1.0}).status_code)
    status.append(http.post("/chat/completions", json=chat, headers={"X-Episode-Id": episode_id}).status_code)
    status.append(http.post("/completions", json={**chat, "prompt": "2+2=", "user": episode_id}).status_code)
print(json.dumps(status))
"""


def test_another_process_cannot_post_rewards_or_turns_with_or_without_the_key(make_engine, tokenizer):
  engine = make_engine(group_size=G)
  holder, attacked, seen = {}, threading.Event(), {}
  guessed = [f"{s}-{i}" for s in range(8) for i in range(G)]

  def inject(base_url, key, ids):
    out = subprocess.run([sys.executable, "-c", _INJECTOR, base_url, key, json.dumps(ids)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)

  def agent(base_url, api_key, episode_id, row):
    client = _client(base_url, api_key, episode_id)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2="}], max_tokens=4)
    if episode_id.endswith("-0"):  # while both episodes are live
      live = [e.id for e in holder["driver"].episode(episode_id).group.episodes]
      seen["no key"] = inject(base_url, "", live + guessed)
      seen["wrong key"] = inject(base_url, "not-" + api_key, live)
      seen["the key, guessed ids"] = inject(base_url, api_key, guessed + [f"{'0' * 32}-0"])
      attacked.set()
    assert attacked.wait(300)
    httpx.post(f"{base_url}/episodes/{episode_id}/reward", json={"reward": 0.25},
               headers=_auth(api_key)).raise_for_status()

  out = []
  driver = AgentDriver(engine, engine.load_params(), source=iter(_requests(tokenizer, 1)), sink=out.append,
                       agent=agent, tokenizer=tokenizer,
                       agent_config=AgentConfig.from_config(RUN, max_turns=3, workers=8))
  holder["driver"] = driver
  try:
    driver.run(max_wall_s=300)
  finally:
    driver.stop(timeout_s=60)
  assert set(seen["no key"]) == {401} and set(seen["wrong key"]) == {401}
  assert set(seen["the key, guessed ids"]) == {404}
  assert driver.stats.unauthorized_requests == len(seen["no key"]) + len(seen["wrong key"])
  # Nothing reached training: the group holds the agents' own turns and rewards only.
  assert len(out) == 1 and driver.stats.requests == G
  np.testing.assert_array_equal(out[0].rewards, [0.25] * G)
  assert all(c.loss_mask.sum() > 0 for c in out[0].completions)
  assert driver.stats.episodes == G and driver.stats.aborted_episodes == 0


def test_json_no_parser_can_hold_is_a_400_in_openai_format_with_one_counted_line(make_engine, tokenizer, capfd,
                                                                                caplog):
  engine = make_engine(group_size=G)
  answers = {}
  bodies = {  # each once parsed into a 500 and a traceback in the training log
      "5000_digits": b'{"model": "policy", "max_tokens": ' + b"7" * 5000 + b"}",
      "nested": b"[" * 100_000,
      "nan": b'{"model": "policy", "temperature": NaN}',
      "float_1e400": b'{"model": "policy", "temperature": 1e400}',
  }

  def agent(base_url, api_key, episode_id, row):
    http = httpx.Client(base_url=base_url, headers={**_auth(api_key, episode_id), "content-type": "application/json"},
                        timeout=60)
    got = {k: http.post("/chat/completions", content=b) for k, b in bodies.items()}
    # 1e400 written as an integer: past float64, where the reward becomes a float
    got["reward_int_1e400"] = http.post(f"/episodes/{episode_id}/reward", content=b'{"reward": 1' + b"0" * 400 + b"}")
    answers[episode_id] = {k: (r.status_code, r.json()) for k, r in got.items()}
    _client(base_url, api_key, episode_id).chat.completions.create(  # and the server goes on
        model="policy", messages=[{"role": "user", "content": "2+2="}], max_tokens=4)
    return 1.0

  driver, groups, _ = _run(engine, tokenizer, agent)
  assert len(groups) == 1
  for got in answers.values():
    assert {k: status for k, (status, _) in got.items()} == dict.fromkeys([*bodies, "reward_int_1e400"], 400)
    for _, body in got.values():
      assert body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
      assert "not valid JSON" in body["error"]["message"]
    assert "(5000 digits) is past float64's range" in got["5000_digits"][1]["error"]["message"]
    assert "deeper than the parser recurses" in got["nested"][1]["error"]["message"]
    assert "(401 digits)" in got["reward_int_1e400"][1]["error"]["message"]
  n = 5 * G
  assert driver.stats.invalid_json == n and driver.stats.refused_requests == n
  lines = [r.getMessage() for r in caplog.records if "not valid JSON" in r.getMessage()]
  assert len(lines) == n and lines[-1].endswith(f"; {n} so far)")
  logged = capfd.readouterr().err + caplog.text
  assert "Traceback" not in logged and "Exception in ASGI application" not in logged
  np.testing.assert_array_equal(groups[0].rewards, [1.0] * G)  # the returned reward: the bad post took nothing


_FLOOD = """
import json, resource, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # not the limit of the test process it inherits
socks = [socket.create_connection((host, port)) for _ in range(n)]
print("open", flush=True)
sys.stdin.readline()
closed = 0
for s in socks:
  s.setblocking(False)
  try:
    closed += s.recv(1) == b""
  except BlockingIOError:
    pass
  except OSError:  # reset: closed by the server
    closed += 1
print(json.dumps(closed), flush=True)
"""


def _open_fds() -> int:
  return len(os.listdir("/proc/self/fd"))


def _wait_for(condition, what: str, timeout_s: float = 120.0):
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, what
    time.sleep(0.05)


@pytest.fixture
def few_file_descriptors():
  """This process limited to what it has open now plus 400: a flood of 1,000 sockets would use them all."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (_open_fds() + 400, hard))
  yield
  resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_flood_of_idle_sockets_is_capped_and_neither_the_agents_nor_the_trainer_run_out(
    make_engine, tokenizer, tmp_path, few_file_descriptors):
  engine = make_engine(group_size=G)
  limit, flood, seen = 64, 1000, {}
  holder, flooded, answered = {}, threading.Event(), []

  def agent(base_url, api_key, episode_id, row):
    if episode_id.endswith("-0"):
      server = holder["driver"].server
      host, port = base_url.split("//")[1].split("/")[0].split(":")
      proc = subprocess.Popen([sys.executable, "-c", _FLOOD, host, port, str(flood)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
      try:
        assert proc.stdout.readline().strip() == "open"
        # every connection past the limit closed one (the oldest without the key) or itself
        _wait_for(lambda: sum(server.connections.counts.values()) >= flood - limit, "the limit never closed the flood")
        seen["open"], seen["fds"] = server.connections.open, _open_fds()
        files = [open(tmp_path / f"f{i}", "w") for i in range(200)]  # the trainer's own files (checkpoints, logs)
        for f in files:
          f.close()
        seen["files"] = len(files)
      finally:
        flooded.set()
      reply = _client(base_url, api_key, episode_id).chat.completions.create(
          model="policy", messages=[{"role": "user", "content": "2+2="}], max_tokens=4)
      answered.append(reply.choices[0].finish_reason)
      proc.stdin.write("\n")
      proc.stdin.flush()
      seen["flood_closed"] = json.loads(proc.stdout.readline())
      proc.wait(60)
    else:
      assert flooded.wait(200)
      reply = _client(base_url, api_key, episode_id).chat.completions.create(
          model="policy", messages=[{"role": "user", "content": "2+2="}], max_tokens=4)
      answered.append(reply.choices[0].finish_reason)
    return 1.0

  out = []
  before = _open_fds()
  driver = AgentDriver(engine, engine.load_params(), source=iter(_requests(tokenizer, 1)), sink=out.append,
                       agent=agent, tokenizer=tokenizer,
                       agent_config=AgentConfig.from_config(RUN, max_turns=3, workers=8, max_connections=limit,
                                                            header_timeout_s=600.0))
  holder["driver"] = driver
  try:
    driver.run(max_wall_s=300)
  finally:
    driver.stop(timeout_s=60)
  assert seen["open"] == limit and seen["files"] == 200
  assert seen["fds"] <= before + limit + 20  # the server's sockets, not the flood's
  assert len(answered) == G and len(out) == 1  # every agent got through the flood, with the key
  assert seen["flood_closed"] >= flood - limit
  assert driver.stats.closed_connections >= flood - limit + 1  # one more for each agent's own connection
  assert driver.stats.aborted_episodes == 0


def test_connections_without_the_key_are_closed_after_the_header_timeout(make_engine, tokenizer):
  engine = make_engine(group_size=G)
  seen = {}

  def agent(base_url, api_key, episode_id, row):
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    silent = socket.create_connection((host, int(port)))
    slow = socket.create_connection((host, int(port)))
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and the rest of its headers never
    big = socket.create_connection((host, int(port)))
    try:  # headers past what a request head holds, without the key: closed as soon as they pass 1 MiB
      big.sendall(b"GET /v1/models HTTP/1.1\r\nX-Junk: " + b"a" * (2 << 20))
    except OSError:
      pass
    wrong = httpx.Client(base_url=base_url, headers={"Authorization": "Bearer wrong"}, timeout=60)
    refused = wrong.get("/models")
    reply = _client(base_url, api_key, episode_id).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "2+2="}], max_tokens=4)
    for s in (silent, slow, big):
      s.settimeout(120)
      try:
        data = s.recv(1)
      except ConnectionResetError:
        data = b""
      s.close()
      seen.setdefault(episode_id, []).append(data)
    seen[episode_id].append((refused.status_code, refused.headers.get("connection"), reply.choices[0].finish_reason))
    return 1.0

  driver, groups, _ = _run(engine, tokenizer, agent, header_timeout_s=0.5)
  assert len(groups) == 1
  for got in seen.values():
    assert got[:3] == [b"", b"", b""]  # closed by the server
    status, connection, finish = got[3]
    assert status == 401 and connection == "close" and finish in ("stop", "length")
  counts = driver.server.connections.counts
  assert counts["header_timeout"] >= 2 * G and counts["oversized"] == G
  assert driver.stats.closed_connections == sum(counts.values())


def test_a_connection_limit_over_half_the_file_descriptors_is_refused_in_one_line(make_engine, tokenizer):
  engine = make_engine(group_size=G)
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  with pytest.raises(ValueError, match=rf"rl.agent_max_connections={soft}: .*half of this process's file "
                     rf"descriptor limit \(ulimit -n = {soft}\)"):
    AgentDriver(engine, engine.load_params(), source=iter([]), sink=lambda g: None, agent=lambda *a: 1.0,
                tokenizer=tokenizer, agent_config=AgentConfig.from_config(RUN, max_connections=soft))
