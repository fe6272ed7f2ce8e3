"""Supervised fine-tuning (SFT): next-token training on answers, before RL (a warm start) or alone.

RL from a model that never produces a correct answer gets no reward and no gradient; a short
supervised stage on known answers gives it correct samples to learn from. The examples are the
run's own training rows, each prompt built exactly as RL builds it (`PromptPipeline`):

  an answer column   (data.answer_field; a built-in task's `answer`): prompt + answer + eos, the loss
                     on the answer and eos only;
  chat messages      (data.messages_field) with assistant turns: the conversation rendered with the
                     model's chat template, the loss on the assistant turns' tokens only.

The stage runs on the learner mesh (the batch sharded over 'fsdp', the learner's optax chain at
warm_start.learning_rate) and reports the training loss, the held-out loss and held-out accuracy:
greedy decoding scored by the first reward's verifier, as the RL evals do. It stops at
warm_start.max_steps or once that accuracy reaches warm_start.target_accuracy (a warm start that
memorises stops exploring, and RL then collapses: measured on the addition task).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tunixlike import mesh as mesh_lib
from tunixlike.learner import optimizer as optimizer_lib
from tunixlike.learner.config import OptimConfig
from tunixlike.models import sharding as sharding_lib


class ExampleError(ValueError):
  """A row the supervised stage cannot learn from (no answer, no assistant turn); names the row and key."""


def answer_example(prompt_ids: Sequence[int], answer: str, tokenizer) -> tuple[list[int], list[int]]:
  """(tokens, targets): the prompt's tokens, then the answer's and eos; targets mark the answer and eos."""
  answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_id]
  return list(prompt_ids) + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)


def chat_example(messages: Sequence[Mapping[str, Any]], tokenizer, *, system: str | None = None
                 ) -> tuple[list[int], list[int]]:
  """(tokens, targets) of a conversation rendered with the chat template; targets mark the tokens of
  every assistant turn (what the template writes for it, up to its end-of-turn token).

  Each turn's span is the difference between the renderings of the conversation up to it, with and
  without the turn, so the template must render a conversation as a sequence of its prefixes (ChatML,
  Llama 3 and most templates do)."""
  messages = ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in messages]
  if not any(m.get("role") == "assistant" for m in messages):
    raise ExampleError("has no assistant turn to learn")
  tokens: list[int] = []
  targets: list[int] = []
  done = ""
  for i, m in enumerate(messages):
    if m.get("role") != "assistant":
      continue
    before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
    through = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
    if not (before.startswith(done) and through.startswith(before)):
      raise ExampleError("the chat template does not render the conversation as a sequence of its prefixes, so "
                         "its assistant turns cannot be found; use data.answer_field instead")
    prompt = tokenizer.encode_prompt(before[len(done):], templated=True) if len(before) > len(done) else []
    turn = tokenizer.encode_prompt(through[len(before):], templated=True)
    stops = [j for j, t in enumerate(turn) if t in tokenizer.stop_ids]
    if not stops:  # a template that writes no end of turn: the model must still learn to stop
      turn, stops = turn + [tokenizer.eos_id], [len(turn)]
    tokens += prompt + turn
    # The turn up to its end-of-turn token; what the template writes after it (a newline) is context.
    targets += [0] * len(prompt) + [int(j <= stops[-1]) for j in range(len(turn))]
    done = through
  return tokens, targets


@dataclasses.dataclass(frozen=True)
class ExampleFormat:
  """Where a row's answer is: `answer_field` (with the pipeline's prompt tokens) or `messages_field`."""

  answer_field: str | None = None
  messages_field: str | None = None
  system_prompt: str | None = None

  def __post_init__(self):
    if (self.answer_field is None) == (self.messages_field is None):
      raise ValueError("ExampleFormat needs exactly one of answer_field and messages_field")

  def example(self, record: Mapping[str, Any], tokenizer) -> tuple[list[int], list[int]]:
    where = f"row {record.get('id')!r}"
    try:
      if self.messages_field is not None:
        return chat_example(record[self.messages_field], tokenizer, system=self.system_prompt)
      answer = record.get(self.answer_field)
      if answer is None:
        raise ExampleError(f"has no column {self.answer_field!r} (data.answer_field); it has {sorted(record)}")
      return answer_example(record["prompt_token_ids"], str(answer), tokenizer)
    except ExampleError as e:
      raise ExampleError(f"supervised stage: {where} {e}") from None


def answer_length(record: Mapping[str, Any], tokenizer, fmt: ExampleFormat) -> int | None:
  """Tokens of a row's answer with its end, as the policy must write it: the answer column's text and
  the end-of-sequence token, or a chat row's last assistant turn as the chat template writes it, up to
  its end-of-turn token. None for a row without one (no answer; chat messages that do not end with an
  assistant turn, or that the template cannot split into turns)."""
  if fmt.messages_field is None:
    answer = record.get(fmt.answer_field)
    return None if answer is None else len(tokenizer.encode(str(answer), add_special_tokens=False)) + 1
  messages = record.get(fmt.messages_field)
  if not (isinstance(messages, (list, tuple)) and messages and isinstance(messages[-1], Mapping)
          and messages[-1].get("role") == "assistant"):
    return None
  try:
    _, targets = chat_example(messages, tokenizer, system=fmt.system_prompt)
  except ExampleError:
    return None
  return [len(list(run)) for target, run in itertools.groupby(targets) if target][-1]  # the last turn's targets


def encode(records: Sequence[Mapping[str, Any]], tokenizer, length: int, fmt: ExampleFormat
           ) -> tuple[np.ndarray, np.ndarray, int]:
  """(tokens [N, L], mask [N, L], rows cut): right padded with pad_id; mask[t] = 1 where token
  t+1 is a target, i.e. where the model must predict it. Rows longer than `length` are cut there."""
  tokens = np.full((len(records), length), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(records), length), np.float32)
  cut = 0
  for i, r in enumerate(records):
    seq, targets = fmt.example(r, tokenizer)
    cut += len(seq) > length
    seq, targets = seq[:length], targets[:length]
    tokens[i, :len(seq)] = seq
    mask[i, :len(seq) - 1] = targets[1:]
  return tokens, mask, cut


def _nll(model, tokens_bt, mask_bt):
  """(summed next-token NLL over the targets, number of targets)."""
  logits = model(tokens_bt[:, :-1])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens_bt[:, 1:])
  m = mask_bt[:, :-1]
  return (nll * m).sum(), m.sum()


@nnx.jit
def _train_step(model, optimizer, tokens_bt, mask_bt):
  def loss_fn(model):
    total, count = _nll(model, tokens_bt, mask_bt)
    return total / jnp.maximum(count, 1.0)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


_eval_nll = nnx.jit(_nll)


def make_optimizer(model, learning_rate: float, optim: OptimConfig = OptimConfig()) -> nnx.Optimizer:
  """The learner's optax chain (gradient clip, AdamW with the optim section's betas and decay) at a
  constant `learning_rate`."""
  sft = dataclasses.replace(optim, learning_rate=learning_rate, schedule="constant", warmup_steps=0,
                            updates_per_batch=1)
  return nnx.Optimizer(model, optimizer_lib.make_optimizer(sft), wrt=nnx.Param)


class SupervisedStage:
  """Trains `model` in place on batches of `fmt` examples; see the module docstring."""

  def __init__(self, model, tokenizer, cfg, fmt: ExampleFormat, *, length: int, mesh: jax.sharding.Mesh | None = None,
               optimizer: nnx.Optimizer | None = None, optim: OptimConfig = OptimConfig()):
    self.model, self.tokenizer, self.cfg, self.fmt, self.length = model, tokenizer, cfg, fmt, length
    self.mesh = mesh
    self.sharding = NamedSharding(mesh, P("fsdp")) if mesh is not None else None
    self.optimizer = optimizer or make_optimizer(model, cfg.learning_rate, optim)
    self.rows_cut = 0

  def _put(self, x):
    return jax.device_put(x, self.sharding) if self.sharding is not None else jnp.asarray(x)

  def _padded(self, x: np.ndarray) -> np.ndarray:
    """Rows padded to a multiple of the devices with rows that count for nothing (mask 0)."""
    pad = -len(x) % (len(self.sharding.device_set) if self.sharding is not None else 1)
    return np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x

  def step(self, records: Sequence[Mapping[str, Any]]) -> float:
    tokens, mask, cut = encode(records, self.tokenizer, self.length, self.fmt)
    self.rows_cut += cut
    with sharding_lib.activation_rules(self.mesh, mesh_lib.LEARNER_RULES):  # traced with the batch kept sharded
      return float(_train_step(self.model, self.optimizer, self._put(tokens), self._put(mask)))

  def held_out_loss(self, records: Sequence[Mapping[str, Any]]) -> float:
    tokens, mask, _ = encode(records, self.tokenizer, self.length, self.fmt)
    with sharding_lib.activation_rules(self.mesh, mesh_lib.LEARNER_RULES):
      total, count = _eval_nll(self.model, self._put(self._padded(tokens)), self._put(self._padded(mask)))
    return float(total / jnp.maximum(count, 1.0))

  def run(self, records: Iterator[Mapping[str, Any]], held_out: Sequence[Mapping[str, Any]],
          evaluate_held_out: Callable[[], Mapping[str, float]], *, start_step: int = 0, log: Callable[[str], None] = print,
          should_stop: Callable[[], bool] = lambda: False,
          on_step: Callable[[int, dict], None] = lambda step, metrics: None,
          on_eval: Callable[[dict], None] = lambda metrics: None) -> dict[str, float]:
    """Steps from `start_step` until held-out accuracy >= target or max_steps; `records` continue
    after the batches already used. `evaluate_held_out(limit)` returns the greedy evaluation's
    `eval/accuracy`, `eval/truncated` (the share of answers cut at sampler.max_new_tokens) and
    `eval/num_prompts` on the first `limit` held-out prompts (None: all; warm_start.screen_prompts).
    Returns the summary; `warm_start/interrupted` is 1 when `should_stop()` (a preemption, asked before
    every step) ended it early. `on_step(step, metrics)` follows every step (the progress bar),
    `on_eval(metrics)` every evaluation (the logs)."""
    cfg = self.cfg
    step, loss, interrupted = start_step, float("nan"), False
    held = [r for r in held_out if self._has_answer(r)]  # an eval file may lack the answer column

    def evaluate() -> dict[str, float]:
      # Far from the target a few prompts tell as much as all of them: the whole set is decoded only
      # near it (and at the last step), so a long stage is not mostly evaluation.
      greedy = evaluate_held_out(cfg.screen_prompts) if cfg.screen_prompts and step < cfg.max_steps else None
      if greedy is None or greedy["eval/accuracy"] >= cfg.target_accuracy / 2:
        greedy = evaluate_held_out(None)
      out = {"warm_start/step": step, "warm_start/loss": loss, "warm_start/accuracy": greedy["eval/accuracy"],
             "warm_start/truncated": greedy["eval/truncated"], "warm_start/rows_cut": self.rows_cut,
             "warm_start/eval_prompts": greedy["eval/num_prompts"]}
      if held:
        out["warm_start/eval_loss"] = self.held_out_loss(held)
      on_eval(out)
      return out

    metrics = evaluate()
    while step < cfg.max_steps and metrics["warm_start/accuracy"] < cfg.target_accuracy:
      if should_stop():
        interrupted = True
        break
      loss = self.step([next(records) for _ in range(cfg.batch_size)])
      if not np.isfinite(loss):
        raise FloatingPointError(f"supervised stage: loss is {loss} at step {step + 1}; lower "
                                 "warm_start.learning_rate")
      step += 1
      if step % cfg.eval_every == 0 or step == cfg.max_steps:
        metrics = evaluate()
        held_loss = metrics.get("warm_start/eval_loss", float("nan"))
        log(f"warm start step {step}: loss {loss:.3f}, held-out loss {held_loss:.3f}, "
            f"held-out accuracy {metrics['warm_start/accuracy']:.3f}")
      on_step(step, {"loss": loss, "eval/accuracy": metrics["warm_start/accuracy"]})
    summary = {k: v for k, v in metrics.items() if k != "warm_start/step"}  # the eval records have that
    return {**summary, "warm_start/steps": step, "warm_start/loss": loss, "warm_start/interrupted": int(interrupted)}

  def _has_answer(self, record: Mapping[str, Any]) -> bool:
    field = self.fmt.messages_field or self.fmt.answer_field
    return record.get(field) is not None
