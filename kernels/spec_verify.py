"""Exact verification of point-mass drafts: a Pallas kernel and its reference.

A row brings T = K + 1 target score vectors (positions 0..K of one cached
forward over [last token, d_1 .. d_K]) and k <= K drafted tokens. Draft d_j
is accepted with probability p_j(d_j), where p_j = softmax(scores_j) is the
target's processed distribution at that position; at the first rejection the
emitted token is drawn from p_j with d_j removed and renormalised; when all
k are accepted a bonus token is drawn from p_k. For any way of choosing the
drafts (independent of this rule's randomness) every emitted token is
distributed exactly as plain sampling from the target would draw it:
P(d) = p(d), and P(v != d) = (1 - p(d)) p(v) / (1 - p(d)) = p(v).

Randomness is counter based, so the kernel and the reference agree bit for
bit: position j of a row whose generated count is c uses the uniform
u = H(seed, c + j, ACCEPT) for its accept test, and draws by an exponential
race (Gumbel-max) over keys scores_v - log(-log H(seed, c + j, v)), which
picks v with probability p(v) in one pass over the vocabulary, with no
normalisation first. Each counter decides at most one emitted token, so
draws are independent across tokens.

Greedy decoding (temperature 0): p_j is a point mass on the first argmax, so
d_j is accepted exactly when it is that argmax and the emitted token is the
argmax: outputs are token-identical to plain greedy decoding.

Temperature, top-k and top-p act before this function (the caller passes the
processed scores with removed tokens at -inf), so the kernel never sorts.

The kernel (`verify`, Pallas) runs one program per row and streams the
vocabulary in tiles, keeping per position an online log-sum-exp, the draft's
score and the race's leader (excluding the draft); it then forms the accepted
length and the emitted tokens. `verify_reference` is the same computation in
plain JAX over the whole vocabulary; the engine uses it on CPU, and the
tests compare the two in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_ACCEPT_SALT = 0xFFFFFFFF  # the accept test's "vocabulary id": never a real token
_NEG = -1e30  # finite stand-in for -inf in running maxima (exp(-inf - -inf) is nan)


def mix32(x):
  """A 32-bit integer finaliser (xorshift-multiply, "lowbias32" constants):
  every input bit affects every output bit. The counter-based RNG of both
  plain sampling (jaxroll.rollout.sampling) and verification."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def hash_uniform(seed0, seed1, counter, index):
  """A uniform in (0, 1) from a row's seed, a token counter and an index.

  All arguments are uint32 arrays that broadcast. The result is never 0 or
  1, so -log(-log u) is finite.
  """
  c = counter * jnp.uint32(0x9E3779B9) + seed0
  h = mix32(mix32(mix32(c) ^ seed1) + index * jnp.uint32(0x85EBCA6B))
  return ((h >> 8).astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -24)


def _race_keys(scores, seed0, seed1, counter, vocab_ids, greedy: bool):
  if greedy:
    return scores
  u = hash_uniform(seed0, seed1, counter, vocab_ids.astype(jnp.uint32))
  return scores - jnp.log(-jnp.log(u))


def _clean_drafts(draft_BxT, k_B, vocab: int):
  """Drafts outside the vocabulary or past a row's k become -1 (no draft):
  such a column is never accepted and excludes nothing from the race."""
  j = jnp.arange(draft_BxT.shape[-1], dtype=jnp.int32)
  ok = (draft_BxT >= 0) & (draft_BxT < vocab) & (j < k_B[:, None])
  return jnp.where(ok, draft_BxT, -1).astype(jnp.int32)


