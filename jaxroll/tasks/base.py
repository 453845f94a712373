"""What every task provides: examples with a verifiable answer, and a reward."""

from __future__ import annotations

import dataclasses
from typing import Callable

# reward(completion_text, answer_text) -> float in [0, 1]; a plain function,
# run under a timeout by jaxroll.tasks.rewards.RewardRunner.
RewardFn = Callable[[str, str], float]


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its reference answer.

  Attributes:
    prompt: the text the policy is conditioned on.
    answer: the reference the reward compares against.
    difficulty: a task-defined hardness (e.g. the number of reasoning
      steps); reports break accuracy down by it. -1 when unknown.
  """

  prompt: str
  answer: str
  difficulty: int = -1
