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


def partial_rollout_steps(groups: Sequence[Sequence[float]], per_step: int, workers: int,
                          over_provision: float, lpt: bool = True) -> list[Schedule]:
  """Step makespans of APRIL-style partial rollout on a stream of groups.

  Each step keeps ceil(over_provision * per_step) groups in flight, runs
  their unfinished rows on `workers` (longest remaining first when `lpt`,
  else in launch order, which puts carried rows first), and ends when
  `per_step` groups are complete. A row cut off at the end of
  a step keeps its progress and resumes next step (Kimi-style carry-over;
  recomputing its prefix is not charged). The simulation stops when the
  stream cannot fill a step.

  Args:
    groups: each group's row lengths (tokens), in launch order.
    per_step: groups an update takes (P).
    workers: decode slots or engines (M).
    over_provision: f >= 1.
  """
  if over_provision < 1.0:
    raise ValueError(f"over_provision must be >= 1, got {over_provision}")
  target = -(-int(round(over_provision * per_step * 1e6)) // 1_000_000)  # ceil, float-safe
  stream = [list(map(float, g)) for g in groups]
  flight: list[list[float]] = []  # remaining tokens of each row, per group in flight
  out = []
  while True:
    while len(flight) < target and stream:
      flight.append(stream.pop(0))
    if len(flight) < per_step:
      return out
    rows = [(gi, r) for gi, g in enumerate(flight) for r, x in enumerate(g) if x > 0]
    if lpt:
      rows.sort(key=lambda gr: -flight[gr[0]][gr[1]])  # stable: launch order among ties
    free_at = [0.0] * workers
    start, finish = {}, {}
    for gi, r in rows:
      s = heapq.heappop(free_at)
      start[gi, r], finish[gi, r] = s, s + flight[gi][r]
      heapq.heappush(free_at, finish[gi, r])
    done_at = [max([finish[gi, r] for r in range(len(g)) if (gi, r) in finish], default=0.0)
               for gi, g in enumerate(flight)]
    end = sorted(done_at)[per_step - 1] if len(flight) > per_step else max(done_at)
    busy = 0.0
    for (gi, r), s in start.items():
      ran = max(0.0, min(finish[gi, r], end) - s)
      busy += ran
      flight[gi][r] = 0.0 if finish[gi, r] <= end else flight[gi][r] - ran
    out.append(Schedule(end, 1.0 - busy / (workers * end) if end > 0 else 0.0))
    chosen = set(sorted(range(len(flight)), key=lambda gi: (done_at[gi], gi))[:per_step])
    flight = [g for gi, g in enumerate(flight) if gi not in chosen]
