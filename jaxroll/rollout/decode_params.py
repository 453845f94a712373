"""The rollout engine's weights: what a decode step reads, in the layout it reads them.

`DecodeParams` is the model state as the trainer holds it (shared, not
copied: the sampler's own copy, where it needs one, is made by whoever
publishes), the output head as an [E, V] array (the layout a skinny
matmul streams fastest), the policy version, R2PO's rollout head, and the
rotary cos/sin table of the engine's positions.
`forward` runs the model on them, embedding tokens from the head when the
state holds no embedding table (a tied model loaded straight into decode
layout by `jaxroll.model.hf_import.load_hf_decode_weights`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct


@struct.dataclass
class DecodeParams:
  """Weights as the decoder uses them: the model state plus an [E, V] head."""

  state: nnx.State
  head_ExV: jax.Array
  version: jax.Array  # int32 scalar: the policy version of these weights
  # R2PO's residual rollout head (jaxroll.model.residual_head) or None.
  # With it, tokens are drawn from logits + head(h), and the recorded
  # log-prob is the policy's own (without the head) at the drawn token:
  # R2PO trains the policy on these rollouts as if they were its own.
  residual: Optional[dict] = None
  # float32 scalar or None: the sparse KV budget to decode these weights
  # with (a paged cache with sparsity; jaxroll.loop.kv_budget). It travels
  # with the weights, so in async runs a batch's budget is exactly as
  # stale as the weights that sample it.
  kv_budget: Optional[jax.Array] = None
  # (cos, sin) of the rotary angles at every position the engine's cache
  # holds, [S, D/2] each, or None. Computed once: a decode step gathers its
  # rows' entries, where XLA:CPU would otherwise recompute cos and sin in
  # every layer's rotation, per head (about 8% of a small model's step).
  rope_table: Optional[tuple] = None
  # True when the state's embedding is a placeholder (a tied model loaded
  # straight into decode layout, jaxroll.model.hf_import): tokens are then
  # embedded from the head's columns, the same values as the [V, E] table.
  embed_from_head: bool = struct.field(pytree_node=False, default=False)


def make_params(graphdef, model_state: nnx.State, version, residual=None,
                head_ExV=None, kv_budget=None, rope_table=None) -> DecodeParams:
  """Decode weights: the model state as it is (no copy), the [E, V] head
  (`head_ExV`, or the model's own: an untied head as it is, a tied
  embedding transposed once per weight version) and the version."""
  embedding = model_state["embed"]["embedding"]
  embed_from_head = embedding.shape[0] == 0
  if head_ExV is None:
    if embed_from_head:
      raise ValueError("decode weights without an embedding table need their head_ExV")
    head_ExV = nnx.merge(graphdef, model_state).decode_head()
  return DecodeParams(state=model_state, head_ExV=head_ExV, version=jnp.asarray(version, jnp.int32),
                      residual=residual, embed_from_head=embed_from_head, rope_table=rope_table,
                      kv_budget=None if kv_budget is None else jnp.asarray(kv_budget, jnp.float32))


def forward(model, params: DecodeParams, tokens_BxT, positions_BxT, cache, **kwargs):
  """The model on decode weights (`Transformer.__call__`'s arguments)."""
  embedded = None
  if params.embed_from_head:  # [E, B, T] columns of the head, as [B, T, E] rows
    embedded = jnp.moveaxis(jnp.take(params.head_ExV, tokens_BxT, axis=1), 0, -1)
  return model(tokens_BxT, positions_BxT, cache, embedded_BxTxE=embedded,
               rope_table=params.rope_table, **kwargs)
