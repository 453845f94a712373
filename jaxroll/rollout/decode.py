"""The rollout engine's device functions: prefill, insert, generate.

The engine owns B decode slots with a static-shape KV cache of S positions
each. A request (a prompt, or a prompt plus an already generated prefix) is
prefilled once, inserted into one or more slots (the G samples of a GRPO
group share one prefill), and decoded inside one jitted `lax.while_loop`
that stops when every row has stopped, or earlier when enough slots are free
to be worth refilling (continuous batching). Nothing recompiles per step or
per batch: slot indices, lengths, versions and step limits are traced
values; shapes come from a few buckets.

Decoding convention: a slot holds the last token whose KV is not yet in the
cache (`token_B` at `pos_B`). A step writes that token's KV, computes the
next-token logits, samples, and advances. Prefill therefore only has to fill
positions 0 .. len-2 (it computes all of them; the last is rewritten by the
first decode step with identical values), and the first sampled token goes
through the same code as every other.

Per generated token the state records the token, its behaviour
log-probability, its position and the policy version that produced it; per
row the count and finish reason.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxroll.model.kv_cache import KVCache
from jaxroll.model.paged_kv_cache import PagedKVCache, PagedSpec
from jaxroll.model.residual_head import residual_logits
from jaxroll.rollout import speculative
from jaxroll.rollout.decode_params import DecodeParams, forward
from jaxroll.rollout.live_forward import live_forward
from jaxroll.rollout.live_rows import LiveDecode
from jaxroll.rollout.sampling import SamplingParams, row_uniforms, sample_tokens, token_logp
from jaxroll.types import FINISH_LENGTH, FINISH_PREEMPTED, FINISH_STOP


@struct.dataclass
class Prefix:
  """Prefilled KV of P requests, ready to be inserted into slots."""

  kv: KVCache  # per layer: keys [P, K, D, T], values [P, K, T, D]
  last_token_P: jax.Array  # the request's final token, decoded first
  length_P: jax.Array  # tokens in the request (prompt + any carried prefix)


@struct.dataclass
class DecodeState:
  """Everything that lives in the B decode slots."""

  cache: KVCache  # per layer: keys [B, K, D, S], values [B, K, S, D]; or a PagedKVCache
  token_B: jax.Array  # int32: next token to feed
  pos_B: jax.Array  # int32: its position
  active_B: jax.Array  # bool: slot holds a request
  done_B: jax.Array  # bool: that request has stopped
  count_B: jax.Array  # int32: tokens generated so far
  max_new_B: jax.Array  # int32: generation limit of the request
  seed_Bx2: jax.Array  # uint32 per-request sampling seed (from its PRNG key)
  finish_B: jax.Array  # int32 FINISH_* code
  out_tokens_BxL: jax.Array  # int32 generated tokens
  out_logp_BxL: jax.Array  # float32 behaviour log-probs
  out_pos_BxL: jax.Array  # int32 absolute position of each generated token
  out_version_BxL: jax.Array  # int32 policy version that sampled each token
  # Drafter inputs and counters when the engine speculates, else None.
  spec: Optional[speculative.SpecState] = None

  @property
  def live_B(self):
    return self.active_B & ~self.done_B


def init_decode_state(cfg, num_slots: int, cache_len: int, max_new_tokens: int,
                      cache_dtype, spec: Optional[speculative.SpeculativeSpec] = None,
                      paged: Optional[PagedSpec] = None) -> DecodeState:
  B, L = num_slots, max_new_tokens
  zeros_i = lambda *s: jnp.zeros(s, jnp.int32)
  shape = (cfg.num_layers, B, cfg.num_kv_heads, cache_len, cfg.head_dim, cache_dtype)
  return DecodeState(
      cache=KVCache.zeros(*shape) if paged is None else PagedKVCache.zeros(paged, *shape),
      token_B=zeros_i(B), pos_B=zeros_i(B),
      active_B=jnp.zeros((B,), bool), done_B=jnp.zeros((B,), bool),
      count_B=zeros_i(B), max_new_B=zeros_i(B),
      seed_Bx2=jnp.zeros((B, 2), jnp.uint32),
      finish_B=zeros_i(B),
      out_tokens_BxL=zeros_i(B, L), out_logp_BxL=jnp.zeros((B, L), jnp.float32),
      out_pos_BxL=zeros_i(B, L), out_version_BxL=zeros_i(B, L),
      spec=None if spec is None else speculative.init_spec_state(spec, B))


def prefill(graphdef, params: DecodeParams, tokens_PxT, length_P) -> Prefix:
  """Computes the KV of P right-padded requests (no output head)."""
  model = nnx.merge(graphdef, params.state)
  P, T = tokens_PxT.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (P, T))
  _, kv = forward(model, params, tokens_PxT, positions, None, return_logits=False)
  last = jnp.take_along_axis(tokens_PxT, (length_P - 1)[:, None], axis=1)[:, 0]
  return Prefix(kv=kv, last_token_P=last, length_P=length_P)


def insert(state: DecodeState, prefix: Prefix, slot_M, row_M, seed_Mx2, max_new_M,
           count_M, src_MxR=None, group_M=None, draft_k: int = 0) -> DecodeState:
  """Places prefix rows `row_M` into slots `slot_M` (slot == B means skip).

  Several slots may take the same prefix row: the G samples of a group share
  one prefill. M is fixed by the caller (padded with skipped entries) so the
  function compiles once per prefix shape. `count_M` is how many tokens the
  row has already generated (0 for a new row): a resumed row's prefix ends
  with them, and sampling continues its key's stream from that count.
  With speculation, `src_MxR` and `group_M` are the rows' history sources
  and groups (jaxroll.rollout.speculative), `draft_k` the first draft length.
  """
  T = prefix.kv.v[0].shape[2]
  put = lambda dst, src: dst.at[slot_M].set(src, mode="drop")
  put_k = lambda c_BxKxDxS, n_PxKxDxT: c_BxKxDxS.at[slot_M, :, :, :T].set(
      n_PxKxDxT[row_M].astype(c_BxKxDxS.dtype), mode="drop")
  put_v = lambda c_BxKxSxD, n_PxKxTxD: c_BxKxSxD.at[slot_M, :, :T, :].set(
      n_PxKxTxD[row_M].astype(c_BxKxSxD.dtype), mode="drop")
  if isinstance(state.cache, PagedKVCache):  # slots of one prefix row share its pages
    cache = state.cache.insert(prefix.kv, prefix.length_P, slot_M, row_M)
  else:
    cache = KVCache(k=tuple(put_k(c, n) for c, n in zip(state.cache.k, prefix.kv.k)),
                    v=tuple(put_v(c, n) for c, n in zip(state.cache.v, prefix.kv.v)))
  M = slot_M.shape[0]
  return state.replace(
      cache=cache,
      token_B=put(state.token_B, prefix.last_token_P[row_M]),
      pos_B=put(state.pos_B, prefix.length_P[row_M] - 1),
      active_B=put(state.active_B, jnp.ones((M,), bool)),
      done_B=put(state.done_B, jnp.zeros((M,), bool)),
      count_B=put(state.count_B, count_M),
      max_new_B=put(state.max_new_B, max_new_M),
      seed_Bx2=put(state.seed_Bx2, seed_Mx2),
      finish_B=put(state.finish_B, jnp.zeros((M,), jnp.int32)),
      spec=None if state.spec is None else speculative.insert_spec(
          state.spec, slot_M, src_MxR, group_M, draft_k),
  )


def decode_step(graphdef, sampling: SamplingParams, params: DecodeParams,
                state: DecodeState, stop_ids, live: LiveDecode = LiveDecode()) -> DecodeState:
  """One token for every live row; finished and empty rows are left unchanged.

  `live`: attend over the live rows and the positions they have reached
  only (jaxroll.rollout.live_rows; the engine's choice).
  """
  model = nnx.merge(graphdef, params.state)
  live_B = state.live_B

  def run(rows, cache, attention_fn):
    # The forward pass and the draw, over the rows live_forward picks.
    token_N, pos_N, seed_Nx2, count_N = rows
    u_N = row_uniforms(seed_Nx2, count_N)
    if params.residual is None:
      logits_Nx1xV, cache = forward(model, params, token_N[:, None], pos_N[:, None], cache,
                                    head_ExV=params.head_ExV, attention_fn=attention_fn)
      return sample_tokens(logits_Nx1xV[:, 0], u_N, sampling), cache
    h_Nx1xE, cache = forward(model, params, token_N[:, None], pos_N[:, None], cache, return_hidden=True,
                             attention_fn=attention_fn)
    logits_NxV = model.project(h_Nx1xE, params.head_ExV)[:, 0]
    rollout_NxV = logits_NxV + residual_logits(params.residual, h_Nx1xE)[:, 0]
    tok_N, _ = sample_tokens(rollout_NxV, u_N, sampling)
    return (tok_N, token_logp(logits_NxV, tok_N, sampling)), cache

  (tok_B, logp_B), cache = live_forward(run, (state.token_B, state.pos_B, state.seed_Bx2, state.count_B),
                                        state.cache, live_B, live)
  B, L = state.out_tokens_BxL.shape
  rows = jnp.arange(B)
  col_B = jnp.where(live_B, state.count_B, L)  # L is out of range: dropped
  record = lambda buf, val: buf.at[rows, col_B].set(val, mode="drop")
  new_pos_B = state.pos_B + 1
  count_B = state.count_B + live_B
  hit_stop_B = jnp.any(tok_B[:, None] == stop_ids[None, :], axis=-1)
  hit_len_B = count_B >= state.max_new_B
  stops_B = live_B & (hit_stop_B | hit_len_B)
  finish_B = jnp.where(stops_B, jnp.where(hit_stop_B, FINISH_STOP, FINISH_LENGTH), state.finish_B)
  return state.replace(
      cache=cache,
      token_B=jnp.where(live_B, tok_B, state.token_B),
      pos_B=jnp.where(live_B, new_pos_B, state.pos_B),
      done_B=state.done_B | stops_B,
      count_B=count_B,
      finish_B=finish_B,
      out_tokens_BxL=record(state.out_tokens_BxL, tok_B),
      out_logp_BxL=record(state.out_logp_BxL, logp_B),
      out_pos_BxL=record(state.out_pos_BxL, new_pos_B),
      out_version_BxL=record(state.out_version_BxL, jnp.broadcast_to(params.version, (B,))),
  )


def _paged_step(step, write_len: int, state: DecodeState) -> DecodeState:
  """`step` with pages taken before it and given back by rows it finished.

  A step writes at most `write_len` positions per row (a verifying pass
  writes the token and k drafts). A live row that gets no page is
  preempted: it stops as FINISH_PREEMPTED, and the engine resumes it.
  """
  was_live_B = state.live_B
  cache, ok_B = state.cache.reserve(state.pos_B, write_len, was_live_B)
  preempted_B = ~ok_B
  state = state.replace(cache=cache, done_B=state.done_B | preempted_B,
                        finish_B=jnp.where(preempted_B, FINISH_PREEMPTED, state.finish_B))
  state = step(state=state)
  return state.replace(cache=state.cache.release(was_live_B & state.done_B))


def complete_groups(group_B, live_B):
  """How many groups have no live slot among the slots labelled with them.

  group_B: int32 label per slot in [0, B), or B for a slot no group counts.
  """
  B = live_B.shape[0]
  held = jnp.zeros((B + 1,), jnp.int32).at[group_B].add(1)[:B]
  live = jnp.zeros((B + 1,), jnp.int32).at[group_B].add(live_B.astype(jnp.int32))[:B]
  return jnp.sum((held > 0) & (live == 0))


def generate(graphdef, sampling: SamplingParams, params: DecodeParams, state: DecodeState,
             stop_ids, max_steps, exit_when_free, group_B=None, groups_needed=None,
             spec: Optional[speculative.SpeculativeSpec] = None, live: LiveDecode = LiveDecode()):
  """Decodes until no row is live, `max_steps` steps ran, at least
  `exit_when_free` slots are free (empty or finished), or at least
  `groups_needed` of the groups that label slots in `group_B` have no live
  slot left (partial rollout's stop, checked every step without a return
  to the host; None: not checked).

  With `spec`, a step drafts and verifies (several tokens per row per step).
  `live`: what part of the batch a step works over (jaxroll.rollout.live_rows).

  Returns:
    (state, steps): steps is how many decode steps (forward passes) ran.
  """
  step = functools.partial(decode_step, graphdef, sampling, params, stop_ids=stop_ids,
                           live=live)
  if spec is not None:
    step = functools.partial(speculative.speculative_step, graphdef, sampling, spec, step,
                             params, stop_ids=stop_ids, live=live)
  if isinstance(state.cache, PagedKVCache):
    step = functools.partial(_paged_step, step, 1 + (spec.k if spec is not None else 0))
    if params.kv_budget is not None:  # the budget these weights were published with
      state = state.replace(cache=state.cache.replace(budget=params.kv_budget))

  def cond(carry):
    st, i = carry
    free = jnp.sum(~st.live_B)
    go = jnp.any(st.live_B) & (i < max_steps) & (free < exit_when_free)
    if group_B is not None:
      go &= complete_groups(group_B, st.live_B) < groups_needed
    return go

  def body(carry):
    st, i = carry
    return step(state=st), i + 1

  return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
