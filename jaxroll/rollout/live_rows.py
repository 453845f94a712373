"""Decode work over the live part of the batch: its live rows, and the cache
positions they have reached.

The engine's B slots share one static-shape cache, and a step's attention
reads every slot's S positions whether or not the slot still decodes and
however far it has got. In a long-tailed batch most steps run with few rows
live (on the default reasoning task, about a fifth of the slots on average
over a rollout), and most rows end far short of S, so most of that read is
wasted, and so is a speculative drafter's search over every slot's text.

Rows: `per_live_row` gathers the live rows into the smallest of a few
static row buckets (B, B/2, .. B/16, never below 2), runs a per-row
function there, and scatters its outputs back; rows that are not live get
zeros (row 0 fills a bucket's spare places), and no caller uses them.
Drafting (jaxroll.rollout.speculative.draft) runs this way; a decode
step's whole forward pass runs over the same buckets
(jaxroll.rollout.live_forward), its attention as `live_attention` does.

Positions: position p of a row lives at cache index p, and a query sees
only keys at positions <= its own, so attention over the first W indices,
W past every live query's position, is attention over all S. The window
is the smallest of a few static sizes (S, S/2, S/4, S/8 rounded up to a
multiple of 16, never below 64) that holds the live rows' furthest query.

Drafts are integers, the same in every bucket. Attention is float: a row's
output is the whole batch's within float32 rounding, not bitwise. XLA:CPU
picks its matmul path by the batch's size and its reduction blocking by
the reduced length, so the last bit of a row's output can depend on how
many rows are live and on the window, which its batch mates' positions set.
Row buckets alone keep the same bits at the default policy's decode shape
(tested); windows do not. The sampled distribution is the same either way,
and the behaviour log-probs are those of the pass that sampled. For rows
whose bits do not depend on their batch mates, turn both off
(`RolloutEngine(live_rows=False, cache_window=False)`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxroll.kernels.attention import AttentionFn, reference_attention
from jaxroll.model.kv_cache import KVCache

MIN_ROWS = 2  # the smallest bucket (see the module docstring)
NUM_BUCKETS = 5  # B, B/2, B/4, B/8, B/16
# Windows: S, S/2, S/4, S/8, multiples of WINDOW_ALIGN, never below
# MIN_WINDOW (shorter reads save less than a switch costs).
NUM_WINDOWS = 4
MIN_WINDOW = 64
WINDOW_ALIGN = 16


class LiveDecode(NamedTuple):
  """What a decode step restricts its work to (both: the engine's default)."""
  rows: bool = False  # the live rows' bucket (the forward pass and drafting)
  window: bool = False  # the cache positions the live rows have reached (attention)


def bucket_sizes(num_slots: int) -> list[int]:
  """The row buckets for `num_slots` slots, smallest first (the last is B)."""
  sizes = [num_slots]
  while len(sizes) < NUM_BUCKETS and sizes[-1] % 2 == 0 and sizes[-1] // 2 >= MIN_ROWS:
    sizes.append(sizes[-1] // 2)
  return sizes[::-1]


def window_sizes(cache_len: int) -> list[int]:
  """The attention windows for a cache of `cache_len` positions, smallest
  first (the last is the whole cache)."""
  sizes = [cache_len]
  while len(sizes) < NUM_WINDOWS:
    half = -(-sizes[-1] // 2 // WINDOW_ALIGN) * WINDOW_ALIGN
    if half < MIN_WINDOW or half >= sizes[-1]:
      break
    sizes.append(half)
  return sizes[::-1]


def smallest_holding(sizes: list[int], n):
  """Index of the smallest of `sizes` (ascending) that holds `n`, the last
  when none does: which row bucket or cache window a step takes."""
  return jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), n), len(sizes) - 1)


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
  branch = smallest_holding(sizes, n)
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


def live_attention(live_B, live: LiveDecode,
                   attention_fn: AttentionFn = reference_attention) -> AttentionFn:
  """`attention_fn` over the live part of the batch (`live`: its rows, its
  positions, or both); an AttentionFn over the whole batch whose rows that
  are not live hold no meaningful output."""
  def attend(q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS):
    S = k_BxKxDxS.shape[-1]
    sizes = window_sizes(S) if live.window else [S]
    # The furthest position a live query reaches; keys past it are hidden.
    reach = jnp.max(jnp.where(live_B, q_pos_BxT[:, -1], 0)) + 1
    window = smallest_holding(sizes, reach)

    def rows_attention(r):
      def in_window(W: int):
        # One indexing expression per (rows, window): XLA gathers the
        # window's part of the live rows in one pass.
        if r is None and W == S:
          return lambda: attention_fn(q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS)
        if r is None:
          return lambda: attention_fn(q_BxTxHxD, k_BxKxDxS[..., :W], v_BxKxSxD[:, :, :W],
                                      q_pos_BxT, k_pos_BxS[:, :W])
        return lambda: attention_fn(q_BxTxHxD[r], k_BxKxDxS[r, :, :, :W], v_BxKxSxD[r, :, :W],
                                    q_pos_BxT[r], k_pos_BxS[r, :W])
      if len(sizes) == 1:
        return in_window(S)()
      return jax.lax.switch(window, [in_window(W) for W in sizes])

    if live.rows:
      return per_live_row(live_B, rows_attention)
    return rows_attention(None)
  return attend


def step_attention(cache, live_B, live: LiveDecode) -> AttentionFn:
  """The attention a decode step runs over `cache`: over the live part
  `live` asks for when the cache is the dense one (a paged cache already
  reads only each row's own pages)."""
  if (live.rows or live.window) and isinstance(cache, KVCache):
    return live_attention(live_B, live)
  return reference_attention
