"""Drafts for speculative rollout, proposed on device inside the decode loop.

A drafter proposes up to k next tokens for a row from text that RL rollout
already has: the prompt's earlier responses (prompts recur across epochs;
DAS and RhymeRL draft from them, SPEC-RL from the last one) and the
responses its G siblings are writing at the same time (Seer). Both are
sources of token sequences; the draft is the continuation of the source
position whose preceding tokens match the row's own last tokens longest
(latest on ties): a suffix match, computed by brute force over a bounded
window of sources, which on device is a few compares per source token and
needs no host round trip per step.

Sources hold token ids, with MARK at the start of each response (so a row
with no tokens yet matches the start of earlier responses: its context is
[MARK]) and PAD where there is nothing.

Drafts are point masses: whatever they propose, verification
(jaxroll.kernels.spec_verify) keeps the sampled distribution exact, so a
drafter can only change speed, never what is sampled.
"""

from __future__ import annotations

import jax.numpy as jnp

MARK = -2  # the start of a response in a draft source
PAD = -1  # no token
_NOTHING = -3  # context positions before the response start: match nothing
_OUTSIDE = -4  # source positions before its start: match nothing


def row_context(out_tokens_BxL, count_B, width: int):
  """The last `width` tokens of [MARK] + each row's generated tokens."""
  idx_BxM = count_B[:, None] - width + jnp.arange(width, dtype=jnp.int32)[None, :]
  toks = jnp.take_along_axis(out_tokens_BxL, jnp.maximum(idx_BxM, 0), axis=1)
  return jnp.where(idx_BxM >= 0, toks, jnp.where(idx_BxM == -1, MARK, _NOTHING))


def match_lengths(src_BxR, ctx_BxM):
  """For each source position i, how many of the context's last tokens equal
  the source tokens ending at i (0 .. M)."""
  M = ctx_BxM.shape[1]
  run = jnp.ones(src_BxR.shape, bool)
  total = jnp.zeros(src_BxR.shape, jnp.int32)
  for j in range(M):  # j tokens back from the end
    shifted = jnp.pad(src_BxR, ((0, 0), (j, 0)), constant_values=_OUTSIDE)[:, :src_BxR.shape[1]]
    run = run & (shifted == ctx_BxM[:, M - 1 - j, None])
    total = total + run
  return total


def propose(src_BxR, ctx_BxM, k: int, min_match: int):
  """The continuation of each row's best-matching source position.

  Args:
    src_BxR: per row, the concatenated sources it may draft from.
    ctx_BxM: its context (`row_context`).
    k: tokens to propose at most.
    min_match: the shortest match worth drafting from.

  Returns:
    (draft_BxK int32, available_B int32): the proposed tokens and how many
    of them are real (the continuation stops at a response end or PAD).
  """
  B, R = src_BxR.shape
  length_BxR = match_lengths(src_BxR, ctx_BxM)
  nxt = jnp.pad(src_BxR[:, 1:], ((0, 0), (0, 1)), constant_values=PAD)
  usable = (length_BxR >= min_match) & (nxt >= 0)
  rank = jnp.where(usable, length_BxR * (R + 1) + jnp.arange(R, dtype=jnp.int32), -1)
  best_B = jnp.argmax(rank, axis=1)
  found_B = jnp.max(rank, axis=1) >= 0
  cols = best_B[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
  draft = jnp.take_along_axis(src_BxR, jnp.minimum(cols, R - 1), axis=1)
  draft = jnp.where(cols < R, draft, PAD)
  real = jnp.cumprod(draft >= 0, axis=1)
  available = jnp.where(found_B, jnp.sum(real, axis=1), 0).astype(jnp.int32)
  return jnp.where(real > 0, draft, 0).astype(jnp.int32), available


def sibling_sources(out_tokens_BxL, count_B, group_B, active_B):
  """Each row's siblings' text so far, as one source per row.

  Row b sees, for every other slot of its group (a finished sibling too), [MARK] + that slot's
  generated tokens; other slots are PAD. Shape [B, B * (L + 1)].
  """
  B, L = out_tokens_BxL.shape
  written = jnp.arange(L)[None, :] < count_B[:, None]
  text_BxL1 = jnp.concatenate([jnp.full((B, 1), MARK, jnp.int32),
                               jnp.where(written, out_tokens_BxL, PAD)], axis=1)
  pair_BxB = ((group_B[:, None] == group_B[None, :]) & (group_B[:, None] >= 0)
              & ~jnp.eye(B, dtype=bool) & active_B[None, :])
  src = jnp.where(pair_BxB[:, :, None], text_BxL1[None, :, :], PAD)
  return src.reshape(B, B * (L + 1))
