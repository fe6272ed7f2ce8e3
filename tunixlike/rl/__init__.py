"""The async runtime: rollout queue with staleness control, weight sync, sampler and learner loops."""
