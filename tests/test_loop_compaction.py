"""The update runs over the rows it trains on (jaxroll.loop.compaction)."""

import itertools
import json
import os

import numpy as np
import pytest

from jaxroll.loop.compaction import rows_for_update
from jaxroll.types import Trajectories


def _brute_force(in_loss, length, bucket):
  """The smallest row set holding every loss row whose size is a multiple of
  bucket (or every row), padded by the shortest others: by enumeration."""
  N = len(in_loss)
  kept = {n for n in range(N) if in_loss[n]}
  sizes = [s for s in range(len(kept), N + 1) if (s % bucket == 0 and s >= bucket) or s == N]
  size = sizes[0]
  others = [n for n in range(N) if not in_loss[n]]
  best = min(itertools.combinations(others, size - len(kept)),
             key=lambda c: (sorted(length[n] for n in c), c))
  return sorted(kept | set(best))


def test_rows_for_update_matches_brute_force_on_small_cases():
  rng = np.random.default_rng(0)
  for _ in range(200):
    N = int(rng.integers(1, 9))
    bucket = int(rng.integers(1, 5))
    in_loss = rng.random(N) < rng.random()
    length = rng.integers(0, 4, N)
    got = rows_for_update(in_loss, length, bucket).tolist()
    want = _brute_force(in_loss, length, bucket)
    # Ties in length may pick different rows: the kept set and the padding's lengths agree.
    assert len(got) == len(want) and set(np.flatnonzero(in_loss)) <= set(got)
    assert sorted(length[got]) == sorted(length[want])
    assert got == sorted(got)


def test_every_row_is_kept_when_all_train():
  np.testing.assert_array_equal(rows_for_update(np.ones(32, bool), np.arange(32), 32), np.arange(32))


def test_trajectories_take_keeps_each_rows_fields():
  N, L = 4, 3
  t = Trajectories(np.arange(N) // 2, np.arange(N) % 2, np.arange(N * L).reshape(N, L),
                   np.ones((N, L), np.float32), np.zeros((N, L), np.int32), np.zeros((N, L), np.int32),
                   np.array([1, 2, 3, 0]), np.array([1, 2, 1, 3]))
  s = t.take(np.array([3, 1]))
  np.testing.assert_array_equal(s.tokens_NxL, t.tokens_NxL[[3, 1]])
  np.testing.assert_array_equal(s.prompt_index_N, [1, 0])
  assert s.row(1) == t.row(1)


@pytest.fixture(scope="module")
def pods_and_grpo(tmp_path_factory):
  from test_training import train_once

  common = ["steps=3", "eval_every=3", "report=false"]
  return (train_once(tmp_path_factory, "pods", *common, "algorithm.techniques=pods"),
          train_once(tmp_path_factory, "grpo", *common))


def _steps(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(x) for x in f][1:]


def test_pods_updates_over_the_rows_it_keeps(pods_and_grpo):
  pods, grpo = (_steps(d) for d in pods_and_grpo)
  # tiny: 4 prompts x 4 samples; PODS draws 8 per prompt and keeps 4.
  assert all(m["rollouts_generated"] == 32 for m in pods)
  assert all(m["update_rows"] == 16 for m in pods + grpo)
  assert all(m["trajectories_selected_out"] == 16 for m in pods)
