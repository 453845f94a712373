"""Response budgets and how truncated trajectories enter the loss.

A trajectory that reaches its token budget without a stop token is
truncated: its reward says nothing reliable about a full answer (survey
Section 6.3, "truncation"). The treatments:

  keep         scored as it is (the verifier usually gives 0) and trained on.
  zero_reward  reward forced to 0, then trained on like any other row: the
               policy is pushed away from running long (DeepScaleR's
               iterative lengthening uses this with a rising budget).
  mask         kept in its group's reward statistics, but its tokens are
               removed from the loss (DAPO's overlong filtering): no gradient
               from a cut-off answer, and the baseline still sees it.
  drop         removed from the group altogether: the group's mean and std
               use the other rows only, and its tokens leave the loss.

Each is exact for its stated objective; `zero_reward` and `keep` change the
objective to "answer within the budget".

A budget curriculum is written "budget@step,...", e.g. "12@0,18@50,24@100":
12 tokens from RL step 0, 18 from step 50, 24 from step 100 (DeepScaleR,
Luo et al., 2025, raises the context 8k -> 16k -> 24k in stages).
"""

from __future__ import annotations

import numpy as np

TREATMENTS = ("keep", "zero_reward", "mask", "drop")


def parse_budgets(text: str, max_new_tokens: int) -> list[tuple[int, int]]:
  """[(first step, budget)] from "budget@step,..."; empty text: one budget, max_new_tokens.

  Raises:
    ValueError naming the problem: a malformed entry, a first stage not at
    step 0, steps not increasing, budgets that decrease, or a budget outside
    [1, max_new_tokens].
  """
  if not text.strip():
    return [(0, max_new_tokens)]
  stages = []
  for item in text.split(","):
    parts = item.strip().split("@")
    try:
      budget, step = int(parts[0]), int(parts[1])
      if len(parts) != 2:
        raise ValueError
    except (ValueError, IndexError):
      raise ValueError(f"budget stage {item.strip()!r} is not 'budget@step' (e.g. '12@0')") from None
    stages.append((step, budget))
  if stages[0][0] != 0:
    raise ValueError(f"the first budget stage must start at step 0, got {stages[0][0]}")
  for (s0, b0), (s1, b1) in zip(stages, stages[1:]):
    if s1 <= s0:
      raise ValueError(f"budget stages must start at increasing steps ({s0} then {s1})")
    if b1 < b0:
      raise ValueError(f"the budget curriculum decreases ({b0} then {b1} at step {s1}); "
                       "budgets may only stay or rise")
  for _, b in stages:
    if not 1 <= b <= max_new_tokens:
      raise ValueError(f"budget {b} is outside [1, rollout.max_new_tokens={max_new_tokens}]")
  return stages


def budget_at(stages: list[tuple[int, int]], step: int) -> int:
  """The budget in force at RL step `step` (0-based)."""
  return [b for s, b in stages if s <= step][-1]


def apply_truncation(rewards_N, truncated_N, treatment: str):
  """Applies a treatment to truncated rows.

  Returns:
    (rewards_N, in_group_N, in_loss_N): the rewards to compute advantages
    from, which rows are members of their group's statistics, and which
    rows' tokens enter the loss.
  """
  if treatment not in TREATMENTS:
    raise ValueError(f"unknown truncation treatment {treatment!r}; expected one of {TREATMENTS}")
  r_N = np.asarray(rewards_N, np.float32).copy()
  t_N = np.asarray(truncated_N, bool)
  in_group_N = np.ones_like(t_N)
  in_loss_N = np.ones_like(t_N)
  if treatment == "zero_reward":
    r_N[t_N] = 0.0
  elif treatment == "mask":
    in_loss_N = ~t_N
  elif treatment == "drop":
    in_group_N = ~t_N
    in_loss_N = ~t_N
  return r_N, in_group_N, in_loss_N
