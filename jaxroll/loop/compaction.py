"""The rows an update runs over: those it trains on, in a few static row counts.

Techniques that draw more rows per group than they keep (PODS keeps G of
2G; VIGOR and VIP give some prompts more rows and others fewer) lay a step
out as P groups of S > G rows, most of which carry no loss. Updating over
all P x S rows would cost what the technique saved. Instead the update
takes the rows with a loss token, in batch order, padded with the
shortest rows without one up to the next multiple of `bucket` (P x G: what
uniform GRPO updates over), so it compiles for a handful of row counts
and costs what the kept rows cost. The padding rows carry no loss token,
so they change no gradient.
"""

from __future__ import annotations

import numpy as np


def rows_for_update(in_loss_N: np.ndarray, length_N: np.ndarray, bucket: int) -> np.ndarray:
  """Sorted row indices: every row with `in_loss_N`, plus the shortest rows
  without it until the count is a multiple of `bucket` (at least `bucket`,
  at most every row)."""
  in_loss_N = np.asarray(in_loss_N, bool)
  N = in_loss_N.shape[0]
  kept = np.flatnonzero(in_loss_N)
  target = min(N, max(bucket, -(-len(kept) // bucket) * bucket))
  others = np.flatnonzero(~in_loss_N)
  pad = others[np.argsort(np.asarray(length_N)[others], kind="stable")][:max(0, target - len(kept))]
  return np.sort(np.concatenate([kept, pad]))
