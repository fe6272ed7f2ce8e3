"""On-policy distillation: a frozen teacher scores the student's own samples, token by token.

The student samples completions as usual (the sampler records log p_student(y_t) for every token).
In the reward stage, `Teacher.score(group)` runs one jitted forward of the frozen teacher over the
group's prompt + completion tokens and stores log p_teacher(y_t) in `Completion.teacher_logprobs`.
The learner's per-token advantage is then r_t = log p_teacher(y_t) - log p_student(y_t)
(`learner/token_advantages.distill`): the negative per-token reverse KL, whose policy gradient
pulls the student towards the teacher where the *student* puts its mass (mode-seeking).

The teacher runs in the reward thread pool, so teacher scoring overlaps decoding and training like
any slow reward; its parameters live on the learner submesh (or wherever `from_pretrained` put them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunixlike import models
from tunixlike.learner import logprobs as logprobs_lib
from tunixlike.learner.batch import pick_bucket
from tunixlike.rollout import RolloutGroup

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _next_token_logprobs(graphdef, state, tokens_bt, chunk_size: int):
  """log p(tokens[t+1] | tokens[<= t]) at position t, [B, T] (the last position predicts padding)."""
  model = nnx.merge(graphdef, state)
  h_btd = model.hidden_states(tokens_bt)
  targets = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros_like(tokens_bt[:, :1])], axis=1)
  logp, _ = logprobs_lib.chunked_token_logprobs(h_btd, targets, model.unembed, chunk_size, with_entropy=False)
  return logp


class Teacher:
  """A frozen model that fills `Completion.teacher_logprobs` for whole groups (thread-safe)."""

  def __init__(self, model: nnx.Module, *, vocab_size: int | None = None, pad_id: int = 0,
               seq_buckets=DEFAULT_BUCKETS, chunk_size: int = 128):
    """`vocab_size`: the student's; the teacher must share its tokenizer (same ids, same size)."""
    teacher_vocab = model.cfg.vocab_size
    if vocab_size is not None and teacher_vocab != vocab_size:
      raise ValueError(f"model.teacher_path: the teacher has vocab_size={teacher_vocab}, the student {vocab_size}; "
                       "distillation compares per-token logprobs, so both must use the same tokenizer")
    graphdef, state = nnx.split(model)
    self._state = jax.tree.map(jax.lax.stop_gradient, state)
    self.vocab_size, self.pad_id = teacher_vocab, pad_id
    self.seq_buckets = tuple(sorted(seq_buckets))
    self._fn = jax.jit(functools.partial(_next_token_logprobs, graphdef, chunk_size=chunk_size))

  @classmethod
  def load(cls, path: str, *, mesh=None, rules=None, dtype=None, **kwargs) -> "Teacher":
    """The teacher from a local Hugging Face directory (placed on `mesh` by `rules`)."""
    return cls(models.from_pretrained(path, mesh=mesh, rules=rules, dtype=dtype), **kwargs)

  def token_logprobs(self, prompt_ids: np.ndarray, completions: list[np.ndarray]) -> list[np.ndarray]:
    """log p_teacher of each completion token given the prompt and the tokens before it."""
    p = len(prompt_ids)
    longest = p + max((len(c) for c in completions), default=0)
    t = pick_bucket(max(longest, 1), self.seq_buckets)
    tokens = np.full((len(completions), t), self.pad_id, np.int32)
    for i, c in enumerate(completions):
      tokens[i, :p] = prompt_ids
      tokens[i, p:p + len(c)] = c
      if len(c) and int(np.max(c)) >= self.vocab_size:
        raise ValueError(f"completion token id {int(np.max(c))} is outside the teacher's vocabulary of {self.vocab_size}")
    logp_bt = np.asarray(jax.device_get(self._fn(self._state, tokens)))
    # Completion token i sits at position p + i and is predicted from position p + i - 1.
    return [logp_bt[i, p - 1:p - 1 + len(c)].astype(np.float32) for i, c in enumerate(completions)]

  def score(self, group: RolloutGroup) -> dict[str, float]:
    """Fills each completion's `teacher_logprobs`; adds `distill/reverse_kl` (the sampled estimate
    mean_t log p_student(y_t) - log p_teacher(y_t) over the group's tokens) to `reward_metrics`."""
    if len(group.prompt_token_ids) == 0:
      raise ValueError(f"RolloutGroup(prompt_id={group.prompt_id!r}) has an empty prompt: the teacher needs a "
                       "token to predict the first completion token from")
    logps = self.token_logprobs(np.asarray(group.prompt_token_ids), [c.token_ids for c in group.completions])
    gaps = []
    for c, lp in zip(group.completions, logps):
      c.teacher_logprobs = lp
      produced = np.ones(c.num_tokens, bool) if c.loss_mask is None else np.asarray(c.loss_mask) > 0
      gaps.append((np.asarray(c.logprobs) - lp)[produced])
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    metrics = {"distill/reverse_kl": float(gaps.mean()) if gaps.size else 0.0}
    group.reward_metrics.update(metrics)
    return metrics


def reverse_kl(student: nnx.Module, teacher: nnx.Module, tokens_bt: np.ndarray, mask_bt: np.ndarray) -> float:
  """Exact mean reverse KL(p_student || p_teacher) over the full vocabulary at the positions that
  predict the tokens marked by `mask_bt` (aligned with tokens: mask[t] = 1 scores the prediction of
  token t from position t - 1). For evaluation (held-out prompts); builds [B, T, V] logits."""
  tokens = jnp.asarray(tokens_bt, jnp.int32)
  ls = jax.nn.log_softmax(student(tokens).astype(jnp.float32), axis=-1)[:, :-1]
  lt = jax.nn.log_softmax(teacher(tokens).astype(jnp.float32), axis=-1)[:, :-1]
  kl_bt = (jnp.exp(ls) * (ls - lt)).sum(-1)
  m = jnp.asarray(mask_bt, jnp.float32)[:, 1:]
  return float((kl_bt * m).sum() / jnp.maximum(m.sum(), 1.0))
