"""Our Engine behind JetStream's `engine_api.Engine`, so JetStream's orchestrator can serve it.

Optional: needs the `tunixlike[jetstream]` extra (google-jetstream, which pulls TensorFlow through
seqio). Nothing in the core imports this module; importing it without JetStream raises an
ImportError that says which extra to install.

  from tunixlike.sampler.jetstream_adapter import JetStreamEngine
  js = JetStreamEngine(engine)                    # engine: tunixlike.sampler.Engine
  driver = orchestrator.Driver(prefill_engines=[js], generate_engines=[js],
                               prefill_params=[p], generate_params=[p], interleaved_mode=True)

Mapping onto JetStream's contract:
  * `generate` returns the `steps_per_call` tokens of each slot as JetStream "speculations"
    (ResultTokens columns: K tokens | K valid flags | 1 length). A slot that has finished (EOS or
    its length limit, applied on device step by step) reports invalid tokens, which JetStream
    reads as "complete" and frees the slot.
  * `length` is the number of tokens the slot had generated *before* this call: JetStream cuts at
    `length > max_tokens` per call, so counting the call's own tokens would drop up to K-1 valid
    tokens. Exact per-token limits come from the engine (`sampler.max_new_tokens`).
  * JetStream does not emit a stop token (it treats it as the end); our RolloutDriver keeps it.
  * Prompts arrive padded by JetStream (with its BOS prepended); the adapter's tokenizer works on
    token ids only (client-side tokenization), decoding text only if given a `detokenize` function.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:
  from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
except ImportError as e:  # the optional extra is missing
  raise ImportError("tunixlike.sampler.jetstream_adapter needs JetStream: "
                    "pip install 'tunixlike[jetstream]' (google-jetstream)") from e

from tunixlike.sampler.engine import DecodeState, Engine, Prefix


class IdTokenizer(tokenizer_api.Tokenizer):
  """JetStream tokenizer for token-id clients: stop tokens = the engine's EOS ids."""

  def __init__(self, *, eos_ids: Sequence[int], bos_id: int, pad_id: int = 0,
               detokenize: Callable[[Sequence[int]], str] | None = None):
    self._eos, self._bos, self._pad, self._detokenize = tuple(eos_ids), int(bos_id), int(pad_id), detokenize

  def encode(self, s: str, **kwargs):
    raise NotImplementedError("IdTokenizer takes token ids (DecodeRequest.token_content), not text")

  def decode(self, token_ids: list[int], **kwargs) -> str:
    return self._detokenize(token_ids) if self._detokenize else " ".join(map(str, token_ids))

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._eos[0] if self._eos else -1

  @property
  def bos_id(self) -> int:
    return self._bos

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._eos)


@jax.jit
def _result_columns(tokens_ks, valid_ks, num_generated_s):
  """[K,S] tokens, [K,S] valid, [S] count after the call -> int32 [S, 2K+1] (JetStream's layout).

  The length column is the count before the call (see the module docstring).
  """
  valid_ks = valid_ks.astype(jnp.int32)
  lengths_s = num_generated_s - valid_ks.sum(axis=0)
  return jnp.concatenate([tokens_ks.T, valid_ks.T, lengths_s[:, None]], axis=1)


class JetStreamEngine(engine_api.Engine):
  """A `jetstream.engine.engine_api.Engine` over a tunixlike `Engine` (same params, same slots)."""

  def __init__(self, engine: Engine, *, bos_id: int = 0, pad_id: int = 0,
               detokenize: Callable[[Sequence[int]], str] | None = None):
    if not isinstance(engine, Engine):
      raise TypeError(f"JetStreamEngine wraps a tunixlike.sampler.Engine, got {type(engine).__name__}")
    for name, value in (("bos_id", bos_id), ("pad_id", pad_id)):
      if not 0 <= value < engine.vocab_size:
        raise ValueError(f"JetStreamEngine: {name}={value} outside the vocabulary [0, {engine.vocab_size})")
    self.engine = engine
    self._tokenizer = IdTokenizer(eos_ids=engine.config.eos_ids, bos_id=bos_id, pad_id=pad_id,
                                  detokenize=detokenize)
    # Slots inserted since the last generate: a stale "done" flag must not retire them (see generate).
    self._fresh: set[int] = set()
    self._last_done = None

  # ---------------------------------------------------------------- engine_api.Engine

  def load_params(self, *args, **kwargs):
    return self.engine.load_params(*args, **kwargs)

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    self._fresh, self._last_done = set(), None
    return self.engine.init_decode_state(*args, **kwargs)

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int) -> Prefix:
    if existing_prefix is not None:
      raise NotImplementedError("JetStreamEngine.prefill: existing_prefix (multi-turn prefix reuse) "
                                "is not supported")
    return self.engine.prefill(params, np.asarray(padded_tokens), int(true_length))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    self._fresh.add(int(slot))
    return self.engine.insert(prefix, decode_state, int(slot))

  def generate(self, params, decode_state: DecodeState):
    # The engine narrows its attention window to the live slots; that host mirror is updated from
    # the previous call's done flags, read now (that call has finished by the time this one is
    # issued), never from slots inserted since.
    if self._last_done is not None:
      done = np.asarray(self._last_done).copy()
      done[list(self._fresh)] = False
      decode_state = self.engine.mark_finished(decode_state, done)
    self._fresh = set()
    decode_state, result = self.engine.generate(params, decode_state)
    self._last_done = result.done_s
    k = result.tokens_ks.shape[0]
    data = _result_columns(result.tokens_ks, result.valid_ks, decode_state.arrays["num_generated"])
    return decode_state, engine_api.ResultTokens(data=data, tokens_idx=(0, k), valid_idx=(k, 2 * k),
                                                 length_idx=(2 * k, 2 * k + 1), samples_per_slot=1)

  def get_prefix_destination_sharding(self):
    return jax.sharding.NamedSharding(self.engine.mesh, jax.sharding.PartitionSpec())

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="tunixlike-token-ids",
                                             extra_ids=0)

  def build_tokenizer(self, metadata) -> tokenizer_api.Tokenizer:
    return self._tokenizer

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine.max_concurrent_decodes

  @property
  def samples_per_slot(self) -> int:
    return self.engine.samples_per_slot

  @property
  def max_prefill_length(self) -> int:
    return self.engine.max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self.engine.mesh

  @property
  def colocated_cpus(self):
    return None
