"""Self-speculative drafts: the policy's first layers plus its head as the draft model (LayerSkip).

The draft model is the same network exiting after its first `exit_layer`
blocks (`Transformer.__call__(exit_layer=...)`): no second set of weights,
and no second cache. A prefix of the layers computes, at every position,
exactly what the full model computes in those layers, so the draft writes
its keys and values into the first layers of the policy's own cache, and
the verifying pass then rewrites the same positions in every layer. (Any
other subset, such as Nested-ReFT's first-and-last, would see different
inputs at its later layers and need a cache of its own.)

Each of the k draft steps feeds one token per row, draws d ~ q from the
draft's processed distribution (the same temperature, top-k and top-p as
the target, so q is as close to p as the draft can be) with its own stream
of the counter hash, and keeps q for the general accept rule
(jaxroll.kernels.spec_verify_sampled). Under greedy decoding the draft is
the draft model's argmax, a point mass, verified by the point-mass rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxroll.kernels.spec_verify_sampled import draft_uniform
from jaxroll.rollout.decode_params import forward
from jaxroll.rollout.live_rows import LiveDecode, step_attention


def draft(graphdef, sampling, exit_layer: int, k: int, params, state, processed_scores,
          live: LiveDecode = LiveDecode()):
  """k tokens per row from the early-exit model.

  Returns:
    (draft_BxK int32, q_BxKxV float32 or None under greedy, cache): the
    draft distributions, and the cache with the draft's keys and values in
    its first `exit_layer` layers at positions pos .. pos + k - 1 (the
    verifying pass overwrites them).
  """
  model = nnx.merge(graphdef, params.state)
  seed0, seed1 = state.seed_Bx2[:, 0], state.seed_Bx2[:, 1]
  attention_fn = step_attention(state.cache, state.live_B, live)

  def one(carry, j):
    cache, token_B = carry
    logits, cache = forward(model, params, token_B[:, None], (state.pos_B + j)[:, None], cache,
                            head_ExV=params.head_ExV, exit_layer=exit_layer,
                            attention_fn=attention_fn)
    scores_BxV = processed_scores(logits[:, 0], sampling)
    if sampling.greedy:
      d_B = jnp.argmax(scores_BxV, axis=-1).astype(jnp.int32)
      return (cache, d_B), d_B
    V = scores_BxV.shape[-1]
    counter = (state.count_B + j).astype(jnp.uint32)[:, None]
    u = draft_uniform(seed0[:, None], seed1[:, None], counter, jnp.arange(V, dtype=jnp.uint32))
    d_B = jnp.argmax(scores_BxV - jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)
    return (cache, d_B), (d_B, jax.nn.softmax(scores_BxV, axis=-1))

  (cache, _), drawn = jax.lax.scan(one, (state.cache, state.token_B), jnp.arange(k, dtype=jnp.int32))
  if sampling.greedy:
    return drawn.T, None, cache
  draft_KxB, q_KxBxV = drawn
  return draft_KxB.T, jnp.moveaxis(q_KxBxV, 0, 1), cache
