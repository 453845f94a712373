"""C(q): the cost to first reach held-out quality q (survey, Section 8.5)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Training seconds with and without XLA compilation (`cumulative_steady_s`:
# what a long run's seconds converge to, since a short run pays every
# program's compilation in its first steps), generated tokens, rollouts.
COST_UNITS = ("cumulative_train_s", "cumulative_steady_s", "cumulative_tokens", "cumulative_rollouts")
SECONDS_UNITS = ("cumulative_train_s", "cumulative_steady_s")


def unit_costs(evals: Sequence[dict], unit: str) -> list[float] | None:
  """The cumulative cost `unit` at each evaluation (metrics records joined
  with their step's timing; nothing is spent before step 1), or None when
  one lacks it: a run logged before jaxroll kept that unit."""
  vals = [0.0 if e["step"] == 0 else e.get(unit) for e in evals]
  return None if None in vals else vals


def cost_to_quality(quality: Sequence[float], cost: Sequence[float] | None,
                    targets: Sequence[float]) -> list[float | None]:
  """For each target q, the cost at the first evaluation whose quality is >= q.

  Args:
    quality: held-out quality at each evaluation, in evaluation order.
    cost: cumulative cost at each evaluation (non-decreasing); None for a
      unit the run did not log (`unit_costs`).
    targets: the q values of the curve.

  Returns:
    One cost per target; None where the run never reached it (or has no cost).
  """
  if cost is None:
    return [None] * len(targets)
  quality = np.asarray(quality, float)
  cost = np.asarray(cost, float)
  if quality.shape != cost.shape:
    raise ValueError(f"{quality.size} quality values but {cost.size} costs")
  if np.any(np.diff(cost) < 0):
    raise ValueError("cumulative cost must not decrease")
  out = []
  for q in targets:
    hit = np.nonzero(quality >= q)[0]
    out.append(float(cost[hit[0]]) if hit.size else None)
  return out


def quality_targets(quality: Sequence[float], num: int = 20) -> np.ndarray:
  """Targets from the first evaluation's quality up to the best reached."""
  quality = np.asarray(quality, float)
  return np.linspace(quality[0], quality.max(), num)
