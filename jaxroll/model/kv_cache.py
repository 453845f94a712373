"""A static-shape KV cache: per layer, keys [B, K, D, S] and values [B, K, S, D].

Keys are stored transposed so that the decode-time score matmul q . k reads
them as a plain [D, S] right-hand side; with [S, D] keys XLA's CPU backend
copied (re-laid out) every layer's whole cache on every step.

Slot b holds one sequence; position p of that sequence lives at index p. A
row's valid length is tracked by its owner (the decode state), not here, so
rolling a row back (rejected speculative tokens) or resuming it later
(partial rollout) needs no change to the cache.

The model sees a cache through `layer(i)` (an object whose `attend` writes
the new entries and attends) and `with_layers`; the paged cache
(jaxroll.model.paged_kv_cache) implements the same three, plus the page
bookkeeping (`reserve`, `release`) that is a no-op here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax


@struct.dataclass
class KVCache:
  k: tuple  # per layer: [B, K, D, S]
  v: tuple  # per layer: [B, K, S, D]

  @classmethod
  def zeros(cls, num_layers, batch, num_kv_heads, length, head_dim, dtype) -> "KVCache":
    k_shape = (batch, num_kv_heads, head_dim, length)
    v_shape = (batch, num_kv_heads, length, head_dim)
    return cls(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers)))

  def layer(self, i: int) -> "_DenseLayer":
    return _DenseLayer(self.k[i], self.v[i])

  def with_layers(self, layers) -> "KVCache":
    """The cache with its first len(layers) layers replaced (all of them
    after a full forward; a prefix after an early-exit one)."""
    n = len(layers)
    return KVCache(k=tuple(l[0] for l in layers) + self.k[n:],
                   v=tuple(l[1] for l in layers) + self.v[n:])

  def reserve(self, pos_B, num_tokens: int, live_B):
    """Every slot owns its S positions: nothing to allocate."""
    return self, jnp.ones_like(live_B)

  def release(self, rows_B):
    return self


class _DenseLayer:
  """One layer of a KVCache as the attention module uses it."""

  def __init__(self, k, v):
    self.k, self.v = k, v

  def attend(self, q_BxTxHxD, k_new_BxKxDxT, v_new_BxKxTxD, positions_BxT, attention_fn):
    """Writes the new keys and values at their positions, then attends over
    the whole cache (entries past each query's position are hidden)."""
    new_kv = write_kv((self.k, self.v), k_new_BxKxDxT, v_new_BxKxTxD, positions_BxT[:, 0])
    B, S = positions_BxT.shape[0], new_kv[1].shape[2]
    k_pos_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
    return attention_fn(q_BxTxHxD, new_kv[0], new_kv[1], positions_BxT, k_pos_BxS), new_kv


def write_rows(cache, new, start_B, seq_axis: int):
  """Writes T new entries per row at positions start_B .. start_B + T - 1.

  Args:
    cache: [B, ...] with the sequence on `seq_axis` (3 for keys, 2 for values).
    new: like `cache` with T entries on `seq_axis`.
    start_B: first position written in each row. The caller guarantees
      start_B + T <= S (dynamic_update_slice would clamp).
  """
  def one(row, new_row, start):
    idx = [0] * row.ndim
    idx[seq_axis - 1] = start
    return lax.dynamic_update_slice(row, new_row.astype(row.dtype), tuple(idx))
  return jax.vmap(one)(cache, new, start_B)


def write_kv(cache_kv, k_new_BxKxDxT, v_new_BxKxTxD, start_B):
  """Writes one layer's new keys and values; returns the updated (k, v)."""
  k_cache, v_cache = cache_kv
  return (write_rows(k_cache, k_new_BxKxDxT, start_B, seq_axis=3),
          write_rows(v_cache, v_new_BxKxTxD, start_B, seq_axis=2))
