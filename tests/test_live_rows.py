"""Decode over the live part of the batch (its live rows, the cache positions they have
reached): the same tokens as over every slot and position, attention within float32
rounding (row buckets alone: bitwise at the default policy's shapes), the same drafts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxroll.kernels.attention import reference_attention
from jaxroll.model import Transformer
from jaxroll.rollout import RolloutEngine
from jaxroll.rollout.live_rows import LiveDecode, bucket_sizes, live_attention, window_sizes
from jaxroll.rollout.speculative import SpeculativeSpec
from small_models import small_config


def test_bucket_sizes_halve_from_the_slot_count_and_never_hold_one_row():
  assert bucket_sizes(128) == [8, 16, 32, 64, 128]
  assert bucket_sizes(16) == [2, 4, 8, 16]
  assert bucket_sizes(12) == [3, 6, 12]
  assert bucket_sizes(3) == [3] and bucket_sizes(1) == [1]


def test_window_sizes_halve_the_cache_in_multiples_of_16_and_never_below_64():
  assert window_sizes(780) == [112, 208, 400, 780]
  assert window_sizes(2048) == [256, 512, 1024, 2048]
  assert window_sizes(160) == [80, 160]
  assert window_sizes(100) == [64, 100]
  assert window_sizes(40) == [40]


def _attend_both(shape, T, num_live, seed):
  """(live rows' outputs, whole-batch outputs, live mask, all outputs)."""
  B, K, R, D, S = shape
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, K * R, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, K, D, S)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32)
  q_pos = jnp.asarray(rng.integers(0, S - T, size=(B, 1)) + np.arange(T)[None], jnp.int32)
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
  live = np.zeros(B, bool)
  live[rng.choice(B, num_live, replace=False)] = True
  whole = np.asarray(jax.jit(reference_attention)(q, k, v, q_pos, k_pos))
  live_only = jax.jit(lambda *a: live_attention(jnp.asarray(live), LiveDecode(rows=True))(*a))
  out = np.asarray(live_only(q, k, v, q_pos, k_pos))
  return out[live], whole[live], live, out


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("num_live", [1, 2, 3, 5, 8, 9, 16])
def test_live_rows_get_the_whole_batch_attention(T, num_live):
  """At a small shape XLA:CPU picks its matmul path by the batch's size,
  so the bucket's numbers may differ from the whole batch's in the last
  bit (as two engines with different slot counts already do)."""
  B = 16
  got, want, live, out = _attend_both((B, 2, 2, 8, 40), T, num_live, num_live * 10 + T)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
  # Rows that are not live are not computed: their zeros show the bucket
  # held only the live rows (unless the whole batch was needed; row 0
  # fills a bucket's spare places).
  skipped = ~live
  skipped[0] = False
  if num_live <= B // 2:
    assert not out[skipped].any()


@pytest.mark.parametrize("T, S", [(1, 776), (5, 780)], ids=["plain", "verifying"])
@pytest.mark.parametrize("num_live", [1, 2, 9, 17, 33, 100])
def test_live_rows_are_bitwise_the_whole_batch_at_the_default_policy_shape(T, S, num_live):
  """The default task's decode attention: 128 slots, 2 KV heads of 2
  queries, head size 32; a plain step over 8 + 768 positions, a verifying
  pass (k = 4) over 4 more."""
  got, want, _, _ = _attend_both((128, 2, 2, 32, S), T, num_live, num_live + T)
  np.testing.assert_array_equal(got, want)


_WINDOWED = {rows: jax.jit(lambda live, *a, rows=rows: live_attention(
    live, LiveDecode(rows=rows, window=True))(*a)) for rows in (False, True)}


