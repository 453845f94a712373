"""Rollout: batched, slot-based sampling of the policy for RL."""

from jaxroll.rollout.engine import RolloutEngine, RolloutStats
from jaxroll.rollout.sampling import SamplingParams

__all__ = ["RolloutEngine", "RolloutStats", "SamplingParams"]
