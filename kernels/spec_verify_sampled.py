"""Exact verification of drafts sampled from a draft distribution q: a Pallas kernel and its reference.

A drafting model (the policy's first layers, jaxroll.rollout.layer_skip_draft)
draws d_j ~ q_j and hands over q_j itself. Verification is the general rule
of speculative sampling (Leviathan et al., Chen et al.): d_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the emitted
token is drawn from the residual norm(max(0, p_j - q_j)); when all k drafts
are accepted a bonus token is drawn from p_k. For d ~ q this emits d with
probability min(q(d), p(d)) and v != d with probability
(sum_u max(0, q(u) - p(u))) * max(0, p(v) - q(v)) / sum_w max(0, p(w) - q(w)),
and since both sums are the total variation distance, P(v) = p(v) for every v.
A point-mass q (what jaxroll.kernels.spec_verify verifies) is the special
case min(1, p(d)) with residual "p without d".

The randomness is the same counter-based hash as spec_verify's: the accept
test of position j uses u = H(seed, c + j, ACCEPT), and the residual or bonus
draw is an exponential race over log r(v) - log(-log H(seed, c + j, v)).
The drafter draws its tokens from another stream of the same hash
(`draft_uniform`), so the drafts are independent of this rule's randomness,
which exactness requires.

If the residual is zero everywhere (p == q to the last bit, so rejection had
probability zero and only rounding of the accept test can reach it), the
token is drawn from p.

`verify_sampled` is the Pallas kernel: one program per row, two passes over
the vocabulary in tiles (the residual needs p, so the log-sum-exp comes
first); `verify_sampled_reference` is plain JAX; both return the same
accepted lengths and tokens for the same counters (the tests check it in
interpret mode). Greedy decoding needs no q: its drafts are point masses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxroll.kernels.spec_verify import _ACCEPT_SALT, _NEG, _clean_drafts, hash_uniform, row_call

_DRAFT_SALT = 0x68E31DA4  # mixed into seed0: the drafter's stream of the hash


def draft_uniform(seed0, seed1, counter, index):
  """The drafter's uniforms: `hash_uniform` on a seed no verifier uses."""
  return hash_uniform(seed0 ^ jnp.uint32(_DRAFT_SALT), seed1, counter, index)


def _gumbel(seed0, seed1, counter, ids):
  return -jnp.log(-jnp.log(hash_uniform(seed0, seed1, counter, ids.astype(jnp.uint32))))


def _accepted(lse_T, dscore_T, qd_T, draft_T, k, seed0, seed1, count):
  """How many drafts the rule keeps (trailing axis T)."""
  T = draft_T.shape[-1]
  j = jnp.arange(T, dtype=jnp.int32)
  counter = (count[..., None] + j).astype(jnp.uint32)
  u = hash_uniform(seed0[..., None], seed1[..., None], counter, jnp.uint32(_ACCEPT_SALT))
  # u < p(d) / q(d), without dividing.
  accept = (u * qd_T < jnp.exp(dscore_T - lse_T)) & (j < k[..., None]) & (draft_T >= 0)
  n = jnp.min(jnp.where(accept, T, j), axis=-1)
  return jnp.minimum(n, k).astype(jnp.int32)


def _emit(n, lse_T, dscore_T, lead_id_T, lead_score_T, draft_T):
  T = draft_T.shape[-1]
  j = jnp.arange(T, dtype=jnp.int32)
  tokens = jnp.where(j < n[..., None], draft_T, jnp.where(j == n[..., None], lead_id_T, 0))
  chosen = jnp.where(j < n[..., None], dscore_T, lead_score_T)
  logp = jnp.where(j <= n[..., None], chosen - lse_T, 0.0)
  return tokens.astype(jnp.int32), logp.astype(jnp.float32)


