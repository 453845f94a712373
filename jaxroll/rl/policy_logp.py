"""Log-probabilities of given tokens under the policy, as the trainer sees them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxroll.model.residual_head import residual_logits
from jaxroll.rollout.sampling import SamplingParams, token_logp


def next_token_logp(graphdef, params, tokens_NxT, sampling: SamplingParams | None = None,
                    residual=None):
  """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < T-1, shape [N, T-1].

  With `sampling`, the distribution is the one the sampler draws from (after
  temperature, top-k, top-p), so on-policy importance ratios are exactly 1;
  without it, the plain softmax (supervised training). `residual`: R2PO's
  rollout head (jaxroll.model.residual_head), added to the logits.
  Rows are right-padded; padding after a row's tokens cannot affect them
  (attention is causal by position).
  """
  model = nnx.merge(graphdef, params)
  N, T = tokens_NxT.shape
  positions_NxT = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (N, T - 1))
  hidden_NxTxE, _ = model(tokens_NxT[:, :-1], positions_NxT, return_hidden=True)
  logits_NxTxV = model.project(hidden_NxTxE)
  if residual is not None:
    logits_NxTxV = logits_NxTxV + residual_logits(residual, hidden_NxTxE)
  targets_NxT = tokens_NxT[:, 1:]
  if sampling is None:
    logp = jax.nn.log_softmax(logits_NxTxV, axis=-1)
    return jnp.take_along_axis(logp, targets_NxT[..., None], axis=-1)[..., 0]
  V = logits_NxTxV.shape[-1]
  # A token outside the kept set has probability 0 under the sampler (-inf).
  return token_logp(logits_NxTxV.reshape(-1, V), targets_NxT.reshape(-1), sampling).reshape(N, T - 1)
