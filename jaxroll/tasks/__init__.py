"""Verifiable tasks: examples, tokenizers and rewards."""

from jaxroll.tasks.base import Example, RewardFn
from jaxroll.tasks.rewards import RewardReport, RewardRunner

__all__ = ["Example", "RewardFn", "RewardReport", "RewardRunner"]
