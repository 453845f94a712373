"""Paged attention and Quest page selection: kernels and XLA path against their references,
and the references against dense attention and NumPy."""

import numpy as np
import pytest

from jaxroll.kernels import paged_attention as pa
from jaxroll.kernels import quest
from jaxroll.kernels.attention import reference_attention


def _pool(rng, B, K, D, P, M, N):
  """A random page pool and a table of distinct pages per row (page N: scratch)."""
  k = rng.normal(size=(N + 1, K, D, P)).astype(np.float32)
  v = rng.normal(size=(N + 1, K, P, D)).astype(np.float32)
  table = rng.permutation(N)[:B * M].reshape(B, M).astype(np.int32)
  return k, v, table


def _dense(k, v, table, P):
  """The rows' pages laid end to end: the dense cache they stand for."""
  B, M = table.shape
  kd = np.concatenate([k[table[:, j]] for j in range(M)], axis=-1)  # [B, K, D, M*P]
  vd = np.concatenate([v[table[:, j]] for j in range(M)], axis=2)  # [B, K, M*P, D]
  return kd, vd


# Lengths that are not multiples of the page size, a row of one page, a full row.
CASES = [dict(T=1, lengths=[3, 17, 9, 20]), dict(T=3, lengths=[3, 18, 11, 20])]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c['T']}")
def test_paged_attention_over_live_pages_equals_dense_attention(case):
  rng = np.random.default_rng(0)
  B, H, K, D, P, M = 4, 4, 2, 8, 4, 5
  T, lengths = case["T"], np.asarray(case["lengths"])
  k, v, table = _pool(rng, B, K, D, P, M, 24)
  q = rng.normal(size=(B, T, H, D)).astype(np.float32)
  q_pos = np.stack([np.arange(n - T, n) for n in lengths]).astype(np.int32)
  kd, vd = _dense(k, v, table, P)
  want = np.asarray(reference_attention(q, kd, vd, q_pos, np.broadcast_to(np.arange(M * P), (B, M * P))))
  pages = np.broadcast_to(np.arange(M, dtype=np.int32), (B, K, M))
  n = np.broadcast_to(((lengths - 1) // P + 1)[:, None], (B, K)).astype(np.int32)
  args = (q, k, v, table, q_pos, pages, n)
  np.testing.assert_allclose(pa.paged_attention_reference(*args), want, atol=1e-5)
  for chunk in (1, 3, 64):
    np.testing.assert_allclose(pa.paged_attention_xla(*args, chunk=chunk), want, atol=1e-5)
  np.testing.assert_allclose(pa.paged_attention(*args, interpret=True), want, atol=1e-5)


def test_listed_pages_per_head_equal_masked_numpy_softmax():
  """Sparse lists (a different subset per KV head, in any order) against a
  NumPy softmax restricted to the listed pages; a row listing nothing gets 0."""
  rng = np.random.default_rng(1)
  B, T, H, K, D, P, M = 3, 2, 6, 3, 4, 4, 6
  k, v, table = _pool(rng, B, K, D, P, M, 20)
  q = rng.normal(size=(B, T, H, D)).astype(np.float32)
  q_pos = np.asarray([[21, 22], [13, 14], [5, 6]], np.int32)
  pages = np.stack([np.stack([rng.permutation(M) for _ in range(K)]) for _ in range(B)]).astype(np.int32)
  n = np.asarray([[2, 5, 1], [3, 1, 2], [0, 0, 0]], np.int32)
  got = {"reference": pa.paged_attention_reference(q, k, v, table, q_pos, pages, n),
         "xla": pa.paged_attention_xla(q, k, v, table, q_pos, pages, n, chunk=4),
         "pallas": pa.paged_attention(q, k, v, table, q_pos, pages, n, interpret=True)}
  want = np.zeros((B, T, H, D), np.float32)
  R = H // K
  for b in range(B):
    for h in range(H):
      g = h // R
      keep = sorted(pages[b, g, :n[b, g]])
      if not keep:
        continue
      keys = np.concatenate([k[table[b, j], g] for j in keep], axis=1)  # [D, |keep| P]
      vals = np.concatenate([v[table[b, j], g] for j in keep], axis=0)
      kpos = np.concatenate([j * P + np.arange(P) for j in keep])
      for t in range(T):
        s = q[b, t, h] @ keys / np.sqrt(D)
        s = np.where(kpos <= q_pos[b, t], s, -np.inf)
        w = np.exp(s - s.max())
        want[b, t, h] = (w / w.sum()) @ vals
  for name, out in got.items():
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, err_msg=name)


def _numpy_quest(q, kmin, kmax, table, n_live):
  B, T, H, D = q.shape
  K = kmin.shape[1]
  R = H // K
  M = table.shape[1]
  out = np.full((B, K, M), -np.inf, np.float32)
  for b in range(B):
    for g in range(K):
      for j in range(n_live[b]):
        lo, hi = kmin[table[b, j], g], kmax[table[b, j], g]
        best = -np.inf
        for t in range(T):
          for r in range(R):
            qq = q[b, t, g * R + r]
            best = max(best, np.sum(np.maximum(qq * lo, qq * hi)))
        out[b, g, j] = best
  return out


def test_quest_scores_equal_numpy_and_bound_every_key_score():
  rng = np.random.default_rng(2)
  B, T, H, K, D, P, M, N = 3, 2, 4, 2, 8, 4, 5, 20
  k, _, table = _pool(rng, B, K, D, P, M, N)
  kmin, kmax = k.min(axis=-1), k.max(axis=-1)
  q = rng.normal(size=(B, T, H, D)).astype(np.float32)
  n_live = np.asarray([5, 1, 3], np.int32)
  want = _numpy_quest(q, kmin, kmax, table, n_live)
  np.testing.assert_allclose(quest.quest_scores_reference(q, kmin, kmax, table, n_live), want, rtol=1e-5)
  np.testing.assert_allclose(quest.quest_scores(q, kmin, kmax, table, n_live, interpret=True), want,
                             rtol=1e-5)
  # The score is an upper bound on q . k for every key of the page.
  for b in range(B):
    for j in range(n_live[b]):
      for h in range(H):
        dots = q[b, :, h] @ k[table[b, j], h // 2]  # [T, P]
        assert dots.max() <= want[b, h // 2, j] + 1e-4


def test_select_pages_keeps_sink_recent_and_the_best_of_the_rest():
  rng = np.random.default_rng(3)
  B, K, M = 6, 2, 12
  scores = rng.normal(size=(B, K, M)).astype(np.float32)
  n_live = np.asarray([12, 7, 3, 2, 1, 9], np.int32)
  fraction, sink, recent = 0.4, 1, 2
  pages, n = quest.select_pages(scores, n_live, fraction=fraction, sink=sink, recent=recent)
  pages, n = np.asarray(pages), np.asarray(n)
  for b in range(B):
    live = n_live[b]
    budget = min(max(int(np.ceil(fraction * live)), sink + recent), live)
    assert (n[b] == budget).all()
    forced = set(range(min(sink, live))) | set(range(max(0, live - recent), live))
    for g in range(K):
      kept = set(pages[b, g, :n[b, g]].tolist())
      assert len(kept) == budget and kept <= set(range(live)) and forced <= kept
      rest = [j for j in range(live) if j not in forced]
      best = sorted(rest, key=lambda j: -scores[b, g, j])[:budget - len(forced)]
      assert kept == forced | set(best)


def test_streaming_pages_are_the_sink_then_the_latest():
  n_live = np.asarray([10, 3, 1], np.int32)
  pages, n = quest.streaming_pages(n_live, 2, 10, fraction=0.5, sink=1, recent=1)
  pages, n = np.asarray(pages), np.asarray(n)
  assert n[:, 0].tolist() == [5, 2, 1]
  assert pages[0, 0, :5].tolist() == [0, 6, 7, 8, 9]
  assert pages[1, 1, :2].tolist() == [0, 2]
  assert pages[2, 0, :1].tolist() == [0]
