"""grain index batches and the C(q) computation."""

import numpy as np
import pytest

from jaxroll.data import IndexBatches
from jaxroll.metrics.cost import cost_to_quality


def test_batches_are_seeded_and_cover_each_epoch():
  a = IndexBatches(10, 5, seed=1)
  first = [next(a) for _ in range(6)]  # three epochs
  b = IndexBatches(10, 5, seed=1)
  assert all(np.array_equal(x, next(b)) for x in first)
  epochs = [np.sort(np.concatenate(first[i:i + 2])) for i in (0, 2, 4)]
  assert all(np.array_equal(e, np.arange(10)) for e in epochs)
  assert not np.array_equal(np.concatenate(first[0:2]), np.concatenate(first[2:4]))
  assert not np.array_equal(first[0], next(IndexBatches(10, 5, seed=2)))


def test_iterator_state_resumes_exactly():
  a = IndexBatches(7, 3, seed=0)
  for _ in range(4):
    next(a)
  state = a.get_state()
  expected = [next(a) for _ in range(5)]
  b = IndexBatches(7, 3, seed=0)
  b.set_state(state)
  assert all(np.array_equal(x, next(b)) for x in expected)


def test_cost_to_quality_by_hand():
  quality = [0.3, 0.5, 0.45, 0.7]
  cost = [0, 10, 20, 30]
  assert cost_to_quality(quality, cost, [0.3, 0.4, 0.5, 0.6, 0.7, 0.8]) == [0, 10, 10, 30, 30, None]
  # A unit the run did not log (unit_costs: None) reaches no target.
  assert cost_to_quality(quality, None, [0.3, 0.5]) == [None, None]
  with pytest.raises(ValueError, match="must not decrease"):
    cost_to_quality([0.1, 0.2], [5, 4], [0.1])
