"""grain pipelines over a task's examples: seeded shuffling, repetition, batching.

The pipelines yield index batches into an in-memory example list (tasks are
small next to their rollouts). Their iterator state is a small dict that the
checkpoint stores, so a resumed run draws exactly the batches it would have.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np


class IndexBatches:
  """An endless, checkpointable stream of index batches into `num_examples` rows.

  Each epoch is a fresh permutation drawn from `seed` (grain's `shuffle`
  before `repeat`); a batch may span an epoch boundary, so no row is dropped.

  Example:
    batches = IndexBatches(num_examples=1000, batch_size=16, seed=0)
    idx = next(batches)          # int array of 16 row indices
    saved = batches.get_state()  # JSON-serialisable
  """

  def __init__(self, num_examples: int, batch_size: int, seed: int):
    if num_examples <= 0:
      raise ValueError("the dataset is empty")
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    dataset = (grain.MapDataset.range(num_examples).shuffle(seed=seed).repeat()
               .batch(batch_size, drop_remainder=True))
    self._iter = iter(dataset.to_iter_dataset())

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    return np.asarray(next(self._iter), np.int64)

  def get_state(self) -> dict[str, Any]:
    return self._iter.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._iter.set_state(state)
