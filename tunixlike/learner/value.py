"""A critic for PPO: a linear value head on the policy's trunk, or on a separate critic model.

The head reads the same final hidden states the unembedding reads (`model.hidden_states`), so one
trunk forward pass gives both the token log-probs and the values, and the value loss also shapes
the shared trunk (the actor-critic recipe of Stiennon et al. 2020 / Ouyang et al. 2022 with a shared
body). `PolicyWithValue` bundles policy and head into one nnx Module so the learner splits, shards,
optimizes and checkpoints them as one set of parameters; the policy alone is `.policy` (weight sync
to the sampler, export).

`PolicyWithCritic` is the other option: the head sits on a second trunk (a separate, often smaller
model loaded from a Hugging Face checkpoint, `load_critic`) that reads the same tokens. The policy
and critic then share nothing but the optimizer step; the critic's parameters live under
`params["critic"]` / `params["value_head"]`, so they can be offloaded to host memory on their own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tunixlike import models


class ValueHead(nnx.Module):
  """V(h_t) = h_t . w + b, [B, T, D] -> float32 [B, T].

  The kernel has logical axes ('embed', None) so it shards like the rows of the embedding. It
  starts small but non-zero: a zero kernel would send no value-loss gradient into the trunk.
  """

  def __init__(self, hidden_size: int, *, rngs: nnx.Rngs, param_dtype: str, init_std: float = 0.02):
    if hidden_size <= 0:
      raise ValueError(f"ValueHead hidden_size={hidden_size!r}: must be > 0")
    self.proj = nnx.Linear(
        hidden_size, 1, use_bias=True, dtype=jnp.float32, param_dtype=jnp.dtype(param_dtype),
        kernel_init=nnx.with_partitioning(nnx.initializers.normal(init_std), ("embed", None), eager_sharding=False),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (None,), eager_sharding=False),
        rngs=rngs)

  def __call__(self, h_btd):
    # float32: value targets are returns of order 1 whose small differences (advantages) matter.
    return self.proj(h_btd.astype(jnp.float32))[..., 0]


class PolicyWithValue(nnx.Module):
  """The policy plus a value head on its trunk, with the policy's `hidden_states` / `unembed`, so the
  learner's log-prob code runs on it unchanged."""

  def __init__(self, policy: nnx.Module, value_head: ValueHead):
    self.policy = policy
    self.value_head = value_head

  @classmethod
  def create(cls, policy: nnx.Module, *, seed: int, init_std: float = 0.02) -> "PolicyWithValue":
    """A fresh value head sized from `policy.cfg.hidden_size`, in the policy's parameter dtype."""
    cfg = policy.cfg
    return cls(policy, ValueHead(cfg.hidden_size, rngs=nnx.Rngs(seed), init_std=init_std,
                                 param_dtype=cfg.param_dtype))

  @property
  def cfg(self):
    """The policy's ModelConfig (the runtime reads model sizes from `learner.model(state).cfg`)."""
    return self.policy.cfg

  def hidden_states(self, tokens_bt, positions_bt=None, **kw):
    return self.policy.hidden_states(tokens_bt, positions_bt, **kw)

  def unembed(self, h_btd):
    return self.policy.unembed(h_btd)

  def values(self, h_btd, tokens_bt=None):
    """V_t [B, T] from the policy trunk's hidden states (`tokens_bt` is not needed here)."""
    del tokens_bt
    return self.value_head(h_btd)

  def __call__(self, tokens_bt):
    return self.policy(tokens_bt)


class PolicyWithCritic(PolicyWithValue):
  """The policy plus a separate critic: a second trunk (`critic`, a Transformer over the same
  vocabulary) with its own value head. Values ignore the policy's hidden states."""

  def __init__(self, policy: nnx.Module, critic: nnx.Module, value_head: ValueHead):
    super().__init__(policy, value_head)
    self.critic = critic

  @classmethod
  def create(cls, policy: nnx.Module, critic: nnx.Module, *, seed: int,
             init_std: float = 0.02) -> "PolicyWithCritic":
    check_critic(policy, critic, where="critic")
    return cls(policy, critic, ValueHead(critic.cfg.hidden_size, rngs=nnx.Rngs(seed), init_std=init_std,
                                         param_dtype=critic.cfg.param_dtype))

  def values(self, h_btd, tokens_bt=None):
    """V_t [B, T] from the critic trunk run over `tokens_bt` (required)."""
    del h_btd
    if tokens_bt is None:
      raise ValueError("PolicyWithCritic.values needs tokens_bt: the critic runs its own trunk")
    return self.value_head(self.critic.hidden_states(tokens_bt))


def check_critic(policy: nnx.Module, critic: nnx.Module, *, where: str) -> None:
  """The critic reads the policy's token ids: its embedding must cover the same vocabulary."""
  pv, cv = policy.cfg.vocab_size, critic.cfg.vocab_size
  if pv != cv:
    shape = tuple(critic.embed_tokens.embedding.get_value().shape)
    raise ValueError(f"{where}: tensor model.embed_tokens.weight has shape {shape} (vocab {cv}), but the policy's "
                     f"vocabulary has {pv} tokens; the critic must use the policy's tokenizer")


def load_critic(path: str, policy: nnx.Module, *, mesh: jax.sharding.Mesh | None = None, rules=None,
                dtype: str | None = None) -> nnx.Module:
  """A critic trunk from a local Hugging Face directory, checked against `policy`.

  Errors name the key and the path: missing or unreadable files and tensors whose shapes do not
  match the checkpoint's config come from `models.from_pretrained`; a vocabulary that differs from
  the policy's from `check_critic`.
  """
  where = f"model.critic_path={path!r}"
  try:
    critic = models.from_pretrained(path, mesh=mesh, rules=rules, dtype=dtype)
  except (OSError, ValueError) as e:  # models.CheckpointError is a ValueError
    raise ValueError(f"{where}: {e}") from e
  check_critic(policy, critic, where=where)
  return critic
