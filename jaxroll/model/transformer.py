"""A Llama/Qwen2-family decoder in Flax NNX.

RMSNorm, rotary embeddings (plain or Llama 3 scaled), grouped-query attention,
SwiGLU MLP, optional q/k/v bias (Qwen2), tied or untied embeddings, separate
parameter and compute dtypes.

Weights are laid out for the matmuls that decoding does: every kernel is
[in, out] (a skinny activation times a row-major weight streams the weight
once; on a 2-core CPU this runs ~1.5x faster than contracting against an
[out, in] weight), q|k|v are one fused kernel and gate|up another, so a layer
is four matmuls. A tied model's output head is `embedding.T`; decoders that
call the model many times pass a materialised [E, V] copy as `head_ExV`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxroll.kernels.attention import AttentionFn, reference_attention
from jaxroll.model.config import ModelConfig
from jaxroll.model.kv_cache import KVCache

_INIT_STD = 0.02


def matmul(x, w):
  """x @ w accumulated in float32, returned in x's dtype.

  For bfloat16 operands this is also the fast path on XLA:CPU: a dot whose
  result is bfloat16 runs a slow generic loop there (about 20x slower than
  float32 for a skinny [8, 896] @ [896, 151936]), while one that accumulates
  in float32 reads the half-size weights at full speed (0.6x float32's time
  for that shape). For float32 operands it is the plain matmul.
  """
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


class Linear(nnx.Module):
  """y = x @ kernel (+ bias), kernel stored [in, out]."""

  def __init__(self, din, dout, *, use_bias, cfg: ModelConfig, rngs: nnx.Rngs):
    self.kernel = nnx.Param(
        _INIT_STD * jax.random.normal(rngs.params(), (din, dout), cfg.jnp_param_dtype))
    self.bias = nnx.Param(jnp.zeros((dout,), cfg.jnp_param_dtype)) if use_bias else None
    self.dtype = cfg.jnp_dtype

  def __call__(self, x):
    y = matmul(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


class RMSNorm(nnx.Module):

  def __init__(self, dim, *, cfg: ModelConfig):
    self.scale = nnx.Param(jnp.ones((dim,), cfg.jnp_param_dtype))
    self.eps = cfg.rms_norm_eps
    self.dtype = cfg.jnp_dtype

  def __call__(self, x):
    # Normalise in float32 whatever the compute dtype (as Hugging Face does).
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(self.dtype) * x32.astype(self.dtype)


def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """Rotary inverse frequencies [D/2], computed in float32 like transformers."""
  d = cfg.head_dim
  inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
  if cfg.rope_llama3_scaling is not None:
    factor, low, high, old_len = cfg.rope_llama3_scaling
    wavelen = 2 * np.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


def rope_cos_sin(cfg: ModelConfig, positions):
  """cos and sin of the rotary angles at `positions` (int, any shape): two
  float32 arrays of shape positions.shape + (head_dim / 2,)."""
  # The frequencies are a compile-time constant of the config, not a parameter.
  inv_freq_D2 = jnp.asarray(rope_inverse_frequencies(cfg))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq_D2
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxTxNxD, cos_BxTxD2, sin_BxTxD2):
  """Rotates the two halves of each head (the rotate_half convention)."""
  half = x_BxTxNxD.shape[-1] // 2
  x1, x2 = x_BxTxNxD[..., :half].astype(jnp.float32), x_BxTxNxD[..., half:].astype(jnp.float32)
  cos, sin = cos_BxTxD2[:, :, None, :], sin_BxTxD2[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxD.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.qkv = Linear(cfg.hidden_size, cfg.qkv_dim, use_bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
    self.out = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, use_bias=False, cfg=cfg, rngs=rngs)

  def __call__(self, x_BxTxE, rope, positions_BxT, cache_kv, attention_fn: AttentionFn):
    cfg = self.cfg
    B, T, _ = x_BxTxE.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = self.qkv(x_BxTxE)
    # Queries and keys rotate together: one op instead of two per layer.
    qk_BxTxNxD = apply_rope(qkv[..., :(H + K) * D].reshape(B, T, H + K, D), *rope)
    q_BxTxHxD, k_BxTxKxD = qk_BxTxNxD[:, :, :H], qk_BxTxNxD[:, :, H:]
    v_BxTxKxD = qkv[..., (H + K) * D:].reshape(B, T, K, D)
    k_new_BxKxDxT = k_BxTxKxD.transpose(0, 2, 3, 1)  # the cache's key layout
    v_new_BxKxTxD = v_BxTxKxD.transpose(0, 2, 1, 3)
    if cache_kv is None:  # attend within the sequence itself
      out_BxTxHxD = attention_fn(q_BxTxHxD, k_new_BxKxDxT, v_new_BxKxTxD,
                                 positions_BxT, positions_BxT)
      return self.out(out_BxTxHxD.reshape(B, T, H * D)), (k_new_BxKxDxT, v_new_BxKxTxD)
    # With a cache: it writes the new keys at their positions, then attends
    # (entries past each query's position are hidden).
    out_BxTxHxD, new_kv = cache_kv.attend(q_BxTxHxD, k_new_BxKxDxT, v_new_BxKxTxD, positions_BxT,
                                          attention_fn)
    return self.out(out_BxTxHxD.reshape(B, T, H * D)), new_kv


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.mlp_dim = cfg.mlp_dim
    self.gate_up = Linear(cfg.hidden_size, 2 * cfg.mlp_dim, use_bias=False, cfg=cfg, rngs=rngs)
    self.down = Linear(cfg.mlp_dim, cfg.hidden_size, use_bias=False, cfg=cfg, rngs=rngs)

  def __call__(self, x):
    gu = self.gate_up(x)
    return self.down(jax.nn.silu(gu[..., :self.mlp_dim]) * gu[..., self.mlp_dim:])


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg=cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg=cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, rope, positions, cache_kv, attention_fn):
    h, new_kv = self.attn(self.attn_norm(x), rope, positions, cache_kv, attention_fn)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), new_kv


class Transformer(nnx.Module):
  """The policy: tokens in, next-token logits out.

  Example:
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits_BxTxV, kv = model(tokens_BxT, positions_BxT)
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                           param_dtype=cfg.jnp_param_dtype,
                           embedding_init=nnx.initializers.normal(_INIT_STD), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg=cfg)
    self.lm_head = None if cfg.tie_embeddings else Linear(
        cfg.hidden_size, cfg.vocab_size, use_bias=False, cfg=cfg, rngs=rngs)

  def decode_head(self) -> jax.Array:
    """The output head as an [E, V] array (a transposed copy when tied)."""
    if self.lm_head is not None:
      return self.lm_head.kernel[...]
    return self.embed.embedding[...].T

  def __call__(self, tokens_BxT, positions_BxT, cache: Optional[KVCache] = None, *,
               head_ExV: Optional[jax.Array] = None, return_logits: bool = True,
               return_hidden: bool = False, attention_fn: AttentionFn = reference_attention,
               embedded_BxTxE: Optional[jax.Array] = None, exit_layer: Optional[int] = None,
               rope_table=None):
    """Runs the decoder.

    Args:
      tokens_BxT: int32 token ids.
      positions_BxT: int32 absolute positions; with a cache, each row's T
        positions are consecutive and their keys are written there.
      cache: None to attend within `tokens_BxT` (prefill, training), or a
        KVCache or PagedKVCache to write into and attend over (decode,
        verification).
      head_ExV: optional [E, V] output head that replaces the model's own
        (decoders pass a pre-transposed copy of a tied embedding).
      return_logits: False skips the output head (prefill needs only KV).
      return_hidden: return the final-normed hidden states [B, T, E] in
        place of the logits (`project` turns them into logits; a rollout
        head such as R2PO's reads them too).
      attention_fn: the attention implementation (kernels plug in here).
      embedded_BxTxE: the tokens' embeddings, when the caller looks them up
        itself (a decoder that embeds from the [E, V] head of a tied model);
        None looks them up in the model's embedding.
      exit_layer: run only the first `exit_layer` blocks, then the final
        norm and head (LayerSkip's early exit, the self-speculative
        drafter); with a cache only those layers' entries are written.
      rope_table: optional (cos, sin), [S, D/2] each: `rope_cos_sin` at
        positions 0 .. S-1, computed once by the caller (positions past S
        read row S-1: the caller's table covers its cache).

    Returns:
      (logits_BxTxV in float32 or None, kv) where kv is the updated cache,
      or, without a cache, a KVCache of this sequence's own keys and values
      in the cache layout (keys [B,K,D,T], values [B,K,T,D]).
    """
    cfg = self.cfg
    x = self.embed(tokens_BxT) if embedded_BxTxE is None else embedded_BxTxE.astype(cfg.jnp_dtype)
    if rope_table is not None:
      # The rows' entries of a table computed once (a decoder's): the same
      # values as computing them here.
      rope = tuple(jnp.take(t, positions_BxT, axis=0, mode="clip") for t in rope_table)
    else:
      # The barrier asks for cos and sin once per forward rather than fused
      # into every layer's rotation; XLA:CPU removes it before fusing (and
      # then recomputes them per layer and per head), which is why decoders
      # pass `rope_table`.
      rope = jax.lax.optimization_barrier(rope_cos_sin(cfg, positions_BxT))
    layers_kv = []
    layers = self.layers if exit_layer is None else list(self.layers)[:exit_layer]
    for i, layer in enumerate(layers):
      layer_kv = None if cache is None else cache.layer(i)
      x, new_kv = layer(x, rope, positions_BxT, layer_kv, attention_fn)
      layers_kv.append(new_kv)
    kv = KVCache(k=tuple(k for k, _ in layers_kv), v=tuple(v for _, v in layers_kv)) \
        if cache is None else cache.with_layers(layers_kv)
    if not return_logits:
      return None, kv
    x = self.final_norm(x)
    if return_hidden:
      return x, kv
    return self.project(x, head_ExV), kv

  def project(self, hidden_BxTxE, head_ExV: Optional[jax.Array] = None) -> jax.Array:
    """Float32 logits of final-normed hidden states (`head_ExV` as in __call__)."""
    if head_ExV is None:
      head_ExV = self.decode_head()
    dtype = self.cfg.jnp_dtype
    return jnp.dot(hidden_BxTxE.astype(dtype), head_ExV.astype(dtype),
                   preferred_element_type=jnp.float32)
