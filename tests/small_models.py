"""Tiny jaxroll models built from configs, with peaked next-token distributions."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxroll.model import ModelConfig, Transformer


def small_config(**kw) -> ModelConfig:
  base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              mlp_dim=48, tie_embeddings=True, qkv_bias=True)
  base.update(kw)
  return ModelConfig(**base)


def small_model(seed: int = 0, **kw) -> Transformer:
  model = Transformer(small_config(**kw), rngs=nnx.Rngs(seed))
  # The default init gives near-uniform logits; a larger embedding makes the
  # distributions peaked, so sampling and decoding errors show.
  emb = model.embed.embedding
  emb[...] = emb[...] * 40.0
  return model


def full_forward_logp(model, tokens_1xT):
  """log_softmax of full-sequence logits (no cache): the teacher-forced reference."""
  T = tokens_1xT.shape[1]
  logits, _ = model(jnp.asarray(tokens_1xT, jnp.int32), jnp.arange(T, dtype=jnp.int32)[None])
  return jax.nn.log_softmax(logits[0], axis=-1)
