"""Several policies in one run: multi-agent episodes, their coordinator and the episode-level buffer."""

from tunixlike.multi_agent.buffer import EpisodeQueue
from tunixlike.multi_agent.coordinator import Episode, EpisodeCoordinator
from tunixlike.multi_agent.env import MultiAgentEnv, Turn
from tunixlike.multi_agent.self_play import ProposeSolveEnv

__all__ = ["Episode", "EpisodeCoordinator", "EpisodeQueue", "MultiAgentEnv", "ProposeSolveEnv", "Turn"]