def _finish(lse_T, draft_score_T, lead_id_T, lead_score_T, draft_T, k, seed0, seed1, count,
            greedy: bool):
  """Accept chain over the T positions of one or more rows (trailing axis T)."""
  T = draft_T.shape[-1]
  j = jnp.arange(T, dtype=jnp.int32)
  if greedy:
    # d_j is the first argmax when it beats the best other token, or ties
    # with it from a lower id.
    accept = (draft_score_T > lead_score_T) | ((draft_score_T == lead_score_T) & (draft_T < lead_id_T))
  else:
    counter = (count[..., None] + j).astype(jnp.uint32)
    u = hash_uniform(seed0[..., None], seed1[..., None], counter, jnp.uint32(_ACCEPT_SALT))
    accept = u < jnp.exp(draft_score_T - lse_T)
  accept = accept & (j < k[..., None]) & (draft_T >= 0)
  n = jnp.min(jnp.where(accept, T, j), axis=-1)  # the first position not accepted
  n = jnp.minimum(n, k)
  tokens = jnp.where(j < n[..., None], draft_T, jnp.where(j == n[..., None], lead_id_T, 0))
  chosen = jnp.where(j < n[..., None], draft_score_T, lead_score_T)
  logp = jnp.where(j <= n[..., None], 0.0 if greedy else chosen - lse_T, 0.0)
  return n.astype(jnp.int32), tokens.astype(jnp.int32), logp.astype(jnp.float32)


def verify_reference(scores_BxTxV, draft_BxT, k_B, seed_Bx2, count_B, *, greedy: bool = False):
  """Accepted lengths and emitted tokens, in plain JAX.

  Args:
    scores_BxTxV: processed target scores (logits / temperature, removed
      tokens at -inf) at positions 0..K; T = K + 1.
    draft_BxT: drafted token at position j in column j (d_{j+1}, the token
      that follows position j); columns >= k_B hold anything (ignored);
      negative ids or ids >= V are never accepted.
    k_B: drafts per row, 0..K.
    seed_Bx2: uint32 per-row seed.
    count_B: tokens the row had generated before this pass.
    greedy: temperature 0.

  Returns:
    (n_B, tokens_BxT, logp_BxT): n_B drafts accepted; tokens 0..n_B are
    emitted (the accepted drafts, then the residual or bonus token); logp
    is each emitted token's log-probability under its position's
    distribution (0 under greedy, as plain decoding records).
  """
  B, T, V = scores_BxTxV.shape
  scores = scores_BxTxV.astype(jnp.float32)
  draft = _clean_drafts(draft_BxT, k_B, V)
  lse_BxT = jax.nn.logsumexp(scores, axis=-1)
  draft_score = jnp.take_along_axis(scores, jnp.maximum(draft, 0)[..., None], axis=-1)[..., 0]
  draft_score = jnp.where(draft >= 0, draft_score, -jnp.inf)
  v = jnp.arange(V, dtype=jnp.int32)
  k_B, count_B = k_B.astype(jnp.int32), count_B.astype(jnp.int32)
  finish = lambda lead_id, lead_score: _finish(lse_BxT, draft_score, lead_id, lead_score, draft, k_B,
                                               seed_Bx2[:, 0], seed_Bx2[:, 1], count_B, greedy)
  if greedy:  # the accept test needs the best other token at every position
    keys = jnp.where(v == draft[..., None], -jnp.inf, scores)
    lead_id = jnp.argmax(keys, axis=-1).astype(jnp.int32)
    return finish(lead_id, jnp.take_along_axis(scores, lead_id[..., None], axis=-1)[..., 0])
  # Sampling: the accept test does not look at the race, so it runs only at
  # the one position whose token it draws (the kernel, streaming, runs it
  # everywhere; the drawn token is the same).
  zeros = jnp.zeros((B, T), jnp.int32)
  n_B, _, _ = finish(zeros, zeros.astype(jnp.float32))
  scores_BxV = jnp.take_along_axis(scores, n_B[:, None, None], axis=1)[:, 0]
  draft_B = jnp.take_along_axis(draft, n_B[:, None], axis=1)[:, 0]
  keys = _race_keys(scores_BxV, seed_Bx2[:, 0, None], seed_Bx2[:, 1, None],
                    (count_B + n_B).astype(jnp.uint32)[:, None], v, greedy)
  keys = jnp.where(v == draft_B[:, None], -jnp.inf, keys)
  lead_B = jnp.argmax(keys, axis=-1).astype(jnp.int32)
  lead_score_B = jnp.take_along_axis(scores_BxV, lead_B[:, None], axis=-1)[:, 0]
  return finish(jnp.broadcast_to(lead_B[:, None], (B, T)),
                jnp.broadcast_to(lead_score_B[:, None], (B, T)))


