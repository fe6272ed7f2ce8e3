"""Agents with their own loop (rl.agent): the OpenAI-compatible server on the sampler, the driver whose
episodes the agents run, and the token-exact records of their conversations (docs/agents.md)."""
