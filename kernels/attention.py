"""Grouped-query attention over a key/value store addressed by absolute position.

One function serves prefill (keys are the prompt itself), decode (one query
per row against the cache) and multi-token verification (k drafted queries
per row against the cache): a query at position p sees every key whose
position is <= p. Anything past a row's write position holds stale data and
is masked by that rule, which is what lets speculative decoding roll a row
back by moving its position alone.
"""

from typing import Callable

import jax
import jax.numpy as jnp

# (q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, q_pos_BxT, k_pos_BxS) -> out_BxTxHxD
AttentionFn = Callable[..., jax.Array]


def reference_attention(q_BxTxHxD, k_BxKxSxD, v_BxKxSxD, q_pos_BxT, k_pos_BxS):
  """Causal grouped-query attention by position, softmax in float32.

  Args:
    q_BxTxHxD: queries, already rotated.
    k_BxKxSxD: keys, already rotated; K divides H.
    v_BxKxSxD: values.
    q_pos_BxT: absolute position of each query.
    k_pos_BxS: absolute position of each key slot; a key is visible to a
      query when k_pos <= q_pos. Use a negative value to hide a slot.

  Returns:
    out_BxTxHxD in the dtype of `q`.
  """
  B, T, H, D = q_BxTxHxD.shape
  K = k_BxKxSxD.shape[1]
  R = H // K
  q_BxTxKxRxD = q_BxTxHxD.reshape(B, T, K, R, D)
  scores_BxKxRxTxS = jnp.einsum(
      "btkrd,bksd->bkrts", q_BxTxKxRxD, k_BxKxSxD,
      preferred_element_type=jnp.float32) * (D ** -0.5)
  visible_BxTxS = (k_pos_BxS[:, None, :] <= q_pos_BxT[:, :, None]) & (k_pos_BxS[:, None, :] >= 0)
  scores_BxKxRxTxS = jnp.where(visible_BxTxS[:, None, None], scores_BxKxRxTxS, -jnp.inf)
  probs = jax.nn.softmax(scores_BxKxRxTxS, axis=-1).astype(v_BxKxSxD.dtype)
  out_BxTxKxRxD = jnp.einsum("bkrts,bksd->btkrd", probs, v_BxKxSxD)
  return out_BxTxKxRxD.reshape(B, T, H, D).astype(q_BxTxHxD.dtype)
