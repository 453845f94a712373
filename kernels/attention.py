"""Grouped-query attention for prefill, decode and multi-token verification.

Keys are addressed by absolute position: a query at position p sees every key
whose position is <= p. With a KV cache the new tokens' keys are written
first and the queries then attend over the whole cache; entries past a row's
current position hold stale data and stay hidden by that rule, so a
speculative decoder rolls a row back by moving its position, and a partial
rollout resumes a row by prefilling up to where it stopped.

Keys arrive as [B, K, D, S] (the cache's layout, see jaxroll.model.kv_cache)
and values as [B, K, S, D], so both matmuls read a plain row-major
right-hand side.

Writing before reading matters for speed: attending over the old cache while
writing a new one forced XLA to copy every layer's cache on every step.
"""

from typing import Callable

import jax
import jax.numpy as jnp

# (q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS) -> out_BxTxHxD
AttentionFn = Callable[..., jnp.ndarray]


def reference_attention(q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS):
  """Causal grouped-query attention by position, softmax in float32.

  Args:
    q_BxTxHxD: queries, already rotated.
    k_BxKxDxS, v_BxKxSxD: keys and values (the cache, or the sequence itself
      when there is no cache); K divides H.
    q_pos_BxT: absolute position of each query.
    k_pos_BxS: position of each key; a key is visible when
      0 <= k_pos <= q_pos (a negative position hides it).

  Returns:
    out_BxTxHxD in the dtype of `q`.
  """
  B, T, H, D = q_BxTxHxD.shape
  K = k_BxKxDxS.shape[1]
  q_BxKxRxTxD = q_BxTxHxD.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
  visible_BxTxS = (k_pos_BxS[:, None, :] <= q_pos_BxT[:, :, None]) & (k_pos_BxS[:, None, :] >= 0)
  scores = jnp.einsum("bkrtd,bkds->bkrts", q_BxKxRxTxD, k_BxKxDxS.astype(q_BxKxRxTxD.dtype),
                      preferred_element_type=jnp.float32) * (D ** -0.5)
  scores = jnp.where(visible_BxTxS[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_BxTxHxD.dtype)
  out_BxKxRxTxD = jnp.einsum("bkrts,bksd->bkrtd", probs, v_BxKxSxD.astype(q_BxTxHxD.dtype),
                             preferred_element_type=jnp.float32)
  return out_BxKxRxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BxTxHxD.dtype)