@pytest.mark.parametrize("rows", [False, True], ids=["every row", "live rows"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("reach", [1, 112, 113, 208, 209, 400, 401, 780])
def test_windowed_attention_is_the_whole_cache_attention(rows, T, reach):
  """One live query sits at position reach - 1, at and just past each
  window's edge (windows of 112, 208, 400 and 780 positions), the other
  live rows short of it, the rows that are not live at the cache's end
  (they must not set the window). A window that stopped one position
  short would hide that query's own key."""
  B, S = 16, 780
  rng = np.random.default_rng(reach * 10 + T)
  live = np.zeros(B, bool)
  live[rng.choice(B, 5, replace=False)] = True
  last = np.where(live, rng.integers(T - 1, max(reach, T), size=B), S - 1)
  last[np.flatnonzero(live)[0]] = max(reach - 1, T - 1)
  q_pos = jnp.asarray(last[:, None] - (T - 1) + np.arange(T)[None], jnp.int32)
  q = jnp.asarray(rng.normal(size=(B, T, 4, 32)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, 2, 32, S)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, 2, S, 32)), jnp.float32)
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
  whole = np.asarray(jax.jit(reference_attention)(q, k, v, q_pos, k_pos))
  got = np.asarray(_WINDOWED[rows](jnp.asarray(live), q, k, v, q_pos, k_pos))
  np.testing.assert_allclose(got[live], whole[live], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("window", [False, True], ids=["rows", "rows and window"])
def test_engine_decodes_the_same_tokens_and_logps_over_live_rows_as_over_every_slot(window):
  """Rows stop at different steps (a near-uniform model, one stop id), so
  the live count passes through the buckets 8, 4 and 2, and the cache's
  windows of 80 and 136 positions both serve; every token matches the
  engine that attends over all slots and positions and every log-prob
  matches within float32 rounding, and so does a row decoded alone."""
  model = Transformer(small_config(), rngs=nnx.Rngs(4))
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, 64, size=rng.integers(1, 13)).tolist() for _ in range(12)]
  keys = jax.random.split(jax.random.key(11), 12)
  kw = dict(num_slots=8, max_prompt_len=16, max_new_tokens=120, stop_token_ids=[5])
  live = RolloutEngine.for_model(model, cache_window=window, **kw)
  every = RolloutEngine.for_model(model, live_rows=False, cache_window=False, **kw)
  assert live.live_rows and not every.live_rows and live.cache_window == window
  params = live.load(model)
  a = live.rollout(params, prompts, row_keys=keys)
  b = every.rollout(params, prompts, row_keys=keys)
  np.testing.assert_array_equal(a.tokens_NxL, b.tokens_NxL)
  np.testing.assert_allclose(a.logp_NxL, b.logp_NxL, rtol=0, atol=1e-6)
  assert len(set(a.length_N.tolist())) >= 6, a.length_N
  reached = max(len(p) + n for p, n in zip(prompts, a.length_N.tolist()))
  assert reached > 80, reached  # some steps needed the whole cache
  for n in (int(np.argmin(a.length_N)), int(np.argmax(a.length_N))):
    alone = live.rollout(params, [prompts[n]], row_keys=keys[n:n + 1])
    assert alone.row(0) == a.row(n)
    np.testing.assert_allclose(alone.logp_NxL[0], a.logp_NxL[n], rtol=0, atol=1e-6)


def test_speculative_engine_drafts_and_decodes_the_same_over_live_rows():
  """Drafting (history and siblings) and verification over the live rows:
  the same drafts (integers), so the same drafted and accepted counts, and
  the same tokens as the engine that works over every slot."""
  model = Transformer(small_config(vocab_size=8), rngs=nnx.Rngs(5))
  model.embed.embedding[...] = model.embed.embedding[...] * 5.0  # peaked: drafts get accepted
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 8, size=rng.integers(1, 9)).tolist() for _ in range(4)]
  spec = SpeculativeSpec(k=3, max_siblings=3)
  kw = dict(num_slots=16, max_prompt_len=16, max_new_tokens=120, stop_token_ids=[0],
            speculative=spec)
  live = RolloutEngine.for_model(model, **kw)
  every = RolloutEngine.for_model(model, live_rows=False, cache_window=False, **kw)
  params = live.load(model)
  for e in (live, every):  # one earlier answer per prompt, so history drafts too
    e.rollout(params, prompts, group_size=4, key=jax.random.key(1))
  a = live.rollout(params, prompts, group_size=4, key=jax.random.key(2))
  stats = live.last_stats
  b = every.rollout(params, prompts, group_size=4, key=jax.random.key(2))
  np.testing.assert_array_equal(a.tokens_NxL, b.tokens_NxL)
  np.testing.assert_allclose(a.logp_NxL, b.logp_NxL, rtol=0, atol=1e-6)
  assert (stats.drafted, stats.accepted) == (every.last_stats.drafted, every.last_stats.accepted)
  assert stats.accepted > 0 and len(set(a.length_N.tolist())) >= 4, a.length_N


