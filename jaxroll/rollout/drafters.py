"""Drafts for speculative rollout, proposed on device inside the decode loop.

A drafter proposes up to k next tokens for a row from text that RL rollout
already has: the prompt's earlier responses (prompts recur across epochs;
DAS and RhymeRL draft from them, SPEC-RL from the last one) and the
responses its G siblings are writing at the same time (Seer). Both are
sources of token sequences; the draft is the continuation of the source
position whose preceding tokens match the row's own last tokens longest
(then one at the row's own offset into its response, then the one with
more tokens after it, then the latest): a suffix match, computed by brute
force over a bounded window of sources, which on device is a few compares
per source token and needs no host round trip per step.

Sources hold token ids, with MARK at the start of each response (so a row
with no tokens yet matches the start of earlier responses: its context is
[MARK]) and PAD where there is nothing.

Drafts are point masses: whatever they propose, verification
(jaxroll.kernels.spec_verify) keeps the sampled distribution exact, so a
drafter can only change speed, never what is sampled.
"""

from __future__ import annotations

import jax
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


def propose(src_BxR, ctx_BxM, k: int, min_match: int, count_B=None):
  """The continuation of each row's best-matching source position.

  Args:
    src_BxR: per row, the concatenated sources it may draft from.
    ctx_BxM: its context (`row_context`).
    k: tokens to propose at most.
    min_match: the shortest match worth drafting from.
    count_B: the rows' generated counts: a row whose whole text so far
      (back to its MARK) matches is drafted from even when that is shorter
      than min_match, since the response start anchors the match (how a
      row with no tokens yet drafts the start of an earlier response).

  Returns:
    (draft_BxK int32, available_B int32): the proposed tokens and how many
    of them are real (the continuation stops at a response end or PAD).
  """
  B, R = src_BxR.shape
  length_BxR = match_lengths(src_BxR, ctx_BxM)
  # How many real tokens follow each position (up to k): in repetitive
  # text the latest match often sits at a response's end with nothing to
  # propose, so among equally long matches the longer continuation wins.
  # (Shifted windows of one padded mask: shifting the source itself, by a
  # slice and a pad per j, ran 2.3x slower on XLA:CPU.)
  real_BxRk = jnp.pad(src_BxR >= 0, ((0, 0), (0, k + 1)))
  follow_BxR = jnp.zeros((B, R), jnp.int32)
  run = jnp.ones((B, R), bool)
  for j in range(1, k + 1):
    run = run & real_BxRk[:, j:j + R]
    follow_BxR = follow_BxR + run
  need_B = jnp.full((B,), min_match) if count_B is None else jnp.minimum(min_match, count_B + 1)
  usable = (length_BxR >= need_B[:, None]) & (follow_BxR > 0)
  # Among equally long matches, one at the row's own offset into its
  # response comes first: an earlier answer to the same prompt, re-aligned
  # where the two agree (SPEC-RL), rather than a repeat elsewhere in it.
  aligned_BxR = jnp.zeros((B, R), jnp.int32)
  if count_B is not None:
    # A MARK exactly count_B positions back. (Whether another MARK lies in
    # between is not checked: the exact test is a cumulative max over the
    # source, which took 3.1 ms on XLA:CPU for 128 rows of 1,028 tokens, more
    # than the rest of `propose` (1.2 ms); and this is only a tie-break, so
    # it cannot change what is sampled.)
    # Each row's MARK mask shifted right by its count: one slice per row
    # (a per-element gather of the same took 1.7x as long on XLA:CPU).
    mark_Bx2R = jnp.pad(src_BxR == MARK, ((0, 0), (R, 0)))
    shift = lambda row, c: jax.lax.dynamic_slice(row, (R - jnp.clip(c, 0, R),), (R,))
    aligned_BxR = jax.vmap(shift)(mark_Bx2R, count_B).astype(jnp.int32)
  score = (length_BxR * 2 + aligned_BxR) * (k + 1) + follow_BxR
  # The position rides in the low digits of the rank, so its maximum alone
  # names the best position (an argmax is a two-operand reduction, several
  # times slower on XLA:CPU).
  rank = jnp.where(usable, score * (R + 1) + jnp.arange(R, dtype=jnp.int32), -1)
  top_B = jnp.max(rank, axis=1)
  best_B = jnp.maximum(top_B, 0) % (R + 1)
  found_B = top_B >= 0
  cols = best_B[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
  draft = jnp.take_along_axis(src_BxR, jnp.minimum(cols, R - 1), axis=1)
  draft = jnp.where(cols < R, draft, PAD)
  real = jnp.cumprod(draft >= 0, axis=1)
  available = jnp.where(found_B, jnp.sum(real, axis=1), 0).astype(jnp.int32)
  return jnp.where(real > 0, draft, 0).astype(jnp.int32), available


def sibling_sources(out_tokens_BxL, count_B, group_B, active_B, max_siblings: int, rows_M=None):
  """Each row's siblings' text so far, as one source per row.

  Row b sees up to `max_siblings` other slots of its group (a finished
  sibling too, until its slot is reused), each as [MARK] + that slot's
  generated tokens; missing siblings are PAD. Shape [M, S * (L + 1)] with
  S = min(max_siblings, B - 1), for the rows `rows_M` (None: every slot,
  M = B): the cost follows the group and the rows asked for, not B^2 L.
  """
  B, L = out_tokens_BxL.shape
  S = max(1, min(max_siblings, B - 1))
  written = jnp.arange(L)[None, :] < count_B[:, None]
  text_BxL1 = jnp.concatenate([jnp.full((B, 1), MARK, jnp.int32),
                               jnp.where(written, out_tokens_BxL, PAD)], axis=1)
  slots = jnp.arange(B, dtype=jnp.int32)
  rows_M = slots if rows_M is None else rows_M
  group_M = group_B[rows_M]
  pair_MxB = ((group_M[:, None] == group_B[None, :]) & (group_M[:, None] >= 0)
              & (rows_M[:, None] != slots[None, :]) & active_B[None, :])
  # The first S sibling slots of each row, in slot order: a sibling's rank
  # among the row's siblings is a running count, and the slot lands at that
  # rank. (An argsort of the B x B pairs did the same at 3.8 ms on XLA:CPU
  # for 128 slots, more than the rest of the drafter.)
  rank_MxB = jnp.cumsum(pair_MxB, axis=1) - 1
  hit_MxBxS = pair_MxB[:, :, None] & (rank_MxB[:, :, None] == jnp.arange(S)[None, None, :])
  is_sib_MxS = jnp.any(hit_MxBxS, axis=1)
  order_MxS = jnp.sum(jnp.where(hit_MxBxS, slots[None, :, None], 0), axis=1)
  # One gather per sibling, joined along the row: gathering [M, S, L + 1]
  # and reshaping it to [M, S * (L + 1)] cost XLA:CPU a relayout copy, 3x
  # the gathers themselves.
  return jnp.concatenate([jnp.where(is_sib_MxS[:, s, None], text_BxL1[order_MxS[:, s]], PAD)
                          for s in range(S)], axis=1)