def _verify_kernel(scores_ref, draft_ref, k_ref, seed_ref, count_ref, n_ref, tok_ref, logp_ref,
                   *, vocab: int, tile: int, greedy: bool):
  b = pl.program_id(0)
  T = scores_ref.shape[1]
  num_tiles = scores_ref.shape[2] // tile
  draft_T = draft_ref[b, :]
  seed0, seed1 = seed_ref[b, 0], seed_ref[b, 1]
  count = count_ref[b]
  counter_T = (count + jnp.arange(T, dtype=jnp.int32)).astype(jnp.uint32)

  def body(i, carry):
    m, s, dscore, lead_key, lead_id, lead_score = carry
    v0 = i * tile
    x = scores_ref[b, :, pl.ds(v0, tile)].astype(jnp.float32)  # [T, tile]
    ids = v0 + jax.lax.broadcasted_iota(jnp.int32, (T, tile), 1)
    x = jnp.where(ids < vocab, x, -jnp.inf)  # padding past the vocabulary
    # Online log-sum-exp.
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
    is_draft = ids == draft_T[:, None]
    dscore = jnp.maximum(dscore, jnp.max(jnp.where(is_draft, x, -jnp.inf), axis=1))
    # The race, the draft excluded; ties go to the lowest id (jnp.argmax's rule).
    keys = _race_keys(x, seed0, seed1, counter_T[:, None], ids, greedy)
    keys = jnp.where(is_draft | (ids >= vocab), -jnp.inf, keys)
    tile_best = jnp.max(keys, axis=1)
    tile_id = jnp.min(jnp.where(keys == tile_best[:, None], ids, jnp.int32(2 ** 30)), axis=1)
    tile_score = jnp.max(jnp.where(ids == tile_id[:, None], x, -jnp.inf), axis=1)
    better = tile_best > lead_key
    return (m_new, s, dscore, jnp.where(better, tile_best, lead_key),
            jnp.where(better, tile_id, lead_id), jnp.where(better, tile_score, lead_score))

  init = (jnp.full((T,), _NEG, jnp.float32), jnp.zeros((T,), jnp.float32),
          jnp.full((T,), -jnp.inf, jnp.float32), jnp.full((T,), -jnp.inf, jnp.float32),
          jnp.zeros((T,), jnp.int32), jnp.full((T,), -jnp.inf, jnp.float32))
  m, s, dscore, _, lead_id, lead_score = jax.lax.fori_loop(0, num_tiles, body, init)
  n, tokens, logp = _finish(m + jnp.log(s), dscore, lead_id, lead_score, draft_T, k_ref[b],
                            seed0, seed1, count, greedy)
  n_ref[b] = n
  tok_ref[b, :] = tokens
  logp_ref[b, :] = logp


@functools.partial(jax.jit, static_argnames=("greedy", "tile", "interpret"))
def verify(scores_BxTxV, draft_BxT, k_B, seed_Bx2, count_B, *, greedy: bool = False,
           tile: int = 512, interpret: bool = False):
  """`verify_reference` as a Pallas kernel streaming the vocabulary in tiles.

  The vocabulary is padded to a multiple of `tile` (padding scores are
  ignored); `interpret=True` runs the kernel on CPU for tests.
  """
  B, T, V = scores_BxTxV.shape
  Vp = pl.cdiv(V, tile) * tile
  scores = jnp.pad(scores_BxTxV, ((0, 0), (0, 0), (0, Vp - V)))
  draft = _clean_drafts(draft_BxT, k_B, V)
  kernel = functools.partial(_verify_kernel, vocab=V, tile=tile, greedy=greedy)
  return row_call(kernel, B, T, interpret)(scores, draft, k_B.astype(jnp.int32),
                                           seed_Bx2.astype(jnp.uint32), count_B.astype(jnp.int32))


def row_call(kernel, B: int, T: int, interpret: bool):
  """`kernel` as a pallas_call with one program per row, returning what a
  verifier returns: (n_B int32, tokens_BxT int32, logp_BxT float32)."""
  return pl.pallas_call(
      kernel,
      grid=(B,),
      out_shape=(jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, T), jnp.int32),
                 jax.ShapeDtypeStruct((B, T), jnp.float32)),
      interpret=interpret,
  )
