"""Ragged attention over a paged KV cache: a Pallas kernel, an XLA path, a reference.

The cache is a pool of pages per layer: keys [N, K, D, P] and values
[N, K, P, D] (page p, KV head h, P positions each; keys transposed as in the
dense cache, see jaxroll.model.kv_cache). A row's page table maps its logical
page j (positions jP .. jP + P - 1) to a physical page. Each (row, KV head)
reads a list of logical pages, `pages_BxKxJ`, of which the first `n_BxK`
count: every live page for dense attention, a selection of them for sparse
decoding (jaxroll.kernels.quest). A query at position p sees the keys at
positions <= p of the pages it reads. Several queries per row (T > 1) serve
speculative verification; the R = H / K query heads of a KV head share its
pages (grouped-query attention).

Three implementations of one function:
  * `paged_attention_reference`: gathers the listed pages into a dense block
    and runs a masked softmax. Plain and obviously right: the oracle.
  * `paged_attention_xla`: the engine's path on CPU. Work items are
    (row, KV head, listed page) triples, processed C at a time in a
    `while_loop` whose trip count follows the number of listed pages, with
    an online softmax per (row, head): it reads only the pages a row lists,
    so short rows cost little beside long ones.
  * `paged_attention` (Pallas): one program per (row, KV head) that loops
    over its own pages, with an online softmax; for GPU (Triton). Tests run
    it in interpret mode against the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30  # finite stand-in for -inf in running maxima


def _group_queries(q_BxTxHxD, K):
  """[B, T, H, D] -> [B, K, T*R, D]: the queries that read KV head h together."""
  B, T, H, D = q_BxTxHxD.shape
  R = H // K
  return q_BxTxHxD.reshape(B, T, K, R, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * R, D)


def _ungroup(out_BxKxTRxD, T):
  B, K, TR, D = out_BxKxTRxD.shape
  R = TR // T
  return out_BxKxTRxD.reshape(B, K, T, R, D).transpose(0, 2, 1, 3, 4).reshape(B, T, K * R, D)


def paged_attention_reference(q_BxTxHxD, k_pages_NxKxDxP, v_pages_NxKxPxD, table_BxM,
                              q_pos_BxT, pages_BxKxJ, n_BxK):
  """Causal grouped-query attention over the listed pages of each row.

  Args:
    q_BxTxHxD: rotated queries.
    k_pages_NxKxDxP, v_pages_NxKxPxD: one layer's page pool.
    table_BxM: physical page of each row's logical page.
    q_pos_BxT: absolute position of each query.
    pages_BxKxJ: logical pages each (row, KV head) reads; entries at or past
      n_BxK are ignored.
    n_BxK: how many of them count.

  Returns:
    out_BxTxHxD in the dtype of `q`; a query that sees no key gets zeros.
  """
  table_BxM, pages_BxKxJ = jnp.asarray(table_BxM), jnp.asarray(pages_BxKxJ)
  B, T, H, D = q_BxTxHxD.shape
  K, P = k_pages_NxKxDxP.shape[1], k_pages_NxKxDxP.shape[3]
  J = pages_BxKxJ.shape[-1]
  q = _group_queries(q_BxTxHxD, K).astype(jnp.float32)  # [B, K, TR, D]
  R = H // K
  phys_BxKxJ = jnp.take_along_axis(table_BxM[:, None, :], pages_BxKxJ, axis=2)
  h = jnp.arange(K)[None, :, None]
  k = k_pages_NxKxDxP[phys_BxKxJ, h].astype(jnp.float32)  # [B, K, J, D, P]
  v = v_pages_NxKxPxD[phys_BxKxJ, h].astype(jnp.float32)  # [B, K, J, P, D]
  s = jnp.einsum("bkqd,bkjdp->bkqjp", q, k) * (D ** -0.5)
  k_pos = pages_BxKxJ[..., None] * P + jnp.arange(P)  # [B, K, J, P]
  q_pos = jnp.repeat(q_pos_BxT, R, axis=1)  # [B, TR], t-major like the queries
  listed = jnp.arange(J)[None, None, :] < n_BxK[..., None]  # [B, K, J]
  visible = (k_pos[:, :, None] <= q_pos[:, None, :, None, None]) & listed[:, :, None, :, None]
  s = jnp.where(visible, s, -jnp.inf).reshape(B, K, T * R, J * P)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(jnp.isfinite(s), jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bkqs,bksd->bkqd", p, v.reshape(B, K, J * P, D)) / jnp.maximum(l, 1e-30)
  return _ungroup(o, T).astype(q_BxTxHxD.dtype)


def paged_attention_xla(q_BxTxHxD, k_pages_NxKxDxP, v_pages_NxKxPxD, table_BxM, q_pos_BxT,
                        pages_BxKxJ, n_BxK, *, chunk: int = 64):
  """`paged_attention_reference` reading only the listed pages, `chunk` at a time."""
  (q_BxTxHxD, k_pages_NxKxDxP, v_pages_NxKxPxD, table_BxM, q_pos_BxT, pages_BxKxJ, n_BxK) = map(
      jnp.asarray, (q_BxTxHxD, k_pages_NxKxDxP, v_pages_NxKxPxD, table_BxM, q_pos_BxT,
                    pages_BxKxJ, n_BxK))
  B, T, H, D = q_BxTxHxD.shape
  K, P = k_pages_NxKxDxP.shape[1], k_pages_NxKxDxP.shape[3]
  R = H // K
  TR = T * R
  W = B * K  # (row, head) segments
  q_WxQxD = _group_queries(q_BxTxHxD, K).reshape(W, TR, D).astype(jnp.float32) * (D ** -0.5)
  q_pos_WxQ = jnp.broadcast_to(jnp.repeat(q_pos_BxT, R, axis=1)[:, None], (B, K, TR)).reshape(W, TR)
  n_W = n_BxK.reshape(W).astype(jnp.int32)
  end_W = jnp.cumsum(n_W)
  start_W = end_W - n_W
  total = end_W[-1]
  pages_WxJ = pages_BxKxJ.reshape(W, -1)
  row_W = jnp.arange(W) // K
  head_W = jnp.arange(W) % K

  def body(carry):
    i, m_WxQ, l_WxQ, o_WxQxD = carry
    item_C = i * chunk + jnp.arange(chunk)
    valid_C = item_C < total
    seg_C = jnp.clip(jnp.searchsorted(end_W, item_C, side="right"), 0, W - 1)
    logical_C = pages_WxJ[seg_C, jnp.clip(item_C - start_W[seg_C], 0, pages_WxJ.shape[1] - 1)]
    phys_C = table_BxM[row_W[seg_C], logical_C]
    k_CxDxP = k_pages_NxKxDxP[phys_C, head_W[seg_C]].astype(jnp.float32)
    v_CxPxD = v_pages_NxKxPxD[phys_C, head_W[seg_C]].astype(jnp.float32)
    s_CxQxP = jnp.einsum("cqd,cdp->cqp", q_WxQxD[seg_C], k_CxDxP)
    k_pos_CxP = logical_C[:, None] * P + jnp.arange(P)
    visible = (k_pos_CxP[:, None, :] <= q_pos_WxQ[seg_C][:, :, None]) & valid_C[:, None, None]
    s_CxQxP = jnp.where(visible, s_CxQxP, _NEG)
    m_CxQ = jnp.max(s_CxQxP, axis=-1)
    # Items of one segment merge by scatter: the new running max first,
    # then every partial sum rescaled to it.
    seg_or_drop = jnp.where(valid_C, seg_C, W)
    m_new = m_WxQ.at[seg_or_drop].max(m_CxQ, mode="drop")
    p_CxQxP = jnp.where(visible, jnp.exp(s_CxQxP - m_new[seg_C][:, :, None]), 0.0)
    scale_WxQ = jnp.exp(m_WxQ - m_new)
    l_new = (l_WxQ * scale_WxQ).at[seg_or_drop].add(jnp.sum(p_CxQxP, axis=-1), mode="drop")
    o_new = (o_WxQxD * scale_WxQ[..., None]).at[seg_or_drop].add(
        jnp.einsum("cqp,cpd->cqd", p_CxQxP, v_CxPxD), mode="drop")
    return i + 1, m_new, l_new, o_new

  init = (jnp.int32(0), jnp.full((W, TR), _NEG, jnp.float32), jnp.zeros((W, TR), jnp.float32),
          jnp.zeros((W, TR, D), jnp.float32))
  _, _, l, o = jax.lax.while_loop(lambda c: c[0] * chunk < total, body, init)
  o = o / jnp.maximum(l, 1e-30)[..., None]
  return _ungroup(o.reshape(B, K, TR, D), T).astype(q_BxTxHxD.dtype)


def _paged_kernel(q_ref, qpos_ref, k_ref, v_ref, table_ref, pages_ref, n_ref, o_ref, *, page: int):
  b, h = pl.program_id(0), pl.program_id(1)
  q = q_ref[b, h].astype(jnp.float32)  # [TR, D]
  q_pos = qpos_ref[b, :]  # [TR]
  TR, D = q.shape
  q = q * (D ** -0.5)

  def body(j, carry):
    m, l, o = carry
    logical = pages_ref[b, h, j]
    phys = table_ref[b, logical]
    k = k_ref[phys, h].astype(jnp.float32)  # [D, P]
    v = v_ref[phys, h].astype(jnp.float32)  # [P, D]
    s = jnp.dot(q, k)
    k_pos = logical * page + jax.lax.broadcasted_iota(jnp.int32, (TR, page), 1)
    visible = k_pos <= q_pos[:, None]
    s = jnp.where(visible, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    scale = jnp.exp(m - m_new)
    return m_new, l * scale + jnp.sum(p, axis=1), o * scale[:, None] + jnp.dot(p, v)

  init = (jnp.full((TR,), _NEG, jnp.float32), jnp.zeros((TR,), jnp.float32),
          jnp.zeros((TR, D), jnp.float32))
  _, l, o = jax.lax.fori_loop(0, n_ref[b, h], body, init)
  o_ref[b, h] = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_attention(q_BxTxHxD, k_pages_NxKxDxP, v_pages_NxKxPxD, table_BxM, q_pos_BxT,
                    pages_BxKxJ, n_BxK, *, interpret: bool = False):
  """`paged_attention_reference` as a Pallas kernel: a program per (row, KV head)
  loops over its `n` listed pages. `interpret=True` runs it on CPU for tests."""
  B, T, H, D = q_BxTxHxD.shape
  K, P = k_pages_NxKxDxP.shape[1], k_pages_NxKxDxP.shape[3]
  R = H // K
  q = _group_queries(q_BxTxHxD, K)
  q_pos = jnp.repeat(q_pos_BxT.astype(jnp.int32), R, axis=1)
  out = pl.pallas_call(
      functools.partial(_paged_kernel, page=P),
      grid=(B, K),
      out_shape=jax.ShapeDtypeStruct((B, K, T * R, D), q_BxTxHxD.dtype),
      interpret=interpret,
  )(q, q_pos, k_pages_NxKxDxP, v_pages_NxKxPxD, table_BxM.astype(jnp.int32),
    pages_BxKxJ.astype(jnp.int32), n_BxK.astype(jnp.int32))
  return _ungroup(out, T)