def _residual_keys(scores, q, lse, gumbel, use_residual):
  """Race keys: log max(0, p - q) + Gumbel where `use_residual`, else log p + Gumbel."""
  p = jnp.exp(scores - lse)
  r = jnp.maximum(p - q, 0.0)
  log_r = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), -jnp.inf)
  return jnp.where(use_residual, log_r, scores - lse) + gumbel


def verify_sampled_reference(scores_BxTxV, q_BxTxV, draft_BxT, k_B, seed_Bx2, count_B):
  """Accepted lengths and emitted tokens under the general rule, in plain JAX.

  Args:
    scores_BxTxV: processed target scores at positions 0..K (T = K + 1).
    q_BxTxV: the draft distribution at each position (probabilities; row
      j is the distribution d_{j+1} was drawn from; columns >= k_B unused).
    draft_BxT, k_B, seed_Bx2, count_B: as `spec_verify.verify_reference`.

  Returns:
    (n_B, tokens_BxT, logp_BxT) as `spec_verify.verify_reference`: logp is
    each emitted token's log-probability under the target.
  """
  B, T, V = scores_BxTxV.shape
  scores = scores_BxTxV.astype(jnp.float32)
  q = q_BxTxV.astype(jnp.float32)
  draft = _clean_drafts(draft_BxT, k_B, V)
  k_B, count_B = k_B.astype(jnp.int32), count_B.astype(jnp.int32)
  seed0, seed1 = seed_Bx2[:, 0], seed_Bx2[:, 1]
  lse_BxT = jax.nn.logsumexp(scores, axis=-1)
  at_draft = lambda x: jnp.take_along_axis(x, jnp.maximum(draft, 0)[..., None], axis=-1)[..., 0]
  dscore = jnp.where(draft >= 0, at_draft(scores), -jnp.inf)
  qd = jnp.where(draft >= 0, at_draft(q), 0.0)
  n_B = _accepted(lse_BxT, dscore, qd, draft, k_B, seed0, seed1, count_B)
  # The race runs only at position n, the one whose token it draws.
  pick = lambda x: jnp.take_along_axis(x, n_B.reshape((B,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
  scores_n, q_n, lse_n = pick(scores), pick(q), pick(lse_BxT)
  v = jnp.arange(V, dtype=jnp.int32)
  gumbel = _gumbel(seed0[:, None], seed1[:, None], (count_B + n_B).astype(jnp.uint32)[:, None], v)
  residual = (n_B < k_B)[:, None]
  keys = _residual_keys(scores_n, q_n, lse_n[:, None], gumbel, residual)
  # A residual that is zero everywhere: draw from p instead.
  keys = jnp.where(jnp.any(keys > -jnp.inf, axis=-1, keepdims=True), keys,
                   _residual_keys(scores_n, q_n, lse_n[:, None], gumbel, False))
  lead = jnp.argmax(keys, axis=-1).astype(jnp.int32)
  lead_score = jnp.take_along_axis(scores_n, lead[:, None], axis=-1)[:, 0]
  tokens, logp = _emit(n_B, lse_BxT, dscore, jnp.broadcast_to(lead[:, None], (B, T)),
                       jnp.broadcast_to(lead_score[:, None], (B, T)), draft)
  return n_B, tokens, logp


def _kernel(scores_ref, q_ref, draft_ref, k_ref, seed_ref, count_ref, n_ref, tok_ref, logp_ref,
            *, vocab: int, tile: int):
  b = pl.program_id(0)
  T = scores_ref.shape[1]
  num_tiles = scores_ref.shape[2] // tile
  draft_T = draft_ref[b, :]
  k = k_ref[b]
  seed0, seed1 = seed_ref[b, 0], seed_ref[b, 1]
  count = count_ref[b]
  counter_T = (count + jnp.arange(T, dtype=jnp.int32)).astype(jnp.uint32)
  residual_T = jnp.arange(T, dtype=jnp.int32) < k

  def tile_at(i):
    v0 = i * tile
    ids = v0 + jax.lax.broadcasted_iota(jnp.int32, (T, tile), 1)
    x = scores_ref[b, :, pl.ds(v0, tile)].astype(jnp.float32)
    q = q_ref[b, :, pl.ds(v0, tile)].astype(jnp.float32)
    inside = ids < vocab
    return ids, jnp.where(inside, x, -jnp.inf), jnp.where(inside, q, 0.0)

  # Pass 1: the log-sum-exp, and p's and q's values at the draft.
  def stats(i, carry):
    m, s, dscore, qd = carry
    ids, x, q = tile_at(i)
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
    is_draft = ids == draft_T[:, None]
    dscore = jnp.maximum(dscore, jnp.max(jnp.where(is_draft, x, -jnp.inf), axis=1))
    qd = qd + jnp.sum(jnp.where(is_draft, q, 0.0), axis=1)
    return m_new, s, dscore, qd

  m, s, dscore, qd = jax.lax.fori_loop(
      0, num_tiles, stats, (jnp.full((T,), _NEG, jnp.float32), jnp.zeros((T,), jnp.float32),
                            jnp.full((T,), -jnp.inf, jnp.float32), jnp.zeros((T,), jnp.float32)))
  lse = m + jnp.log(s)

  # Pass 2: two races per position, over the residual and over p (the
  # fallback and the bonus); ties go to the lowest id.
  def race(i, carry):
    ids, x, q = tile_at(i)
    g = _gumbel(seed0, seed1, counter_T[:, None], ids)
    out = []
    for use_residual, (lead_key, lead_id, lead_score) in zip((True, False), (carry[:3], carry[3:])):
      keys = _residual_keys(x, q, lse[:, None], g, use_residual)
      keys = jnp.where(ids < vocab, keys, -jnp.inf)
      best = jnp.max(keys, axis=1)
      best_id = jnp.min(jnp.where(keys == best[:, None], ids, jnp.int32(2 ** 30)), axis=1)
      best_score = jnp.max(jnp.where(ids == best_id[:, None], x, -jnp.inf), axis=1)
      better = best > lead_key
      out += [jnp.where(better, best, lead_key), jnp.where(better, best_id, lead_id),
              jnp.where(better, best_score, lead_score)]
    return tuple(out)

  lead0 = (jnp.full((T,), -jnp.inf, jnp.float32), jnp.zeros((T,), jnp.int32),
           jnp.full((T,), -jnp.inf, jnp.float32))
  r_key, r_id, r_score, p_key, p_id, p_score = jax.lax.fori_loop(0, num_tiles, race, lead0 + lead0)
  use_r = residual_T & (r_key > -jnp.inf)
  n = _accepted(lse, dscore, qd, draft_T, k, seed0, seed1, count)
  tokens, logp = _emit(n, lse, dscore, jnp.where(use_r, r_id, p_id), jnp.where(use_r, r_score, p_score),
                       draft_T)
  n_ref[b] = n
  tok_ref[b, :] = tokens
  logp_ref[b, :] = logp


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def verify_sampled(scores_BxTxV, q_BxTxV, draft_BxT, k_B, seed_Bx2, count_B, *, tile: int = 512,
                   interpret: bool = False):
  """`verify_sampled_reference` as a Pallas kernel streaming the vocabulary
  in tiles (padded to a multiple of `tile`); `interpret=True` runs on CPU."""
  B, T, V = scores_BxTxV.shape
  Vp = pl.cdiv(V, tile) * tile
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, Vp - V)))
  draft = _clean_drafts(draft_BxT, k_B, V)
  kernel = functools.partial(_kernel, vocab=V, tile=tile)
  return row_call(kernel, B, T, interpret)(pad(scores_BxTxV), pad(q_BxTxV), draft,
                                           k_B.astype(jnp.int32), seed_Bx2.astype(jnp.uint32),
                                           count_B.astype(jnp.int32))
