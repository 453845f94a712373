"""Query-aware page selection for sparse decoding (Quest), and its fixed baseline.

Every page of the paged cache (jaxroll.model.paged_kv_cache) keeps the
elementwise min and max of its keys per KV head, [N, K, D]. For a query q the
largest score any key of the page can reach is bounded by
    sum_d max(q_d * min_d, q_d * max_d),
which is Quest's page score (Tang et al., 2024). A KV head's R query heads,
and the T queries of a verifying pass, share its pages, so a page scores the
largest bound over them: a page any of them needs is kept.

Selection keeps a budget of a row's live pages per KV head: the first
`sink` pages and the last `recent` always (the attention sink and the local
window, which also holds the query's own key), the rest by score.
`streaming_pages` is StreamingLLM's fixed choice (sink plus the most recent
pages) at the same budget, the baseline that ignores the query.

`quest_scores` is a Pallas kernel (one program per row and KV head, a loop
over the row's pages) beside `quest_scores_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def quest_scores_reference(q_BxTxHxD, kmin_NxKxD, kmax_NxKxD, table_BxM, n_live_B):
  """Page scores [B, K, M]; pages at or past a row's live count score -inf."""
  B, T, H, D = q_BxTxHxD.shape
  K = kmin_NxKxD.shape[1]
  M = table_BxM.shape[1]
  q = q_BxTxHxD.reshape(B, T, K, H // K, D).astype(jnp.float32)
  lo = kmin_NxKxD[table_BxM].astype(jnp.float32)  # [B, M, K, D]
  hi = kmax_NxKxD[table_BxM].astype(jnp.float32)
  bound = jnp.maximum(q[:, :, None] * lo[:, None, :, :, None, :],
                      q[:, :, None] * hi[:, None, :, :, None, :])  # [B, T, M, K, R, D]
  s = jnp.max(jnp.sum(bound, axis=-1), axis=(1, 4))  # [B, M, K]
  s = s.transpose(0, 2, 1)
  live = jnp.arange(M)[None, None, :] < n_live_B[:, None, None]
  return jnp.where(live, s, -jnp.inf)


def _quest_kernel(q_ref, kmin_ref, kmax_ref, table_ref, n_ref, s_ref):
  b, h = pl.program_id(0), pl.program_id(1)
  q = q_ref[b, h].astype(jnp.float32)  # [TR, D]
  M = table_ref.shape[1]
  n = n_ref[b]

  def body(j, _):
    phys = table_ref[b, j]
    lo = kmin_ref[phys, h].astype(jnp.float32)  # [D]
    hi = kmax_ref[phys, h].astype(jnp.float32)
    bound = jnp.sum(jnp.maximum(q * lo[None, :], q * hi[None, :]), axis=1)
    s_ref[b, h, j] = jnp.where(j < n, jnp.max(bound), -jnp.inf)
    return 0

  jax.lax.fori_loop(0, M, body, 0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quest_scores(q_BxTxHxD, kmin_NxKxD, kmax_NxKxD, table_BxM, n_live_B, *, interpret: bool = False):
  """`quest_scores_reference` as a Pallas kernel."""
  B, T, H, D = q_BxTxHxD.shape
  K = kmin_NxKxD.shape[1]
  R = H // K
  q = q_BxTxHxD.reshape(B, T, K, R, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * R, D)
  return pl.pallas_call(
      _quest_kernel, grid=(B, K),
      out_shape=jax.ShapeDtypeStruct((B, K, table_BxM.shape[1]), jnp.float32),
      interpret=interpret,
  )(q, kmin_NxKxD, kmax_NxKxD, table_BxM.astype(jnp.int32), n_live_B.astype(jnp.int32))


def page_budget(n_live_B, fraction: float, sink: int, recent: int):
  """Pages kept per row: ceil(fraction * live), at least sink + recent, at most live."""
  want = jnp.ceil(fraction * n_live_B.astype(jnp.float32)).astype(jnp.int32)
  return jnp.minimum(jnp.maximum(want, sink + recent), n_live_B)


def select_pages(scores_BxKxM, n_live_B, *, fraction: float, sink: int, recent: int):
  """Quest's choice: (pages_BxKxM, n_BxK), the first n listed pages are kept."""
  B, K, M = scores_BxKxM.shape
  j = jnp.arange(M)[None, None, :]
  n = n_live_B[:, None, None]
  forced = (j < sink) | ((j >= n - recent) & (j < n))
  keyed = jnp.where(forced, jnp.inf, jnp.where(j < n, scores_BxKxM, -jnp.inf))
  # Ties (forced pages) go to the lower index, so the list is deterministic.
  _, pages = jax.lax.top_k(keyed, M)
  n_keep = page_budget(n_live_B, fraction, sink, recent)
  return pages.astype(jnp.int32), jnp.broadcast_to(n_keep[:, None], (B, K))


def streaming_pages(n_live_B, num_kv_heads: int, max_pages: int, *, fraction: float, sink: int,
                    recent: int):
  """StreamingLLM's choice at the same budget: the sink, then the latest pages."""
  B = n_live_B.shape[0]
  n_keep = page_budget(n_live_B, fraction, sink, recent)
  i = jnp.arange(max_pages)[None, :]
  n_sink = jnp.minimum(sink, n_keep)[:, None]
  window_start = (n_live_B - (n_keep - jnp.minimum(sink, n_keep)))[:, None]
  pages = jnp.where(i < n_sink, i, window_start + i - n_sink)
  pages = jnp.clip(pages, 0, max_pages - 1).astype(jnp.int32)
  return (jnp.broadcast_to(pages[:, None, :], (B, num_kv_heads, max_pages)),
          jnp.broadcast_to(n_keep[:, None], (B, num_kv_heads)))
