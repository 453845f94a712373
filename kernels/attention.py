"""Grouped-query attention for prefill, decode and multi-token verification.

Keys are addressed by absolute position: a query at position p sees every key
whose position is <= p. With a KV cache, attention runs over two blocks: the
cache entries that precede the new tokens (positions < start of the row) and
the new tokens themselves (causally), with one softmax over both. Reading the
cache before the new keys are written keeps the write off the critical path,
and anything at or past a row's start position is never read: a speculative
decoder rolls a row back by moving its position, and a partial rollout
resumes a row by prefilling up to where it stopped.

Keys arrive as [B, K, D, S] (the cache's layout, see jaxroll.model.kv_cache)
and values as [B, K, S, D], so both matmuls read a plain row-major
right-hand side.
"""

from typing import Callable

import jax.numpy as jnp

# (q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS, [k2, v2, k2_pos]) -> out_BxTxHxD
AttentionFn = Callable[..., jnp.ndarray]


def reference_attention(q_BxTxHxD, k_BxKxDxS, v_BxKxSxD, q_pos_BxT, k_pos_BxS,
                        k2_BxKxDxT=None, v2_BxKxTxD=None, k2_pos_BxT=None):
  """Causal grouped-query attention by position, softmax in float32.

  Args:
    q_BxTxHxD: queries, already rotated.
    k_BxKxDxS, v_BxKxSxD: first key/value block (the cache, or the sequence
      itself when there is no cache); K divides H.
    q_pos_BxT: absolute position of each query.
    k_pos_BxS: position of each key of the first block; a key is visible
      when 0 <= k_pos <= q_pos (a negative position hides it).
    k2_BxKxDxT, v2_BxKxTxD, k2_pos_BxT: optional second block (the new
      tokens when attending over a cache), same visibility rule.

  Returns:
    out_BxTxHxD in the dtype of `q`.
  """
  B, T, H, D = q_BxTxHxD.shape
  K = k_BxKxDxS.shape[1]
  q_BxKxRxTxD = q_BxTxHxD.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
  blocks = [(k_BxKxDxS, v_BxKxSxD, k_pos_BxS)]
  if k2_BxKxDxT is not None:
    blocks.append((k2_BxKxDxT, v2_BxKxTxD, k2_pos_BxT))
  scores = []
  for k, _, k_pos in blocks:
    visible_BxTxS = (k_pos[:, None, :] <= q_pos_BxT[:, :, None]) & (k_pos[:, None, :] >= 0)
    s = jnp.einsum("bkrtd,bkds->bkrts", q_BxKxRxTxD, k.astype(q_BxKxRxTxD.dtype),
                   preferred_element_type=jnp.float32) * (D ** -0.5)
    scores.append(jnp.where(visible_BxTxS[:, None, None], s, -jnp.inf))
  # One softmax over the blocks: shared max, summed normaliser.
  m = scores[0].max(axis=-1, keepdims=True)
  for s in scores[1:]:
    m = jnp.maximum(m, s.max(axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  total, out = 0.0, 0.0
  for s, (_, v, _) in zip(scores, blocks):
    p = jnp.exp(s - m)
    total = total + p.sum(axis=-1, keepdims=True)
    out = out + jnp.einsum("bkrts,bksd->bkrtd", p.astype(q_BxTxHxD.dtype), v.astype(q_BxTxHxD.dtype),
                           preferred_element_type=jnp.float32)
  out_BxKxRxTxD = out / total
  return out_BxKxRxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BxTxHxD.dtype)
