"""Log-probabilities of given tokens under the policy, as the trainer sees them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxroll.rollout.sampling import SamplingParams, filtered_logits


def next_token_logp(graphdef, params, tokens_NxT, sampling: SamplingParams | None = None):
  """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < T-1, shape [N, T-1].

  With `sampling`, the distribution is the one the sampler draws from (after
  temperature, top-k, top-p), so on-policy importance ratios are exactly 1;
  without it, the plain softmax (supervised training).
  Rows are right-padded; padding after a row's tokens cannot affect them
  (attention is causal by position).
  """
  model = nnx.merge(graphdef, params)
  N, T = tokens_NxT.shape
  positions_NxT = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (N, T - 1))
  logits_NxTxV, _ = model(tokens_NxT[:, :-1], positions_NxT)
  targets_NxT = tokens_NxT[:, 1:]
  if sampling is None:
    logp = jax.nn.log_softmax(logits_NxTxV, axis=-1)
    return jnp.take_along_axis(logp, targets_NxT[..., None], axis=-1)[..., 0]
  V = logits_NxTxV.shape[-1]
  scores, ids = filtered_logits(logits_NxTxV.reshape(-1, V), sampling)
  logp = jax.nn.log_softmax(scores, axis=-1)
  flat_targets = targets_NxT.reshape(-1)
  if ids is None:
    out = jnp.take_along_axis(logp, flat_targets[:, None], axis=-1)[:, 0]
  else:
    # A token outside the kept set has probability 0 under the sampler.
    match = ids == flat_targets[:, None]
    out = jnp.where(match.any(-1), jnp.sum(jnp.where(match, logp, 0.0), axis=-1), -jnp.inf)
  return out.reshape(N, T - 1)
