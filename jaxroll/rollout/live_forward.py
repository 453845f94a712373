"""A decode step's forward pass and sampling over its live rows only.

`jaxroll.rollout.live_rows` restricts attention (and drafting) to the live
rows' bucket; the rest of the forward (embedding, projections, MLP, head)
still ran over all B slots. In a long-tailed batch most steps have few
rows live (on the default reasoning task about a third of the slots on
average), so most of that dense work was for rows whose output is thrown
away, and a speculative verifying pass, which runs the model over k + 1
tokens per row, paid it k + 1 times.

`live_forward` runs the model, and the sampling or verification that
follows it, on the live rows' bucket: the rows' inputs are gathered,
every layer writes its new keys and values into the full cache at those
rows (`RowsCache`) and attends over those rows' part of it (up to the
furthest position they reached, when windows are on), and the outputs
are scattered back to [B, ...] with zeros for the rows not computed.
Places in a bucket past the live rows name slot B, which reads zeros and
whose writes are dropped.

Each bucket runs in a loop of at most one trip rather than a lax.switch:
the loop's carry holds the KV cache, which XLA then updates in place,
where a conditional whose branches write it made copies of every cache
layer per step on XLA:CPU.

As with row buckets for attention, a row's numbers can differ from the
whole batch's at float32 rounding (XLA:CPU picks its matmul path by the
number of rows); the sampled distribution is the same.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxroll.kernels.attention import AttentionFn, reference_attention
from jaxroll.model.kv_cache import KVCache
from jaxroll.rollout.live_rows import (LiveDecode, bucket_sizes, smallest_holding, step_attention,
                                       window_sizes)

# (rows_N, cache, attention_fn) -> (out_N, cache); see `live_forward`
RowsFn = Callable


def once_if(pred, fn, carry, inputs=None):
  """`fn(carry)` when `pred`, else `carry`, as a loop of at most one trip
  (a carry holding the KV cache is then updated in place).

  With `inputs`, `fn(carry, inputs)`. They reach `fn` through a select on
  the loop's trip flag (always the inputs themselves, but not a loop
  invariant): XLA hoists work that depends on loop invariants only out of
  a loop, so a forward pass over inputs fixed before the loop (its
  embedding lookup and first projections) would otherwise run on every
  decode step whether or not `pred` holds, as every row bucket's first
  layer did (seen in the optimised HLO). A `lax.optimization_barrier` on
  the flag and the inputs did not stop it on XLA:CPU; the select does.
  """
  def step(c):
    carry, entered = c
    if inputs is None:
      return fn(carry), jnp.bool_(True)
    pinned = jax.tree.map(lambda x: jnp.where(entered, jnp.zeros_like(x), x), inputs)
    return fn(carry, pinned), jnp.bool_(True)
  return jax.lax.while_loop(lambda c: pred & ~c[1], step, (carry, jnp.bool_(False)))[0]


def _scatter_positions(cache, new, rows_M, start_M, seq_axis: int):
  """Writes T new entries per row of `rows_M` at start_M .. start_M + T - 1;
  rows past the cache (slot B) are dropped."""
  T = new.shape[seq_axis]
  for t in range(T):
    entry = jnp.take(new, t, axis=seq_axis)  # [M, K, D]
    if seq_axis == 3:  # keys [B, K, D, S]
      cache = cache.at[rows_M, :, :, start_M + t].set(entry.astype(cache.dtype), mode="drop")
    else:  # values [B, K, S, D]
      cache = cache.at[rows_M, :, start_M + t, :].set(entry.astype(cache.dtype), mode="drop")
  return cache


@struct.dataclass
class RowsCache:
  """The rows `rows_M` of a dense KVCache, as the model sees a cache."""

  cache: KVCache
  rows_M: jax.Array  # int32 slot indices; B for places past the live rows
  live_M: jax.Array  # bool: the place holds a live row
  window: bool = struct.field(pytree_node=False, default=False)

  def layer(self, i: int) -> "_RowsLayer":
    return _RowsLayer(self.cache.k[i], self.cache.v[i], self.rows_M, self.live_M, self.window)

  def with_layers(self, layers) -> "RowsCache":
    return self.replace(cache=self.cache.with_layers(layers))


class _RowsLayer:

  def __init__(self, k, v, rows_M, live_M, window: bool):
    self.k, self.v, self.rows_M, self.live_M, self.window = k, v, rows_M, live_M, window

  def attend(self, q_MxTxHxD, k_new_MxKxDxT, v_new_MxKxTxD, positions_MxT, attention_fn: AttentionFn):
    r = self.rows_M
    k = _scatter_positions(self.k, k_new_MxKxDxT, r, positions_MxT[:, 0], seq_axis=3)
    v = _scatter_positions(self.v, v_new_MxKxTxD, r, positions_MxT[:, 0], seq_axis=2)
    S = k.shape[-1]
    M = r.shape[0]
    sizes = window_sizes(S) if self.window else [S]
    reach = jnp.max(jnp.where(self.live_M, positions_MxT[:, -1], 0)) + 1
    branch = smallest_holding(sizes, reach)

    def in_window(W: int):
      # One indexing expression per window: XLA gathers the rows' part of
      # the window in one pass.
      k_pos_MxW = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32)[None, :], (M, W))
      return lambda: attention_fn(q_MxTxHxD, k.at[r, :, :, :W].get(mode="fill", fill_value=0),
                                  v.at[r, :, :W].get(mode="fill", fill_value=0), positions_MxT, k_pos_MxW)

    out = in_window(S)() if len(sizes) == 1 else jax.lax.switch(branch, [in_window(W) for W in sizes])
    return out, (k, v)


def live_forward(run: RowsFn, rows, cache, live_B, live: LiveDecode):
  """`run` over the live rows' bucket when `live.rows` and the cache is
  dense, else over every slot.

  Args:
    run: (rows_N, cache, attention_fn) -> (out_N, cache), where rows_N and
      out_N are pytrees of per-row arrays [N, ...]: the forward pass and
      whatever per-row work follows it (sampling, verification), so that
      work too runs over the bucket.
    rows: the pytree of [B, ...] arrays `run` takes.

  Returns:
    (out_B, cache): `run`'s outputs as [B, ...] arrays, zero for rows it
    did not compute.
  """
  if not (live.rows and isinstance(cache, KVCache)):
    return run(rows, cache, step_attention(cache, live_B, live))
  B = live_B.shape[0]
  sizes = bucket_sizes(B)
  n = jnp.sum(live_B.astype(jnp.int32))
  branch = smallest_holding(sizes, n)
  rows_B = jnp.nonzero(live_B, size=B, fill_value=B)[0].astype(jnp.int32)
  out_shape = jax.eval_shape(lambda: run(rows, cache, reference_attention)[0])
  init = (jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out_shape), cache)

  def in_bucket(M: int):
    if M == B:
      whole = step_attention(cache, live_B, LiveDecode(window=live.window))
      return lambda carry, rows: run(rows, carry[1], whole)

    def rows_only(carry, rows):
      out, full = carry
      r = rows_B[:M]
      view = RowsCache(full, r, live_B.at[r].get(mode="fill", fill_value=False), live.window)
      rows_M = jax.tree.map(lambda x: x.at[r].get(mode="fill", fill_value=0), rows)
      out_M, view = run(rows_M, view, reference_attention)
      return jax.tree.map(lambda o, m: o.at[r].set(m, mode="drop"), out, out_M), view.cache
    return rows_only

  carry = init
  for i, M in enumerate(sizes):
    carry = once_if(branch == i, in_bucket(M), carry, inputs=rows)
  return carry
