"""A static-shape KV cache: one [B, K, S, D] key and value array per layer.

Slot b holds one sequence; position p of that sequence lives at index p. A
row's valid length is tracked by its owner (the decode state), not here, so
rolling a row back (rejected speculative tokens) or resuming it later
(partial rollout) needs no change to the cache. A paged layout would replace
this class behind the same `write` / `layer` interface.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax


@struct.dataclass
class KVCache:
  k: tuple  # per layer: [B, K, S, D]
  v: tuple  # per layer: [B, K, S, D]

  @classmethod
  def zeros(cls, num_layers, batch, num_kv_heads, length, head_dim, dtype) -> "KVCache":
    shape = (batch, num_kv_heads, length, head_dim)
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

  @property
  def length(self) -> int:
    return self.k[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]


def write_rows(cache_BxKxSxD, new_BxKxTxD, start_B):
  """Writes T new entries per row at positions start_B .. start_B + T - 1.

  The caller guarantees start_B + T <= S (dynamic_update_slice would clamp).
  """
  def one(row_KxSxD, new_KxTxD, start):
    return lax.dynamic_update_slice(row_KxSxD, new_KxTxD.astype(row_KxSxD.dtype), (0, start, 0))
  return jax.vmap(one)(cache_BxKxSxD, new_BxKxTxD, start_B)
