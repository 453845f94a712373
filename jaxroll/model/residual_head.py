"""R2PO's residual rollout head (Wang et al., 2026).

A two-layer MLP over the policy's final-normed hidden state whose output
is added to the policy's logits: rollout logits = logits + W2 relu(W1 h).
Training rollouts sample from the sum; evaluation and inference use the
policy's logits alone. The head is a plain dict of arrays so that it can
be optimised, checkpointed and handed to the decoder like any pytree.
The authors' code initialises both layers from N(0, 1e-6^2), so the head
starts as (almost) the identity on the policy's distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_residual_head(key, hidden_size: int, vocab_size: int, std: float = 1e-6) -> dict:
  k1, k2 = jax.random.split(key)
  return {"w1_ExE": std * jax.random.normal(k1, (hidden_size, hidden_size), jnp.float32),
          "w2_ExV": std * jax.random.normal(k2, (hidden_size, vocab_size), jnp.float32)}


def residual_logits(head: dict, hidden_BxTxE) -> jax.Array:
  """The head's float32 addition to the logits."""
  h = hidden_BxTxE.astype(jnp.float32)
  return jax.nn.relu(h @ head["w1_ExE"]) @ head["w2_ExV"]