@pytest.mark.parametrize("num_live,T", [(1, 1), (3, 1), (5, 3), (15, 1)])
def test_live_forward_writes_the_live_rows_cache_and_leaves_every_other_row_alone(num_live, T):
  """The forward over the live rows' bucket: the live rows' logits and new
  keys and values equal the whole-batch forward's (float32 rounding), and
  the cache of every row not live is exactly the cache it was given
  (places past the live rows in a bucket write nowhere; the whole batch's
  bucket writes each row's own new positions only)."""
  from jaxroll.model.kv_cache import KVCache
  from jaxroll.rollout.live_forward import live_forward

  cfg = small_config()
  model = Transformer(cfg, rngs=nnx.Rngs(6))
  B, S = 16, 96
  rng = np.random.default_rng(num_live)
  shape_k, shape_v = (B, cfg.num_kv_heads, cfg.head_dim, S), (B, cfg.num_kv_heads, S, cfg.head_dim)
  cache = KVCache(k=tuple(jnp.asarray(rng.normal(size=shape_k), jnp.float32) for _ in range(cfg.num_layers)),
                  v=tuple(jnp.asarray(rng.normal(size=shape_v), jnp.float32) for _ in range(cfg.num_layers)))
  live = np.zeros(B, bool)
  # Row 0 is never live here: nothing may write it, not even a bucket's
  # spare places (row 0 is where an index fill would point).
  live[1 + rng.choice(B - 1, num_live, replace=False)] = True
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, T)), jnp.int32)
  positions = jnp.asarray(rng.integers(0, S - T, size=(B, 1)) + np.arange(T)[None], jnp.int32)
  run = lambda rows, kv, attn: model(rows[0], rows[1], kv, attention_fn=attn)
  for window in (False, True):
    got, got_cache = jax.jit(lambda c, w=window: live_forward(
        run, (tokens, positions), c, jnp.asarray(live), LiveDecode(rows=True, window=w)))(cache)
    want, want_cache = jax.jit(lambda c: run((tokens, positions), c, reference_attention))(cache)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], rtol=1e-5, atol=1e-5)
    for layer in range(cfg.num_layers):
      for mine, full, given in ((got_cache.k[layer], want_cache.k[layer], cache.k[layer]),
                                (got_cache.v[layer], want_cache.v[layer], cache.v[layer])):
        np.testing.assert_allclose(np.asarray(mine)[live], np.asarray(full)[live], rtol=1e-5, atol=1e-5)
        if num_live <= B // 2:  # a bucket smaller than the batch
          np.testing.assert_array_equal(np.asarray(mine)[~live], np.asarray(given)[~live])
        else:  # the whole batch's forward, which writes each row's own positions only
          seq_axis = 3 if mine.shape[-1] == S else 2
          own = np.zeros((B, S), bool)
          own[np.arange(B)[:, None], np.asarray(positions)] = True
          keep = np.expand_dims(~own, (1, 2) if seq_axis == 3 else (1, 3))
          np.testing.assert_array_equal(np.where(keep, mine, 0), np.where(keep, given, 0))


def _loop_bodies(hlo_text: str) -> dict:
  """Optimised HLO text -> {computation name: its text}."""
  import re
  return {c.split(" ", 1)[0].lstrip("%"): c for c in re.split(r"\n(?=%|ENTRY)", hlo_text)}


def test_no_row_buckets_work_runs_outside_the_bucket_the_step_takes():
  """Each row bucket runs in a loop of at most one trip; its inputs are
  fixed before the loop, and XLA hoists work that depends on loop
  invariants only out of a loop, so every bucket's embedding lookup and
  first projections ran on every decode step whatever the live count.
  In the compiled decode loop no matmul may sit directly in the step's
  own body: each runs inside the bucket that computes it."""
  import re

  model = Transformer(small_config(), rngs=nnx.Rngs(0))
  engine = RolloutEngine.for_model(model, num_slots=8, max_prompt_len=8, max_new_tokens=8)
  assert engine.live_rows
  params = engine.load(model)
  text = engine._generate.lower(params, engine.init_decode_state(), engine.stop_ids, np.int32(8),
                                np.int32(9)).compile().as_text()
  bodies = _loop_bodies(text)
  entry = next(c for c in bodies.values() if c.startswith("ENTRY"))
  step_body = re.search(r"while\(.*?body=%([\w.\-]+)", entry).group(1)
  inner = re.findall(r"while\(.*?body=%([\w.\-]+)", bodies[step_body])
  assert len(inner) >= len(bucket_sizes(8)), inner  # one loop per bucket, at least
  assert any("dot_general" in bodies[name] for name in inner), inner  # the buckets' matmuls
  hoisted = [line.strip()[:120] for line in bodies[step_body].splitlines() if "dot_general" in line]
  assert not hoisted, hoisted
