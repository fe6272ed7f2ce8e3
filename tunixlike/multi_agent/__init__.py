"""Several policies in one run: multi-agent episodes, their coordinator and the episode-level buffer.
Names are imported on first use (`lazy_exports`): the config imports `multi_agent.config` without the runtime."""

from tunixlike.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "buffer": ("EpisodeQueue",),
    "coordinator": ("Episode", "EpisodeCoordinator"),
    "env": ("MultiAgentEnv", "Turn"),
    "self_play": ("ProposeSolveEnv",),
})
