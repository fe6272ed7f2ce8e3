"""The learner: GRPO-family objectives (registries of small pure functions), batch assembly and
the sharded, jitted train step. Never imports the sampler (see DESIGN "Layers"). Names are imported
on first use (`lazy_exports`): the config imports `learner.config` without the train step."""

from tunixlike.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "advantages": ("ADVANTAGE_ESTIMATORS", "get_advantage_fn"),
    "batch": ("assemble_batch", "pick_bucket"),
    "config": ("AlgoConfig", "LearnerConfig", "OptimConfig"),
    "dapo": ("keep_informative_groups", "overlong_penalty"),
    "is_correction": ("importance_weights", "version_lag_stats"),
    "kl": ("KL_ESTIMATORS", "get_kl_fn"),
    "losses": ("AGGREGATIONS", "POLICY_LOSSES", "aggregate", "get_policy_loss"),
    "state": ("TrainState",),
    "train_step": ("Learner",),
})
