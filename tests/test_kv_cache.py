"""The KV-cache forward pass: the seam for speculative verification and partial rollout."""

import jax.numpy as jnp
import numpy as np

from jaxroll.model.kv_cache import KVCache
from small_models import small_model


def _cache(model, batch, length):
  c = model.cfg
  return KVCache.zeros(c.num_layers, batch, c.num_kv_heads, length, c.head_dim, jnp.float32)


def test_prefill_then_k_tokens_in_one_pass_equals_full_forward():
  """Scoring k drafted tokens per row in one cached pass gives the logits of a
  full-sequence forward pass (what speculative verification needs)."""
  model = small_model(0)
  r = np.random.default_rng(0)
  tokens = r.integers(0, 64, size=(2, 12))
  full, _ = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(12), (2, 12)))
  cache = _cache(model, 2, 16)
  _, cache = model(jnp.asarray(tokens[:, :7]), jnp.broadcast_to(jnp.arange(7), (2, 7)), cache)
  verify, _ = model(jnp.asarray(tokens[:, 7:]), jnp.broadcast_to(jnp.arange(7, 12), (2, 5)), cache)
  np.testing.assert_allclose(np.asarray(verify), np.asarray(full[:, 7:]), atol=1e-4)


def test_rolling_back_is_moving_the_position():
  """After writing rejected draft tokens, decoding from an earlier position
  ignores them: stale entries past a query's position are never read."""
  model = small_model(1)
  tokens = np.random.default_rng(1).integers(0, 64, size=(1, 10))
  pos = lambda a, b: jnp.arange(a, b)[None]
  cache = _cache(model, 1, 16)
  _, cache = model(jnp.asarray(tokens[:, :6]), pos(0, 6), cache)
  _, dirty = model(jnp.asarray([[5, 9, 11]]), pos(6, 9), cache)  # drafts, later rejected
  accepted = jnp.asarray(tokens[:, 6:8])
  from_dirty, _ = model(accepted, pos(6, 8), dirty)
  from_clean, _ = model(accepted, pos(6, 8), cache)
  np.testing.assert_allclose(np.asarray(from_dirty), np.asarray(from_clean), atol=1e-6)


def test_rows_at_different_positions_decode_independently():
  model = small_model(2)
  r = np.random.default_rng(2)
  a, b = r.integers(0, 64, size=9).tolist(), r.integers(0, 64, size=4).tolist()
  cache = _cache(model, 2, 16)
  padded = np.zeros((2, 9), np.int64)
  padded[0], padded[1, :4] = a, b
  _, kv = model(jnp.asarray(padded), jnp.broadcast_to(jnp.arange(9), (2, 9)))
  cache = KVCache(k=tuple(c.at[:, :, :, :9].set(n) for c, n in zip(cache.k, kv.k)),
                  v=tuple(c.at[:, :, :9].set(n) for c, n in zip(cache.v, kv.v)))
  nxt = jnp.asarray([[7], [7]])
  logits, _ = model(nxt, jnp.asarray([[9], [4]]), cache)
  for row, seq in ((0, a), (1, b)):
    full, _ = model(jnp.asarray([seq + [7]]), jnp.arange(len(seq) + 1)[None])
    np.testing.assert_allclose(np.asarray(logits[row, 0]), np.asarray(full[0, -1]), atol=1e-4)
