"""Per-row decode work over the live rows only.

The engine's B slots share one static-shape cache, and a step's attention
reads every slot's S positions whether or not the slot still decodes. In a
long-tailed batch most steps run with few rows live (on the default
reasoning task, about a fifth of the slots on average over a rollout), so
most of that read is wasted, and so is a speculative drafter's search over
every slot's text. `per_live_row` gathers the live rows into the smallest
of a few static row buckets (B, B/2, .. B/16, never below 2), runs a
per-row function there, and scatters its outputs back; rows that are not
live get zeros (row 0 fills a bucket's spare places), and no caller uses
them. Decode attention (`live_rows_attention`) and drafting
(jaxroll.rollout.speculative.draft) run this way.

Drafts are integers, the same in every bucket. Attention is float: a row's
output is the whole batch's within float32 rounding. At the default
policy's decode shape it is the same bits (tested for plain steps and
verifying passes); at small shapes XLA:CPU picks its matmul path by the
batch's size, so the last bit may differ, as it already does between two
engines with different slot counts. One row alone is never a bucket: that
is a matrix-vector path even at the default shape.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxroll.kernels.attention import AttentionFn, reference_attention
from jaxroll.model.kv_cache import KVCache

MIN_ROWS = 2  # the smallest bucket (see the module docstring)
NUM_BUCKETS = 5  # B, B/2, B/4, B/8, B/16


def bucket_sizes(num_slots: int) -> list[int]:
  """The row buckets for `num_slots` slots, smallest first (the last is B)."""
  sizes = [num_slots]
  while len(sizes) < NUM_BUCKETS and sizes[-1] % 2 == 0 and sizes[-1] // 2 >= MIN_ROWS:
    sizes.append(sizes[-1] // 2)
  return sizes[::-1]


def per_live_row(live_B, fn: Callable[[Optional[jax.Array]], object]):
  """`fn(rows_M)` for the live rows, in a bucket that holds them.

  `fn` takes the rows to compute (int32 [M] slot indices, or None for every
  slot in order) and returns a pytree of per-row arrays [M, ...]; the
  result is that pytree with [B, ...] arrays, zero where no row was computed.
  """
  B = live_B.shape[0]
  sizes = bucket_sizes(B)
  if len(sizes) == 1:
    return fn(None)
  n = jnp.sum(live_B.astype(jnp.int32))
  branch = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), n), len(sizes) - 1)
  # Live rows first; the rest of a bucket repeats row 0, whose output is
  # then written twice with the same value.
  rows_B = jnp.nonzero(live_B, size=B, fill_value=0)[0].astype(jnp.int32)

  def in_bucket(M: int):
    if M == B:
      return lambda: fn(None)

    def run():
      r = rows_B[:M]
      return jax.tree.map(lambda x: jnp.zeros((B,) + x.shape[1:], x.dtype).at[r].set(x), fn(r))
    return run

  return jax.lax.switch(branch, [in_bucket(M) for M in sizes])


def live_rows_attention(live_B, attention_fn: AttentionFn = reference_attention) -> AttentionFn:
  """`attention_fn` computed for the rows where `live_B` holds; an
  AttentionFn over the whole batch."""
  def attend(q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS):
    def rows_attention(r):
      if r is None:
        return attention_fn(q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS)
      return attention_fn(q_BxTxHxD[r], k_BxKxDxS[r], v_BxKxSxD[r], q_pos_BxT[r], k_pos_BxS[r])
    return per_live_row(live_B, rows_attention)
  return attend


def step_attention(cache, live_B, live_rows: bool) -> AttentionFn:
  """The attention a decode step runs over `cache`: the live rows only when
  `live_rows` is asked for and the cache is the dense one (a paged cache
  already reads only each row's own pages)."""
  if live_rows and isinstance(cache, KVCache):
    return live_rows_attention(live_B)
  return reference_attention
