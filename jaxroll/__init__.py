"""jaxroll: rollout-efficient reinforcement learning of reasoning LLMs in JAX."""

__version__ = "0.1.0"
