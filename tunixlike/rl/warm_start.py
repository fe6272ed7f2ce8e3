"""Supervised warm start: a few steps of next-token training on (prompt, answer) pairs before RL.

RL from a random model never sees a reward; a short warm start gives it a few percent of correct
samples to learn from. It stops as soon as held-out accuracy reaches a target: a warm start that
memorises stops exploring and RL then collapses (measured on the addition task).
Accuracy here is teacher-forced exact match: every answer token (and the stop token) is the argmax
given the gold prefix, which is exactly "greedy decoding reproduces the answer".
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tunixlike import mesh as mesh_lib
from tunixlike.config import WarmStartSection
from tunixlike.data.tokenizer import Tokenizer
from tunixlike.models import sharding as sharding_lib


def encode_pairs(records: Sequence[dict], tokenizer: Tokenizer, length: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [N, L], answer mask [N, L]) for prompt + answer + eos, right padded with pad_id.

  mask[t] = 1 where token t+1 is an answer (or eos) token, i.e. where the model must predict it.
  """
  tokens = np.full((len(records), length), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(records), length), np.float32)
  for i, r in enumerate(records):
    prompt = tokenizer.encode(r["prompt"])
    answer = tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_id]
    seq = prompt + answer
    if len(seq) > length:
      raise ValueError(f"warm start: record {r.get('id')} has {len(seq)} tokens > {length}")
    tokens[i, :len(seq)] = seq
    mask[i, len(prompt) - 1:len(seq) - 1] = 1.0
  return tokens, mask


def _answer_logits(model, tokens_bt):
  return model(tokens_bt[:, :-1])


@nnx.jit
def _train_step(model, optimizer, tokens_bt, mask_bt):
  def loss_fn(model):
    logits = _answer_logits(model, tokens_bt)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_bt[:, 1:])
    m = mask_bt[:, :-1]
    return (nll * m).sum() / jnp.maximum(m.sum(), 1.0)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def _exact_match(model, tokens_bt, mask_bt):
  pred = jnp.argmax(_answer_logits(model, tokens_bt), axis=-1)
  m = mask_bt[:, :-1] > 0
  return jnp.all(jnp.where(m, pred == tokens_bt[:, 1:], True), axis=-1)


def teacher_forced_accuracy(model, tokens: np.ndarray, mask: np.ndarray, sharding=None) -> float:
  """Exact-match rate over the rows. Sharded, the rows are padded to a multiple of the devices with
  rows that count for nothing, so a held-out set of any size fits any mesh."""
  if sharding is None:
    return float(jnp.mean(_exact_match(model, jnp.asarray(tokens), jnp.asarray(mask))))
  n = len(tokens)
  pad = -n % len(sharding.device_set)
  real = np.arange(n + pad) < n
  tokens, mask = (np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) for x in (tokens, mask))
  put = lambda x: jax.device_put(x, sharding)
  return float(jnp.sum(_exact_match(model, put(tokens), put(mask)) & put(real)) / n)


def make_optimizer(model, cfg: WarmStartSection) -> nnx.Optimizer:
  return nnx.Optimizer(model, optax.adam(cfg.learning_rate), wrt=nnx.Param)


def warm_start(model, records: Iterator[dict], held_out: Sequence[dict], tokenizer: Tokenizer,
               cfg: WarmStartSection, *, mesh: jax.sharding.Mesh | None = None, length: int = 32,
               log: Callable[[str], None] = print, should_stop: Callable[[], bool] = lambda: False,
               on_step: Callable[[int], None] = lambda step: None, optimizer: nnx.Optimizer | None = None,
               start_step: int = 0) -> dict[str, float]:
  """Trains `model` in place until held-out accuracy >= target or max_steps. Returns a summary;
  `warm_start/interrupted` is 1 when `should_stop()` (a preemption, asked before every step) ended
  it early. `on_step(steps_done)` follows every step (the trainer's progress bar).

  An interrupted warm start continues from `start_step` with its `optimizer` (and `records`
  positioned after the batches already used)."""
  sharding = NamedSharding(mesh, P("fsdp")) if mesh is not None else None
  put = (lambda x: jax.device_put(x, sharding)) if sharding is not None else jnp.asarray
  optimizer = optimizer or make_optimizer(model, cfg)
  with sharding_lib.activation_rules(mesh, mesh_lib.LEARNER_RULES):  # traced with the batch kept sharded
    eval_tokens, eval_mask = encode_pairs(held_out, tokenizer, length)
    accuracy, step, loss = teacher_forced_accuracy(model, eval_tokens, eval_mask, sharding), start_step, float("nan")
    interrupted = False
    while step < cfg.max_steps and accuracy < cfg.target_accuracy:
      if should_stop():
        interrupted = True
        break
      batch = [next(records) for _ in range(cfg.batch_size)]
      tokens, mask = encode_pairs(batch, tokenizer, length)
      loss = float(_train_step(model, optimizer, put(tokens), put(mask)))
      step += 1
      on_step(step)
      if step % cfg.eval_every == 0 or step == cfg.max_steps:
        accuracy = teacher_forced_accuracy(model, eval_tokens, eval_mask, sharding)
        log(f"warm start step {step}: loss {loss:.3f}, held-out accuracy {accuracy:.3f}")
  return {"warm_start/steps": step, "warm_start/loss": loss, "warm_start/accuracy": accuracy,
          "warm_start/interrupted": int(interrupted)}
