"""A makespan simulator for rollout scheduling (survey Sections 5.4-5.5).

Requests with known lengths (tokens) are admitted, in a given order, to M
identical workers (decode slots or engines); each request goes to the worker
that frees first, and takes `length * cost_per_token` time. This is Graham's
list scheduling: with the longest-first order (LPT) its makespan is at most
(4/3 - 1/(3M)) times the optimum. Synchronous RL waits for the makespan, so
its idle fraction is the share of worker time spent waiting for the tail.

The simulator turns a recorded length trace (run_dir/lengths.jsonl) into
projections for any worker count: `jaxroll simulate RUN_DIR --workers M`.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

ORDERS = ("fifo", "lpt", "lpt_predicted", "random")


@dataclasses.dataclass(frozen=True)
class Schedule:
  makespan: float
  idle_fraction: float  # 1 - busy time / (workers * makespan)


def list_schedule(lengths: Sequence[float], workers: int, order: Sequence[int] | None = None,
                  cost_per_token: float = 1.0) -> Schedule:
  """Makespan of greedy list scheduling of `lengths` in `order` on `workers`."""
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}")
  lengths = np.asarray(lengths, float)
  if np.any(lengths < 0):
    raise ValueError("request lengths must be non-negative")
  order = range(len(lengths)) if order is None else order
  free_at = [0.0] * workers  # a heap of worker finish times
  for i in order:
    start = heapq.heappop(free_at)
    heapq.heappush(free_at, start + lengths[i] * cost_per_token)
  makespan = float(max(free_at))
  busy = float(lengths.sum()) * cost_per_token
  return Schedule(makespan, 1.0 - busy / (workers * makespan) if makespan > 0 else 0.0)


def order_for(policy: str, lengths: Sequence[float], predicted: Sequence[float] | None = None,
              seed: int = 0) -> list[int]:
  """Admission order: as recorded (fifo), longest first by true or predicted length, or random."""
  n = len(lengths)
  if policy == "fifo":
    return list(range(n))
  if policy == "lpt":
    return sorted(range(n), key=lambda i: -lengths[i])  # stable: ties keep recorded order
  if policy == "lpt_predicted":
    if predicted is None:
      raise ValueError("lpt_predicted needs predicted lengths")
    return sorted(range(n), key=lambda i: -predicted[i])
  if policy == "random":
    return list(np.random.default_rng(seed).permutation(n))
  raise ValueError(f"unknown order {policy!r}; expected one of {ORDERS}")
