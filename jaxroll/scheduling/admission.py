"""Admission policies: which waiting row enters the next free decode slot.

The rollout engine asks its admission policy for up to k rows whenever k
slots are free, and reports every row that finishes. A policy only
reorders: each row it was given is admitted exactly once, so the sampled
tokens (which depend on each row's key alone) are the same under every
policy; what changes is how long the slots sit idle (survey Section 5.4).

  FixedOrder(rows)                  rows in the given order (FIFO)
  longest_first(rows, predicted)    LPT by a predicted length per row
  SiblingProbe(rows, group_of, ...) Seer's probe: one row per group first,
                                    the rest longest-probe-first
"""

from __future__ import annotations

import collections
import heapq
from typing import Sequence

import numpy as np


class FixedOrder:
  """Admits `rows` in the order given."""

  def __init__(self, rows: Sequence[int]):
    self.rows = [int(n) for n in rows]
    self._queue = collections.deque(self.rows)

  def __len__(self) -> int:
    return len(self._queue)

  def take(self, k: int) -> list[int]:
    return [self._queue.popleft() for _ in range(min(k, len(self._queue)))]

  def upcoming(self):
    """Rows still to admit, in the order they would be taken now."""
    return iter(self._queue)

  def observe(self, row: int, length: int) -> None:
    del row, length  # a fixed order learns nothing


def longest_first(rows: Sequence[int], predicted: Sequence[float]) -> FixedOrder:
  """LPT admission: rows by decreasing predicted length (ties keep row order).

  Args:
    rows: the rows to admit.
    predicted: predicted response length of each of `rows`.
  """
  if len(predicted) != len(rows):
    raise ValueError(f"{len(predicted)} predicted lengths for {len(rows)} rows")
  order = sorted(range(len(rows)), key=lambda i: -float(predicted[i]))
  return FixedOrder([rows[i] for i in order])


class SiblingProbe:
  """Seer-style probing: one member of each group decodes first, and its
  realised length predicts its siblings' (Seer, Qin et al., 2025).

  Probes (the first row of each group in `rows`) are admitted first, in
  order of `fallback` (longest first). Once a group's probe has finished,
  its other rows wait in a queue keyed by the probe's length, longest first.
  When slots are free but no finished probe has released siblings, rows of
  still-probing groups are admitted by `fallback` rather than leaving a
  slot idle.

  Args:
    rows: the rows to admit.
    group_of: the group of each of `rows` (rows of one group share a prompt).
    fallback: a predicted length per row (e.g. the history predictor's) used
      before a group's probe has finished.
  """

  def __init__(self, rows: Sequence[int], group_of: Sequence[int], fallback: Sequence[float]):
    if not len(rows) == len(group_of) == len(fallback):
      raise ValueError("rows, group_of and fallback must have the same length")
    self.rows = [int(n) for n in rows]
    self._group = dict(zip(self.rows, (int(g) for g in group_of)))
    members: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
    for i, n in enumerate(self.rows):
      members[self._group[n]].append((-float(fallback[i]), n))
    self._probe_of = {}
    probes = []
    for g, rs in members.items():
      self._probe_of[g] = rs[0][1]
      probes.append((rs[0][0], rs[0][1]))
    self._probes = sorted(probes)  # (-fallback, row), popped from the front
    self._waiting = {g: sorted(rs[1:]) for g, rs in members.items()}  # siblings held back
    self._released: list[tuple[float, int]] = []  # heap of (-probe length, row)
    self._left = len(self.rows)
    self.probe_length: dict[int, int] = {}

  def __len__(self) -> int:
    return self._left

  def take(self, k: int) -> list[int]:
    out = []
    while len(out) < k and self._left:
      if self._probes:
        out.append(self._probes.pop(0)[1])
      elif self._released:
        out.append(heapq.heappop(self._released)[1])
      else:
        # Every remaining row belongs to a group still probing: admit the
        # longest by fallback rather than idle a slot.
        g = min((rs[0], g) for g, rs in self._waiting.items() if rs)[1]
        out.append(self._waiting[g].pop(0)[1])
      self._left -= 1
    return out

  def upcoming(self):
    """Rows still to admit, probes first (the sibling order is not known yet)."""
    yield from (n for _, n in self._probes)
    yield from (n for _, n in sorted(self._released))
    yield from (n for rs in self._waiting.values() for _, n in rs)

  def observe(self, row: int, length: int) -> None:
    g = self._group.get(row)
    if g is None or self._probe_of[g] != row:
      return
    self.probe_length[g] = int(length)
    for _, n in self._waiting.pop(g, []):
      heapq.heappush(self._released, (-float(length), n))

  def probe_predictions(self, rows: Sequence[int]) -> np.ndarray:
    """Each row's probe length once its group's probe finished (NaN before)."""
    return np.array([self.probe_length.get(self._group[n], np.nan) for n in rows], float)

