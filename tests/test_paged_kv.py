"""The paged KV cache in the model and the engine: paged equals dense, page bookkeeping,
preemption, sparse selection with every page kept, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxroll.model.paged_kv_cache import PagedKVCache, PagedSpec, group_pages, pages_for
from jaxroll.rollout import RolloutEngine, SamplingParams
from jaxroll.rollout.speculative import SpeculativeSpec
from jaxroll.types import FINISH_RUNNING
from small_models import small_model


def _prompts(n, lo=1, hi=13, seed=0):
  r = np.random.default_rng(seed)
  return [r.integers(0, 64, size=r.integers(lo, hi + 1)).tolist() for _ in range(n)]


def _engine(model, **kw):
  base = dict(num_slots=4, max_prompt_len=16, max_new_tokens=12, refill_fraction=0.25)
  base.update(kw)
  return RolloutEngine.for_model(model, **base)


def _stop_token(model, prompts):
  """The model's most common mid-sequence token: stopping on it varies lengths."""
  e = _engine(model, num_slots=8)
  t = e.rollout(e.load(model), prompts, key=jax.random.key(9))
  return int(np.bincount(t.tokens_NxL[:, 2:8].ravel(), minlength=64).argmax())


def test_paged_forward_with_shared_prompt_pages_equals_full_forward():
  """Two slots share one prefix row's full pages, a third holds another row;
  scoring 3 tokens per row through the pages gives full-forward logits."""
  model = small_model(0)
  cfg = model.cfg
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 64, size=10).tolist(), rng.integers(0, 64, size=5).tolist()]
  spec = PagedSpec(page_size=4)
  cache = PagedKVCache.zeros(spec, cfg.num_layers, 3, cfg.num_kv_heads, 20, cfg.head_dim, jnp.float32)
  tokens = np.zeros((2, 10), np.int32)
  tokens[0], tokens[1, :5] = prompts[0], prompts[1]
  _, kv = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(10), (2, 10)))
  lengths = jnp.asarray([10, 5], jnp.int32)
  cache = cache.insert(kv, lengths, jnp.asarray([0, 1, 2]), jnp.asarray([0, 0, 1]))
  ref = np.asarray(cache.ref_N)
  table = np.asarray(cache.table_BxM)
  # Prompt 0 (10 tokens): pages 0-1 shared by slots 0 and 1, page 2 copied.
  assert table[0, :2].tolist() == table[1, :2].tolist() and table[0, 2] != table[1, 2]
  assert ref[table[0, :2]].tolist() == [2, 2] and ref[table[0, 2]] == 1
  assert (ref > 0).sum() == 2 + 2 + 2  # shared 2, two own pages, prompt 1's 1 full + 1 own
  extra = rng.integers(0, 64, size=(3, 2))
  seqs = [prompts[0] + extra[0].tolist(), prompts[0] + extra[1].tolist(), prompts[1] + extra[2].tolist()]
  # Each row rewrites its last prompt token (decode's convention) plus 2 new.
  step_tokens = jnp.asarray([[s[n - 1]] + s[n:] for s, n in zip(seqs, (10, 10, 5))], jnp.int32)
  pos = jnp.asarray([[9, 10, 11], [9, 10, 11], [4, 5, 6]], jnp.int32)
  cache, ok = cache.reserve(pos[:, 0], 3, jnp.ones((3,), bool))
  assert np.asarray(ok).all()
  logits, cache = model(step_tokens, pos, cache)
  for b, s in enumerate(seqs):
    full, _ = model(jnp.asarray([s]), jnp.arange(len(s))[None])
    np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(full[0, -3:]), atol=1e-5)
  # Finishing gives every page back; the shared ones once both users are gone.
  cache = cache.release(jnp.asarray([True, False, False]))
  assert np.asarray(cache.ref_N)[table[1, :2]].tolist() == [1, 1]
  cache = cache.release(jnp.asarray([False, True, True]))
  assert int(cache.num_free()) == cache.num_pages


