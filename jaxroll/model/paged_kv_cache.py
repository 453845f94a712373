"""A paged KV cache: a page pool per layer, a page table per slot, shared prompt pages.

Per layer the pool holds keys [N + 1, K, D, P] and values [N + 1, K, P, D]
(the dense cache's layouts, with pages in place of slots). Page N is a
scratch page that no row owns: a table entry that points nowhere points
there, so writes from rows without pages (empty or finished slots) land
there and are never read. `table_BxM` maps a slot's logical page j
(positions jP .. jP + P - 1) to a physical page; `ref_N` counts the slots
that use each page, and a page is free when its count is 0.

The G samples of a group share the full pages of their prompt: decoding
writes only at positions >= len - 1 (jaxroll.rollout.decode's convention), so
the pages before the one holding position len - 1 are read-only, and only
that page is copied once per sample. Pages are taken as rows grow
(`reserve`, before each decode step) and given back when rows finish
(`release`). A row that finds no free page is preempted by the engine and
resumed later by prefilling its tokens again (recompute, as vLLM does).

With sparse decoding the cache also keeps each page's elementwise key
minimum and maximum per KV head ([N + 1, K, D], Quest's summaries), computed
from the page's valid positions whenever a write touches it; a rolled-back
speculative token is thus dropped from the bounds at the next write.

Attention reads only each row's live pages (kernels.paged_attention), or
the pages the sparse policy keeps (kernels.quest). Allocation is all on
device: nothing leaves the decode loop.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxroll.kernels import paged_attention as pa
from jaxroll.kernels import quest

SPARSITY = ("none", "quest", "streaming")
IMPLS = ("xla", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class PagedSpec:
  """How the paged cache is laid out and which pages decoding reads.

  page_size: positions per page.
  num_pages: pages in the pool (per layer); None sizes it for every slot
    at full length (no preemption can happen).
  sparsity: "none" (every live page), "quest" (query-aware top pages),
    "streaming" (sink plus latest pages).
  budget: with sparsity, the fraction of a row's live pages kept (the
    cache's starting `budget`; a decode call may set another, see
    jaxroll.rollout.decode_params.DecodeParams.kv_budget).
  sink_pages, recent_pages: pages always kept from the start and the end.
  impl: "xla" (reads only listed pages; CPU), "pallas" (the attention and
    Quest-score kernels; GPU), "reference" (gathers every listed page into
    a dense block).
  """

  page_size: int = 16
  num_pages: Optional[int] = None
  sparsity: str = "none"
  budget: float = 0.25
  sink_pages: int = 1
  recent_pages: int = 1
  impl: str = "xla"

  def __post_init__(self):
    if self.page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {self.page_size}")
    if self.sparsity not in SPARSITY:
      raise ValueError(f"sparsity must be one of {SPARSITY}, got {self.sparsity!r}")
    if self.impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
    if not 0.0 < self.budget <= 1.0:
      raise ValueError(f"budget must be in (0, 1], got {self.budget}")
    if self.sink_pages < 0 or self.recent_pages < 1:
      raise ValueError("sink_pages must be >= 0 and recent_pages >= 1 (the query's own page)")


def paged_from_config(rollout_cfg) -> Optional[PagedSpec]:
  """The PagedSpec of a RolloutConfig (jaxroll.config), None for the dense cache."""
  r = rollout_cfg
  if r.kv_cache != "paged":
    return None
  return PagedSpec(page_size=r.kv_page_size, num_pages=r.kv_pages or None, sparsity=r.kv_sparsity,
                   budget=r.kv_budget, sink_pages=r.kv_sink_pages, recent_pages=r.kv_recent_pages,
                   impl="pallas" if jax.default_backend() == "gpu" else "xla")


def pages_for(length: int, page_size: int) -> int:
  return -(-length // page_size)


def group_pages(prompt_len: int, lengths, page_size: int) -> int:
  """Pages a group holds once each of its rows has generated `lengths[i]`
  tokens: the shared full prompt pages once, plus each row's own.

  A row that generated n tokens has written positions 0 .. prompt_len + n - 2
  (its last token is sampled, never fed back).
  """
  shared = (prompt_len - 1) // page_size
  return shared + sum(pages_for(prompt_len + n - 1, page_size) - shared for n in lengths)


@struct.dataclass
class PagedKVCache:
  k: tuple  # per layer: [N + 1, K, D, P]
  v: tuple  # per layer: [N + 1, K, P, D]
  kmin: Optional[tuple]  # per layer: [N + 1, K, D] with sparsity, else None
  kmax: Optional[tuple]
  table_BxM: jax.Array  # int32 physical page per logical page; N = none
  ref_N: jax.Array  # int32 slots using each page
  peak_used: jax.Array  # int32 most pages in use at once
  # float32 scalar: the share of live pages sparse attention keeps. An
  # array, not part of the spec, so a budget controller that moves it
  # between steps does not recompile the decode loop.
  budget: jax.Array
  spec: PagedSpec = struct.field(pytree_node=False)

  @classmethod
  def zeros(cls, spec: PagedSpec, num_layers, batch, num_kv_heads, length, head_dim,
            dtype) -> "PagedKVCache":
    P = spec.page_size
    M = pages_for(length, P)
    N = spec.num_pages if spec.num_pages is not None else batch * M
    if N < M:
      raise ValueError(f"a pool of {N} pages cannot hold one full row ({M} pages of {P}); "
                       f"raise num_pages to at least {M}")
    pool = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    summaries = spec.sparsity == "quest"
    return cls(
        k=pool((N + 1, num_kv_heads, head_dim, P)), v=pool((N + 1, num_kv_heads, P, head_dim)),
        kmin=pool((N + 1, num_kv_heads, head_dim)) if summaries else None,
        kmax=pool((N + 1, num_kv_heads, head_dim)) if summaries else None,
        table_BxM=jnp.full((batch, M), N, jnp.int32), ref_N=jnp.zeros((N,), jnp.int32),
        peak_used=jnp.int32(0), budget=jnp.float32(spec.budget), spec=spec)

  @property
  def num_pages(self) -> int:
    return self.ref_N.shape[0]

  @property
  def page_size(self) -> int:
    return self.spec.page_size

  def num_free(self):
    return jnp.sum(self.ref_N == 0).astype(jnp.int32)

  def page_bytes(self) -> int:
    """Bytes of one page across all layers (keys and values)."""
    return 2 * sum(int(x[0].size) * x.dtype.itemsize for x in self.k)

  # -- the model's view -------------------------------------------------------

  def layer(self, i: int) -> "_PagedLayer":
    return _PagedLayer(self, i)

  def with_layers(self, layers) -> "PagedKVCache":
    """The cache with its first len(layers) layers replaced (as KVCache's)."""
    n = len(layers)
    k, v, kmin, kmax = zip(*layers)
    summaries = self.kmin is not None
    return self.replace(k=tuple(k) + self.k[n:], v=tuple(v) + self.v[n:],
                        kmin=tuple(kmin) + self.kmin[n:] if summaries else None,
                        kmax=tuple(kmax) + self.kmax[n:] if summaries else None)

  # -- allocation -------------------------------------------------------------

  def _take(self, want_X, X: int):
    """Physical ids for the entries of `want_X` in order (N where not wanted)."""
    N = self.num_pages
    free_ids = jnp.nonzero(self.ref_N == 0, size=X, fill_value=N)[0].astype(jnp.int32)
    rank = jnp.cumsum(want_X) - 1
    return jnp.where(want_X, free_ids[jnp.clip(rank, 0, X - 1)], N)

  def _count(self, ids, delta):
    """ref_N[ids] += delta; ids == N are dropped."""
    return self.ref_N.at[ids].add(delta, mode="drop")

  def _with_peak(self, ref_N):
    used = jnp.sum(ref_N > 0).astype(jnp.int32)
    return self.replace(ref_N=ref_N, peak_used=jnp.maximum(self.peak_used, used))

  def reserve(self, pos_B, num_tokens: int, live_B):
    """Pages for positions pos .. pos + num_tokens - 1 of each live row.

    Rows are served in slot order while pages last; returns (cache, ok_B),
    ok_B False for a live row that could not get all its pages (it got none).
    """
    P, N = self.page_size, self.num_pages
    B, M = self.table_BxM.shape
    U = (num_tokens - 1) // P + 2  # pages a run of num_tokens can touch
    logical_BxU = pos_B[:, None] // P + jnp.arange(U)[None, :]
    last_B = (pos_B + num_tokens - 1) // P
    in_run = (logical_BxU <= last_B[:, None]) & (logical_BxU < M)
    logical_BxU = jnp.minimum(logical_BxU, M - 1)
    current = jnp.take_along_axis(self.table_BxM, logical_BxU, axis=1)
    need_BxU = in_run & (current == N) & live_B[:, None]
    need_B = jnp.sum(need_BxU, axis=1)
    ok_B = jnp.cumsum(need_B) <= self.num_free()
    want = (need_BxU & ok_B[:, None]).reshape(-1)
    ids = self._take(want, B * U).reshape(B, U)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, U))
    table = self.table_BxM.at[rows, jnp.where(want.reshape(B, U), logical_BxU, M)].set(
        ids, mode="drop")
    cache = self._with_peak(self._count(ids.reshape(-1), 1)).replace(table_BxM=table)
    return cache, ok_B | ~live_B

  def release(self, rows_B):
    """Gives back every page of the rows marked in `rows_B`."""
    N = self.num_pages
    ids = jnp.where(rows_B[:, None], self.table_BxM, N)
    return self.replace(ref_N=self._count(ids.reshape(-1), -1),
                        table_BxM=jnp.where(rows_B[:, None], N, self.table_BxM))

  def insert(self, prefix_kv, length_P, slot_M, row_M):
    """Places prefilled rows into slots; slots taking one prefix row share its full pages.

    Args:
      prefix_kv: dense KV of the prefix (jaxroll.model.kv_cache.KVCache),
        keys [P, K, D, T] and values [P, K, T, D] per layer.
      length_P: tokens in each prefix row.
      slot_M, row_M: slot and prefix row of each placement (slot == B: skip).

    The caller makes sure enough pages are free (the engine counts them).
    """
    Pg, N = self.page_size, self.num_pages
    B, M = self.table_BxM.shape
    Pn, T = prefix_kv.v[0].shape[0], prefix_kv.v[0].shape[2]
    J = pages_for(T, Pg)  # pages a prefix row spans
    cache = self.release(jnp.zeros((B,), bool).at[slot_M].set(True, mode="drop"))
    valid_M = slot_M < B
    users_P = jnp.zeros((Pn,), jnp.int32).at[jnp.where(valid_M, row_M, Pn)].add(1, mode="drop")
    own_page_P = (length_P - 1) // Pg  # holds position len - 1: one copy per slot
    j_J = jnp.arange(J)
    shared_PxJ = (j_J[None, :] < own_page_P[:, None]) & (users_P[:, None] > 0)
    want = jnp.concatenate([shared_PxJ.reshape(-1), valid_M])
    ids = cache._take(want, Pn * J + slot_M.shape[0])
    shared_ids_PxJ, own_ids_M = ids[:Pn * J].reshape(Pn, J), ids[Pn * J:]
    ref = cache._count(shared_ids_PxJ.reshape(-1),
                       jnp.broadcast_to(users_P[:, None], (Pn, J)).reshape(-1))
    ref = ref.at[own_ids_M].add(1, mode="drop")
    # The slot's table: shared pages, then its own copy, then nothing.
    own_page_M = own_page_P[row_M]
    row_table_MxJ = jnp.where(j_J[None, :] < own_page_M[:, None], shared_ids_PxJ[row_M],
                              jnp.where(j_J[None, :] == own_page_M[:, None], own_ids_M[:, None], N))
    row_table_MxM = jnp.full((slot_M.shape[0], M), N, jnp.int32).at[:, :min(J, M)].set(
        row_table_MxJ[:, :M])
    table = cache.table_BxM.at[slot_M].set(row_table_MxM, mode="drop")
    # Page contents: the prefix cut into pages (padded to whole pages).
    pad = J * Pg - T
    k_pages = lambda k_PxKxDxT: jnp.pad(k_PxKxDxT, ((0, 0), (0, 0), (0, 0), (0, pad))).reshape(
        Pn, k_PxKxDxT.shape[1], k_PxKxDxT.shape[2], J, Pg).transpose(0, 3, 1, 2, 4)
    v_pages = lambda v_PxKxTxD: jnp.pad(v_PxKxTxD, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(
        Pn, v_PxKxTxD.shape[1], J, Pg, v_PxKxTxD.shape[3]).transpose(0, 2, 1, 3, 4)
    own_src = (row_M, jnp.minimum(own_page_M, J - 1))
    shared_flat = jnp.where(shared_PxJ, shared_ids_PxJ, N + 1).reshape(-1)  # N + 1: dropped
    own_flat = jnp.where(valid_M, own_ids_M, N + 1)
    # Valid positions of each written page, for the key summaries.
    pos_J = j_J[:, None] * Pg + jnp.arange(Pg)[None, :]
    shared_valid = jnp.ones((Pn * J, Pg), bool)
    own_valid = pos_J[own_src[1]] < (length_P[row_M] - 1)[:, None]

    def put(pool, pages):
      flat = pages.reshape((Pn * J,) + pages.shape[2:])
      pool = pool.at[shared_flat].set(flat.astype(pool.dtype), mode="drop")
      return pool.at[own_flat].set(pages[own_src].astype(pool.dtype), mode="drop")

    new_k = tuple(put(c, k_pages(n)) for c, n in zip(cache.k, prefix_kv.k))
    new_v = tuple(put(c, v_pages(n)) for c, n in zip(cache.v, prefix_kv.v))
    cache = cache._with_peak(ref).replace(table_BxM=table, k=new_k, v=new_v)
    if cache.kmin is None:
      return cache
    ids_all = jnp.concatenate([shared_flat, own_flat])
    valid_all = jnp.concatenate([shared_valid, own_valid])
    kmin, kmax = [], []
    for kp, lo, hi in zip(new_k, cache.kmin, cache.kmax):
      lo_new, hi_new = _summaries(kp[jnp.minimum(ids_all, N)], valid_all)
      kmin.append(lo.at[ids_all].set(lo_new, mode="drop"))
      kmax.append(hi.at[ids_all].set(hi_new, mode="drop"))
    return cache.replace(kmin=tuple(kmin), kmax=tuple(kmax))


def _summaries(k_XxKxDxP, valid_XxP):
  """Elementwise key min and max over each page's valid positions ([X, K, D] each)."""
  mask = valid_XxP[:, None, None, :]
  k = k_XxKxDxP.astype(jnp.float32)
  lo = jnp.min(jnp.where(mask, k, jnp.inf), axis=-1)
  hi = jnp.max(jnp.where(mask, k, -jnp.inf), axis=-1)
  return lo, hi


class _PagedLayer:
  """One layer of a PagedKVCache as the attention module uses it."""

  def __init__(self, cache: PagedKVCache, i: int):
    self.cache, self.i = cache, i

  def attend(self, q_BxTxHxD, k_new_BxKxDxT, v_new_BxKxTxD, positions_BxT, attention_fn=None):
    """Writes the new keys and values, then attends over the row's pages.

    `attention_fn` (the dense cache's seam) is unused: the paged cache
    brings its own attention.
    """
    c, i = self.cache, self.i
    P, N = c.page_size, c.num_pages
    B, M = c.table_BxM.shape
    T = positions_BxT.shape[1]
    logical_BxT = jnp.minimum(positions_BxT // P, M - 1)
    phys_BxT = jnp.take_along_axis(c.table_BxM, logical_BxT, axis=1)
    off_BxT = positions_BxT % P
    k = c.k[i].at[phys_BxT, :, :, off_BxT].set(
        k_new_BxKxDxT.transpose(0, 3, 1, 2).astype(c.k[i].dtype))
    v = c.v[i].at[phys_BxT, :, off_BxT, :].set(
        v_new_BxKxTxD.transpose(0, 2, 1, 3).astype(c.v[i].dtype))
    kmin = kmax = None
    last_B = positions_BxT[:, -1]
    # Rows without pages (empty or finished slots) read nothing.
    n_live_B = jnp.where(c.table_BxM[:, 0] == N, 0, last_B // P + 1)
    K = k.shape[1]
    if c.kmin is not None:
      kmin, kmax = self._update_summaries(k, positions_BxT[:, 0], last_B, T)
      score = quest.quest_scores if c.spec.impl == "pallas" else quest.quest_scores_reference
      scores = score(q_BxTxHxD, kmin, kmax, c.table_BxM, n_live_B)
      pages, n = quest.select_pages(scores, n_live_B, fraction=c.budget,
                                    sink=c.spec.sink_pages, recent=c.spec.recent_pages)
    elif c.spec.sparsity == "streaming":
      pages, n = quest.streaming_pages(n_live_B, K, M, fraction=c.budget,
                                       sink=c.spec.sink_pages, recent=c.spec.recent_pages)
    else:
      pages = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, K, M))
      n = jnp.broadcast_to(n_live_B[:, None], (B, K))
    impl = {"xla": pa.paged_attention_xla, "reference": pa.paged_attention_reference,
            "pallas": pa.paged_attention}[c.spec.impl]
    out = impl(q_BxTxHxD, k, v, c.table_BxM, positions_BxT, pages, n)
    return out, (k, v, kmin, kmax)

  def _update_summaries(self, k_pages, first_B, last_B, num_tokens: int):
    """Recomputes the summaries of the pages this write touched."""
    c, i = self.cache, self.i
    P, N = c.page_size, c.num_pages
    B, M = c.table_BxM.shape
    U = (num_tokens - 1) // P + 2  # pages a run of num_tokens can touch
    logical_BxU = first_B[:, None] // P + jnp.arange(U)[None, :]
    touched = logical_BxU <= (last_B // P)[:, None]
    phys_BxU = jnp.take_along_axis(c.table_BxM, jnp.minimum(logical_BxU, M - 1), axis=1)
    phys_BxU = jnp.where(touched, phys_BxU, N + 1)
    pos_BxUxP = logical_BxU[..., None] * P + jnp.arange(P)
    valid = (pos_BxUxP <= last_B[:, None, None]).reshape(B * U, P)
    flat = phys_BxU.reshape(-1)
    lo, hi = _summaries(k_pages[jnp.minimum(flat, N)], valid)
    return (c.kmin[i].at[flat].set(lo, mode="drop"), c.kmax[i].at[flat].set(hi, mode="drop"))
