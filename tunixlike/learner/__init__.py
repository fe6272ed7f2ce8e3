"""The learner: GRPO-family objectives (registries of small pure functions), batch assembly and
the sharded, jitted train step. Never imports the sampler (see DESIGN "Layers")."""

from tunixlike.learner.advantages import ADVANTAGE_ESTIMATORS, get_advantage_fn
from tunixlike.learner.batch import assemble_batch, pick_bucket
from tunixlike.learner.config import AlgoConfig, LearnerConfig, OptimConfig
from tunixlike.learner.dapo import keep_informative_groups, overlong_penalty
from tunixlike.learner.is_correction import importance_weights, version_lag_stats
from tunixlike.learner.kl import KL_ESTIMATORS, get_kl_fn
from tunixlike.learner.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, get_policy_loss
from tunixlike.learner.state import TrainState
from tunixlike.learner.train_step import Learner

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "AlgoConfig", "KL_ESTIMATORS", "Learner", "LearnerConfig",
    "OptimConfig", "POLICY_LOSSES", "TrainState", "aggregate", "assemble_batch", "get_advantage_fn",
    "get_kl_fn", "get_policy_loss", "importance_weights", "keep_informative_groups", "overlong_penalty",
    "pick_bucket", "version_lag_stats",
]