CASES = {
    "dense_pages": dict(paged=PagedSpec(page_size=4)),
    "page_of_one": dict(paged=PagedSpec(page_size=1)),
    "small_pool_preempts": dict(paged=PagedSpec(page_size=4, num_pages=10)),
    "quest_all_pages": dict(paged=PagedSpec(page_size=4, sparsity="quest", budget=1.0)),
    "streaming_all_pages": dict(paged=PagedSpec(page_size=2, sparsity="streaming", budget=1.0)),
    "reference_impl": dict(paged=PagedSpec(page_size=8, impl="reference")),
}


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_engine_paged_equals_dense(case):
  """Same keys, same tokens and log-probs: group sharing, continuous batching
  over 4 slots, rows of varied lengths, and (small pool) preemption."""
  model = small_model(4)
  prompts = _prompts(6, seed=4)
  stop = _stop_token(model, prompts)
  sampling = SamplingParams(1.0)
  dense = _engine(model, stop_token_ids=[stop], sampling=sampling)
  want = dense.rollout(dense.load(model), prompts, group_size=3, key=jax.random.key(0))
  assert len(set(want.length_N.tolist())) > 1
  paged = _engine(model, stop_token_ids=[stop], sampling=sampling, **CASES[case])
  got = paged.rollout(paged.load(model), prompts, group_size=3, key=jax.random.key(0))
  np.testing.assert_array_equal(got.tokens_NxL, want.tokens_NxL)
  np.testing.assert_array_equal(got.finish_N, want.finish_N)
  np.testing.assert_allclose(got.logp_NxL, want.logp_NxL, atol=1e-5)
  np.testing.assert_array_equal(got.position_NxL, want.position_NxL)
  stats = paged.last_stats
  if case == "small_pool_preempts":
    assert stats.preemptions > 0
    assert stats.kv_peak_bytes <= 10 * 4 * paged.kv_bytes_per_token
  assert 0 < stats.kv_peak_bytes < dense.last_stats.kv_peak_bytes


