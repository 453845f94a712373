"""Response-length prediction from each prompt's history (RhymeRL's signal).

A prompt's next response length is predicted as the mean of its last `k`
observed lengths; a prompt never seen falls back to the mean over all
lengths seen so far (or `default` before any). The predictor is host-side
state (a dict of short deques): it sees a few hundred prompts per step.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np


class HistoryLengthPredictor:
  def __init__(self, window: int = 4, default: float = 0.0):
    if window < 1:
      raise ValueError(f"window must be >= 1, got {window}")
    self.window = window
    self.default = default
    self._history: dict[int, collections.deque] = {}
    self._total = 0.0
    self._count = 0

  def predict(self, prompt_ids: Sequence[int]) -> np.ndarray:
    fallback = self._total / self._count if self._count else self.default
    h = self._history
    return np.array([sum(h[p]) / len(h[p]) if p in h else fallback for p in prompt_ids], float)

  def known(self, prompt_ids: Sequence[int]) -> np.ndarray:
    """Whether each prompt has a history (else `predict` returned the fallback)."""
    return np.array([int(p) in self._history for p in prompt_ids], bool)

  def observe(self, prompt_ids: Sequence[int], lengths: Sequence[float]) -> None:
    for p, n in zip(prompt_ids, lengths):
      self._history.setdefault(int(p), collections.deque(maxlen=self.window)).append(float(n))
      self._total += float(n)
      self._count += 1

  def state_dict(self) -> dict:
    return {"history": [[p, list(h)] for p, h in self._history.items()],
            "total": self._total, "count": self._count}

  def load_state_dict(self, state: dict) -> None:
    self._history = {int(p): collections.deque(h, maxlen=self.window) for p, h in state["history"]}
    self._total, self._count = float(state["total"]), int(state["count"])


def prediction_error(predicted: Sequence[float], realised: Sequence[float]) -> dict[str, float]:
  """Mean absolute error and Spearman rank correlation (average ranks for ties)."""
  predicted, realised = np.asarray(predicted, float), np.asarray(realised, float)
  mae = float(np.abs(predicted - realised).mean())
  rp, rr = _ranks(predicted), _ranks(realised)
  if rp.std() == 0 or rr.std() == 0:
    return {"mae": mae, "spearman": float("nan")}
  return {"mae": mae, "spearman": float(np.corrcoef(rp, rr)[0, 1])}


def _ranks(x: np.ndarray) -> np.ndarray:
  order = np.argsort(x, kind="stable")
  ranks = np.empty(len(x), float)
  ranks[order] = np.arange(len(x), dtype=float)
  for v in np.unique(x):  # ties share their average rank
    tie = x == v
    ranks[tie] = ranks[tie].mean()
  return ranks
