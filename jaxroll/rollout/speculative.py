"""Speculative decoding for rollout: draft on device, verify exactly, roll back by position.

One speculative step drafts up to k tokens per live row (jaxroll.rollout.drafters),
scores [last token, drafts] in one cached forward pass, and keeps the
drafts that the exact rule of jaxroll.kernels.spec_verify accepts, plus one
residual or bonus token. The KV of rejected drafts stays in the cache past
the row's position, where attention never reads it (the position rule of
jaxroll.kernels.attention), so a rollback is moving the position. When no
live row has a draft the step is a plain one-token step, so a batch with
nothing to draft pays nothing for speculation.

Each emitted token records its log-probability under the target's
processed distribution from the verifying pass and the policy version, as
plain decoding does, so on policy the trainer's ratio is 1. Stop tokens and
per-row limits inside an accepted run end the row exactly where plain
decoding would.

With `layer_skip`, the drafter is the policy's own first layers
(jaxroll.rollout.layer_skip_draft): its drafts are samples from a draft
distribution q, verified by the general rule min(1, p/q) with a residual
draw from norm(max(0, p - q)) (jaxroll.kernels.spec_verify_sampled).

The draft length adapts per row: after a pass that accepted n drafts the
next one proposes up to n + 1 (at least 1, at most k), so rows whose drafts
keep failing spend little on verification.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxroll.kernels import spec_verify, spec_verify_sampled
from jaxroll.rollout import drafters, layer_skip_draft
from jaxroll.rollout.decode_params import forward
from jaxroll.rollout.live_forward import live_forward, once_if
from jaxroll.rollout.live_rows import LiveDecode, per_live_row
from jaxroll.rollout.sampling import SamplingParams, filtered_logits
from jaxroll.types import FINISH_LENGTH, FINISH_STOP


@dataclasses.dataclass(frozen=True)
class SpeculativeSpec:
  """What the engine drafts from and how far ahead; hashable (a compile-time constant).

  Attributes:
    k: most drafted tokens per row per pass.
    history: draft from the prompt's earlier responses.
    siblings: draft from the other rows of the same group.
    max_siblings: the most sibling rows a row drafts from (its group size
      is enough).
    match_len: context tokens compared when matching a source.
    min_match: shortest match drafted from.
    history_tokens: per slot, the source window of earlier responses.
    global_tokens: 0, or (with history) a window of the most recent
      responses to other prompts, matched with the prompt's own history;
      a longer match there wins, an equal one loses to the prompt's own
      (SuffixDecoding's global fallback).
    adaptive: adapt each row's draft length to its recent acceptance.
    layer_skip: 0, or draft with the policy's first `layer_skip` layers
      and its head (self-speculation); exclusive with history and siblings.
  """

  k: int = 4
  history: bool = True
  siblings: bool = True
  max_siblings: int = 8
  match_len: int = 4
  min_match: int = 2
  history_tokens: int = 2048
  global_tokens: int = 0
  adaptive: bool = True
  layer_skip: int = 0

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"speculative k must be >= 1, got {self.k}")
    if self.layer_skip < 0:
      raise ValueError(f"speculative layer_skip must be >= 0, got {self.layer_skip}")
    if self.layer_skip and (self.history or self.siblings):
      # One pass verifies one kind of draft: point masses or samples of q.
      raise ValueError("the layer-skip drafter cannot be combined with history or sibling "
                       "drafts yet; use it alone (history=False, siblings=False)")
    if not (self.history or self.siblings or self.layer_skip):
      raise ValueError("speculative decoding needs a drafter: history, siblings or layer_skip")
    if not 1 <= self.min_match <= self.match_len:
      raise ValueError(f"need 1 <= min_match <= match_len, got {self.min_match}, {self.match_len}")
    if self.history_tokens < 1:
      raise ValueError(f"history_tokens must be >= 1, got {self.history_tokens}")
    if self.global_tokens < 0 or (self.global_tokens and not self.history):
      raise ValueError(f"global_tokens={self.global_tokens}: the global window is the history "
                       "drafter's fallback, so it needs history=True and a size >= 0")

  @property
  def source_tokens(self) -> int:
    """Width of a slot's device source: the global window, then the prompt's
    own history (later positions win ties, so the prompt's own text does)."""
    return self.history_tokens + self.global_tokens if self.history else 1


def spec_from_config(rollout_cfg):
  """The engine's SpeculativeSpec from a RolloutConfig (None when off)."""
  if not rollout_cfg.speculative:
    return None
  names = {n.strip() for n in rollout_cfg.speculative.split(",")}
  history_tokens = min(2048, rollout_cfg.speculative_history * (rollout_cfg.max_new_tokens + 1))
  return SpeculativeSpec(k=rollout_cfg.speculative_k, history="history" in names,
                         global_tokens=history_tokens if "global" in names else 0,
                         siblings="siblings" in names, adaptive=rollout_cfg.speculative_adaptive,
                         layer_skip=rollout_cfg.speculative_exit_layer if "layer_skip" in names else 0,
                         max_siblings=max(1, rollout_cfg.group_size - 1),
                         history_tokens=history_tokens)


@struct.dataclass
class SpecState:
  """Per-slot drafter inputs and counters (a DecodeState field)."""

  src_BxR: jax.Array  # int32: the slot's history source (drafters.MARK/PAD framed)
  group_B: jax.Array  # int32: the slot's group (siblings share it); -1 none
  k_B: jax.Array  # int32: the row's current draft length
  forwards_B: jax.Array  # int32: forward passes the row took part in while live
  drafted_B: jax.Array  # int32: tokens drafted for the row
  accepted_B: jax.Array  # int32: drafted tokens it emitted


def init_spec_state(spec: SpeculativeSpec, num_slots: int) -> SpecState:
  B = num_slots
  R = spec.source_tokens
  z = jnp.zeros((B,), jnp.int32)
  return SpecState(src_BxR=jnp.full((B, R), drafters.PAD, jnp.int32),
                   group_B=jnp.full((B,), -1, jnp.int32), k_B=jnp.full((B,), spec.k, jnp.int32),
                   forwards_B=z, drafted_B=z, accepted_B=z)


def insert_spec(spec_state: SpecState, slot_M, src_MxR, group_M, k: int) -> SpecState:
  put = lambda dst, src: dst.at[slot_M].set(src, mode="drop")
  M = slot_M.shape[0]
  z = jnp.zeros((M,), jnp.int32)
  return spec_state.replace(
      src_BxR=put(spec_state.src_BxR, src_MxR.astype(jnp.int32)), group_B=put(spec_state.group_B, group_M),
      k_B=put(spec_state.k_B, jnp.full((M,), k, jnp.int32)), forwards_B=put(spec_state.forwards_B, z),
      drafted_B=put(spec_state.drafted_B, z), accepted_B=put(spec_state.accepted_B, z))


def processed_scores(logits_NxV, sampling: SamplingParams):
  """Scores whose softmax is the sampling distribution, over the whole
  vocabulary (removed tokens at -inf); the raw logits under greedy."""
  if sampling.greedy:
    return logits_NxV.astype(jnp.float32)
  vals, ids = filtered_logits(logits_NxV, sampling)
  if ids is None:
    return vals
  rows = jnp.arange(vals.shape[0])[:, None]
  return jnp.full(logits_NxV.shape, -jnp.inf, jnp.float32).at[rows, ids].set(vals)


def _verifier():
  # The Pallas kernel where it compiles natively; the reference elsewhere
  # (on CPU Pallas would only interpret).
  if jax.default_backend() == "gpu":
    return spec_verify.verify
  return spec_verify.verify_reference


def _sampled_verifier():
  if jax.default_backend() == "gpu":
    return spec_verify_sampled.verify_sampled
  return spec_verify_sampled.verify_sampled_reference


def draft(spec: SpeculativeSpec, state, vocab_size: int, live: LiveDecode = LiveDecode()):
  """Each live row's drafts and how many to verify (0: nothing to draft).

  A draft ends before its first id outside the vocabulary (a corrupt
  source): such an id never reaches the embedding, whose out-of-range
  lookups would write NaN keys into the cache. With `live.rows` the search
  runs over the live rows only (jaxroll.rollout.live_rows); its drafts are
  the same.
  """
  ss = state.spec

  def rows_draft(rows_M):
    pick = (lambda x: x) if rows_M is None else (lambda x: x[rows_M])
    count_M = pick(state.count_B)
    ctx = drafters.row_context(pick(state.out_tokens_BxL), count_M, spec.match_len)
    sources = []
    if spec.history:
      sources.append(pick(ss.src_BxR))
    if spec.siblings:
      sources.append(drafters.sibling_sources(state.out_tokens_BxL, state.count_B, ss.group_B,
                                              state.active_B, spec.max_siblings, rows_M))
    src = sources[0] if len(sources) == 1 else jnp.concatenate(sources, axis=1)
    draft_MxK, available_M = drafters.propose(src, ctx, spec.k, spec.min_match, count_M)
    in_vocab = jnp.cumprod((draft_MxK >= 0) & (draft_MxK < vocab_size), axis=1)
    available_M = jnp.minimum(available_M, jnp.sum(in_vocab, axis=1))
    draft_MxK = jnp.where(in_vocab > 0, draft_MxK, 0)
    # At most the row's draft length, and one fewer than its remaining
    # budget (the pass always emits one token of its own).
    room_M = pick(state.max_new_B) - count_M - 1
    k_M = jnp.where(pick(state.live_B), jnp.clip(jnp.minimum(available_M, pick(ss.k_B)), 0, room_M), 0)
    return draft_MxK, k_M

  if live.rows:
    return per_live_row(state.live_B, rows_draft)
  return rows_draft(None)


def verify_step(graphdef, sampling: SamplingParams, spec: SpeculativeSpec, params, state,
                stop_ids, draft_BxK, k_B, q_BxKxV=None, cache=None,
                live: LiveDecode = LiveDecode()):
  """One cached forward over [token, drafts] and the exact accept rule.

  `q_BxKxV`: the draft distributions of sampled drafts (None: point
  masses); `cache`: the cache to verify in (the drafter's, when it wrote
  to it), else the state's; `live`: the part of the batch the pass runs
  over (jaxroll.rollout.live_forward).
  """
  model = nnx.merge(graphdef, params.state)
  B, K = draft_BxK.shape
  T = K + 1
  j_T = jnp.arange(T, dtype=jnp.int32)
  live_B = state.live_B
  draft_BxK = jnp.where(j_T[None, :K] < k_B[:, None], draft_BxK, 0)
  tokens_BxT = jnp.concatenate([state.token_B[:, None], draft_BxK], axis=1)
  positions_BxT = state.pos_B[:, None] + j_T[None, :]
  cache = state.cache if cache is None else cache
  padded_draft_BxT = jnp.concatenate([draft_BxK, jnp.zeros((B, 1), jnp.int32)], axis=1)

  def run(rows, kv, attention_fn):
    # The forward pass and the accept rule, over the rows live_forward picks.
    tokens_NxT, positions_NxT, draft_NxT, k_N, seed_Nx2, count_N, q_NxKxV = rows
    N = tokens_NxT.shape[0]
    logits_NxTxV, kv = forward(model, params, tokens_NxT, positions_NxT, kv, head_ExV=params.head_ExV,
                               attention_fn=attention_fn)
    V = logits_NxTxV.shape[-1]
    scores = processed_scores(logits_NxTxV.reshape(N * T, V), sampling).reshape(N, T, V)
    if q_NxKxV is None or sampling.greedy:
      return _verifier()(scores, draft_NxT, k_N, seed_Nx2, count_N, greedy=sampling.greedy), kv
    q_NxTxV = jnp.pad(q_NxKxV, ((0, 0), (0, 1), (0, 0)))
    return _sampled_verifier()(scores, q_NxTxV, draft_NxT, k_N, seed_Nx2, count_N), kv

  rows = (tokens_BxT, positions_BxT, padded_draft_BxT, k_B, state.seed_Bx2, state.count_B, q_BxKxV)
  (n_B, emit_BxT, logp_BxT), cache = live_forward(run, rows, cache, live_B, live)
  # A stop token inside the run ends the row there; so does its budget.
  is_stop_BxT = jnp.any(emit_BxT[:, :, None] == stop_ids[None, None, :], axis=-1) & (j_T <= n_B[:, None])
  first_stop_B = jnp.min(jnp.where(is_stop_BxT, j_T, T), axis=1)
  emitted_B = jnp.minimum(jnp.minimum(n_B + 1, first_stop_B + 1), state.max_new_B - state.count_B)
  emitted_B = jnp.where(live_B, emitted_B, 0)
  L = state.out_tokens_BxL.shape[1]
  rows_Bx1 = jnp.arange(B)[:, None]
  col_BxT = jnp.where(j_T[None, :] < emitted_B[:, None], state.count_B[:, None] + j_T, L)
  record = lambda buf, val: buf.at[rows_Bx1, col_BxT].set(val, mode="drop")
  count_B = state.count_B + emitted_B
  last_B = jnp.take_along_axis(emit_BxT, jnp.maximum(emitted_B - 1, 0)[:, None], axis=1)[:, 0]
  hit_stop_B = live_B & (first_stop_B < emitted_B)
  stops_B = hit_stop_B | (live_B & (count_B >= state.max_new_B))
  accepted_B = jnp.minimum(n_B, emitted_B)
  ss = state.spec
  next_k_B = jnp.clip(accepted_B + 1, 1, spec.k) if spec.adaptive else jnp.full((B,), spec.k)
  return state.replace(
      cache=cache,
      token_B=jnp.where(live_B, last_B, state.token_B),
      pos_B=state.pos_B + emitted_B,
      done_B=state.done_B | stops_B,
      count_B=count_B,
      finish_B=jnp.where(stops_B, jnp.where(hit_stop_B, FINISH_STOP, FINISH_LENGTH), state.finish_B),
      out_tokens_BxL=record(state.out_tokens_BxL, emit_BxT),
      out_logp_BxL=record(state.out_logp_BxL, logp_BxT),
      out_pos_BxL=record(state.out_pos_BxL, state.pos_B[:, None] + 1 + j_T),
      out_version_BxL=record(state.out_version_BxL, jnp.broadcast_to(params.version, (B, T))),
      spec=ss.replace(
          k_B=jnp.where(live_B & (k_B > 0), next_k_B, ss.k_B).astype(jnp.int32),
          forwards_B=ss.forwards_B + live_B,
          drafted_B=ss.drafted_B + k_B,
          accepted_B=ss.accepted_B + accepted_B),
  )


def speculative_step(graphdef, sampling: SamplingParams, spec: SpeculativeSpec, plain_step,
                     params, state, stop_ids, live: LiveDecode = LiveDecode()):
  """A verifying pass when some live row has drafts, else `plain_step`."""
  if spec.layer_skip:
    # Every live row drafts, so every step verifies (a row with no room for
    # a draft verifies k = 0: one token drawn from p, as a plain step would).
    draft_BxK, q_BxKxV, cache = layer_skip_draft.draft(graphdef, sampling, spec.layer_skip, spec.k,
                                                       params, state, processed_scores, live)
    room_B = state.max_new_B - state.count_B - 1
    k_B = jnp.where(state.live_B, jnp.clip(state.spec.k_B, 0, room_B), 0)
    return verify_step(graphdef, sampling, spec, params, state, stop_ids, draft_BxK, k_B, q_BxKxV,
                       cache, live)
  draft_BxK, k_B = draft(spec, state, params.head_ExV.shape[-1], live)

  def plain(st):
    st = plain_step(state=st)
    return st.replace(spec=st.spec.replace(forwards_B=st.spec.forwards_B + state.live_B))

  verify = lambda st: verify_step(graphdef, sampling, spec, params, st, stop_ids, draft_BxK, k_B,
                                  live=live)
  return _either(jnp.any(k_B > 0), verify, plain, state)


def _either(pred, if_true, if_false, state):
  """lax.cond(pred, if_true, if_false, state), as two loops of at most one trip.

  Inside the decode loop, a conditional whose branches both write the KV
  cache compiled on XLA:CPU with three copies of every cache layer per step
  (seen in the optimised HLO), which cost more than the step itself; with
  the loops the compiled step has none.
  """
  return once_if(~pred, if_false, once_if(pred, if_true, state))