def test_carry_over_and_resume_paged_equals_dense():
  model = small_model(5)
  prompts = _prompts(5, seed=5)
  stop = _stop_token(model, prompts)
  out = {}
  for name, kw in (("dense", {}), ("paged", dict(paged=PagedSpec(page_size=4, num_pages=12)))):
    e = _engine(model, stop_token_ids=[stop], **kw)
    params = e.load(model)
    first = e.rollout(params, prompts, group_size=2, key=jax.random.key(1), stop_after_groups=2)
    assert (first.finish_N == FINISH_RUNNING).any()
    out[name] = (first, e.rollout(params, prompts, group_size=2, key=jax.random.key(1), carried=first))
  for a, b in zip(out["dense"], out["paged"]):
    np.testing.assert_array_equal(a.tokens_NxL, b.tokens_NxL)
    np.testing.assert_array_equal(a.finish_N, b.finish_N)
    np.testing.assert_allclose(a.logp_NxL, b.logp_NxL, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_rollout_paged_equals_dense(temperature):
  """Verification scores several tokens per row through the pages, and
  rejected drafts roll back by position there too."""
  model = small_model(6)
  prompts = _prompts(4, seed=6)
  spec = SpeculativeSpec(k=3, history=False, siblings=True)
  out = []
  for paged in (None, PagedSpec(page_size=4), PagedSpec(page_size=4, num_pages=11)):
    e = _engine(model, sampling=SamplingParams(temperature), speculative=spec, paged=paged)
    out.append((e.rollout(e.load(model), prompts, group_size=3, key=jax.random.key(2)), e.last_stats))
  assert out[0][1].drafted > 0 and out[0][1].accepted > 0
  for traj, _ in out[1:]:
    np.testing.assert_array_equal(traj.tokens_NxL, out[0][0].tokens_NxL)
    np.testing.assert_allclose(traj.logp_NxL, out[0][0].logp_NxL, atol=1e-5)


def _decode_all(engine, params, prompts, G):
  """Low-level: one prefill, G slots per prompt, decode until every row stops."""
  prefix = engine.prefill(params, prompts)
  slots = list(range(len(prompts) * G))
  rows = [i // G for i in slots]
  keys = jax.random.split(jax.random.key(3), len(slots))
  state = engine.insert(engine.init_decode_state(), prefix, slots, rows, keys)
  return engine.generate(params, state)[0]


def test_pages_are_given_back_and_peak_follows_the_lengths():
  """One group of G rows run to the end: the peak is the shared prompt pages
  plus each row's own pages, and every page is free afterwards."""
  model = small_model(7)
  P, G, n_prompt = 3, 3, 10
  e = _engine(model, paged=PagedSpec(page_size=P), num_slots=G)
  state = _decode_all(e, e.load(model), [list(range(1, n_prompt + 1))], G)
  cache = state.cache
  assert int(cache.num_free()) == cache.num_pages
  # Every row runs to max_new_tokens (no stop token); the last decode step
  # writes position n_prompt + 12 - 2, so each row spans 7 pages of 3 and
  # shares the first 3 (positions 0-8) with its group.
  assert pages_for(n_prompt + e.max_new_tokens - 1, P) == 7
  assert int(cache.peak_used) == 3 + G * (7 - 3)
  assert group_pages(n_prompt, [e.max_new_tokens] * G, P) == int(cache.peak_used)


def test_quest_summaries_are_the_min_and_max_of_each_page():
  model = small_model(8)
  P = 4
  e = _engine(model, paged=PagedSpec(page_size=P, sparsity="quest", budget=0.5), num_slots=4,
              max_new_tokens=7)
  params = e.load(model)
  prompts = [list(range(3, 12)), list(range(20, 25))]
  prefix = e.prefill(params, prompts)
  keys = jax.random.split(jax.random.key(4), 4)
  state = e.insert(e.init_decode_state(), prefix, [0, 1, 2, 3], [0, 0, 1, 1], keys)
  state, _ = e.generate(params, state, max_steps=5)  # rows still live: pages still held
  cache = state.cache
  table = np.asarray(cache.table_BxM)
  pos = np.asarray(state.pos_B)  # the next position to write: pos - 1 is the last written
  checked = 0
  for layer in range(model.cfg.num_layers):
    k = np.asarray(cache.k[layer])
    lo, hi = np.asarray(cache.kmin[layer]), np.asarray(cache.kmax[layer])
    for b in range(4):
      for j in range((pos[b] - 1) // P + 1):
        valid = np.arange(P) + j * P <= pos[b] - 1
        page = k[table[b, j]][..., valid]
        np.testing.assert_allclose(lo[table[b, j]], page.min(axis=-1), atol=1e-6)
        np.testing.assert_allclose(hi[table[b, j]], page.max(axis=-1), atol=1e-6)
        checked += 1
  assert checked > 8


def test_no_recompilation_in_steady_state_with_pages():
  """Page allocation, preemption and sparse selection add no compiled program:
  decoding compiles once, inserting once per prefix bucket (prefills of
  preempted rows bring the cache-length bucket)."""
  model = small_model(9)
  e = _engine(model, paged=PagedSpec(page_size=4, num_pages=12, sparsity="quest"), stop_token_ids=[3])
  params = e.load(model)
  insert, shapes = e._insert, set()

  def recording_insert(state, prefix, *args):
    shapes.add(prefix.length_P.shape + prefix.kv.v[0].shape[2:3])
    return insert(state, prefix, *args)

  e._insert = recording_insert
  e.rollout(params, _prompts(6, seed=1), group_size=2, key=jax.random.key(0))
  generate_size, insert_size = e._generate._cache_size(), insert._cache_size()
  seen = set(shapes)
  preempted = e.last_stats.preemptions
  for step, G in enumerate([1, 3, 2]):
    e.rollout(params, _prompts(6, seed=10 + step), group_size=G, key=jax.random.key(step))
    preempted += e.last_stats.preemptions
  assert preempted > 0
  assert e._generate._cache_size() == generate_size
  assert insert._cache_size() - insert_size <= len(shapes - seen)


def test_bad_paged_settings_are_rejected_before_any_work():
  model = small_model(0)
  with pytest.raises(ValueError, match="cannot hold one full row"):
    _engine(model, paged=PagedSpec(page_size=4, num_pages=3))
  with pytest.raises(ValueError, match="not yet sharded"):
    _engine(model, paged=PagedSpec(), mesh=object())
  for bad, match in ((dict(page_size=0), "page_size"), (dict(sparsity="topk"), "sparsity"),
                     (dict(budget=0.0), "budget"), (dict(impl="cuda"), "impl"),
                     (dict(recent_pages=0), "recent_pages")):
    with pytest.raises(ValueError, match=match):
      PagedSpec(**bad)


def test_a_budget_published_with_the_weights_decodes_as_that_budget_without_recompiling():
  """The sparse budget is an array that travels with the weights: loading
  budget b into an engine built for another equals an engine built for b,
  and moving it adds no compiled program."""
  # Less peaked than small_model's, so that the pages kept change the tokens.
  model = small_model(5)
  model.embed.embedding[...] = model.embed.embedding[...] / 8.0
  prompts = _prompts(6, lo=8, hi=16, seed=2)
  sampling = SamplingParams(1.0)
  spec = lambda b: PagedSpec(page_size=2, sparsity="quest", budget=b, sink_pages=1, recent_pages=1)
  out = {}
  for b in (0.25, 1.0):
    e = _engine(model, sampling=sampling, paged=spec(b))
    out[b] = e.rollout(e.load(model), prompts, group_size=2, key=jax.random.key(3))
  # The budget changes what is sampled here, so the checks below can fail.
  assert not np.array_equal(out[0.25].tokens_NxL, out[1.0].tokens_NxL)
  moved = _engine(model, sampling=sampling, paged=spec(0.25))
  sizes = []  # compiled decode programs after each rollout
  for b in (1.0, 0.25, 1.0):
    got = moved.rollout(moved.load(model, kv_budget=b), prompts, group_size=2, key=jax.random.key(3))
    np.testing.assert_array_equal(got.tokens_NxL, out[b].tokens_NxL)
    np.testing.assert_allclose(got.logp_NxL, out[b].logp_NxL, atol=1e-5)
    sizes.append(moved._generate._cache_size())
  assert sizes == [sizes[0]] * 3
  with pytest.raises(ValueError, match="kv_budget applies to sparse attention"):
    _engine(model, paged=PagedSpec(page_size=2)).load(model, kv_budget=0.5)
