"""Speculative rollout: the verify kernel, the drafters, and exactness of the engine with them."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxroll.kernels.spec_verify import verify, verify_reference
from jaxroll.kernels import spec_verify_sampled
from jaxroll.kernels.spec_verify_sampled import draft_uniform, verify_sampled, verify_sampled_reference
from jaxroll.model import Transformer
from jaxroll.rollout import drafters, speculative
from jaxroll.rollout.draft_history import DraftHistory
from jaxroll.rollout.engine import RolloutEngine
from jaxroll.rollout.sampling import SamplingParams
from jaxroll.rollout.speculative import SpeculativeSpec
from jaxroll.types import FINISH_STOP
from reference_sampling import chi_square_pvalue, filtered_distribution
from small_models import full_forward_logp, small_config, small_model

PROMPT = [1, 5, 2, 7]


def _verify_inputs(seed, B, T, V, greedy=False):
  r = np.random.default_rng(seed)
  scores = r.normal(size=(B, T, V)).astype(np.float32) * 2.0
  if not greedy:
    scores[0, :, V // 2:] = -np.inf  # a truncated (top-k-like) row
  draft = r.integers(-2, V + 2, size=(B, T)).astype(np.int32)
  # Make some drafts likely, so runs of acceptances happen.
  best = np.argmax(scores, axis=-1)
  draft[1::2] = best[1::2]
  np.put_along_axis(scores, best[..., None], np.take_along_axis(scores, best[..., None], -1) + 5.0, -1)
  k = r.integers(0, T, size=B).astype(np.int32)
  k[0] = 0
  seed_Bx2 = r.integers(0, 2 ** 32, size=(B, 2), dtype=np.uint32)
  count = r.integers(0, 100, size=B).astype(np.int32)
  return tuple(jnp.asarray(x) for x in (scores, draft, k, seed_Bx2, count))


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("V,tile", [(1000, 128), (256, 256), (77, 32)])
def test_kernel_matches_its_reference_in_interpret_mode(V, tile, greedy):
  """Same accepted lengths and tokens for the same counters, with a
  vocabulary that the tile does not divide and rows with k = 0."""
  args = _verify_inputs(V, 12, 5, V, greedy)
  n_ref, tok_ref, logp_ref = verify_reference(*args, greedy=greedy)
  n_ker, tok_ker, logp_ker = verify(*args, greedy=greedy, tile=tile, interpret=True)
  np.testing.assert_array_equal(np.asarray(n_ker), np.asarray(n_ref))
  np.testing.assert_array_equal(np.asarray(tok_ker), np.asarray(tok_ref))
  np.testing.assert_allclose(np.asarray(logp_ker), np.asarray(logp_ref), atol=1e-5)
  assert np.asarray(n_ref)[0] == 0 and int(np.asarray(n_ref).max()) > 0


@pytest.mark.parametrize("V,tile", [(1000, 128), (77, 32)])
def test_sampled_draft_kernel_matches_its_reference_in_interpret_mode(V, tile):
  """The general rule's kernel: same accepted lengths and tokens as its
  reference, with rows of k = 0, a truncated row and a q far from p."""
  scores, draft, k, seed_Bx2, count = _verify_inputs(V + 1, 12, 5, V)
  q = jax.nn.softmax(jnp.asarray(np.random.default_rng(V).normal(size=(12, 5, V)) * 2.0), axis=-1)
  q = q.at[1::2].set(jax.nn.softmax(jnp.where(jnp.isinf(scores[1::2]), -1e9, scores[1::2]), axis=-1))
  n_ref, tok_ref, logp_ref = verify_sampled_reference(scores, q, draft, k, seed_Bx2, count)
  n_ker, tok_ker, logp_ker = verify_sampled(scores, q, draft, k, seed_Bx2, count, tile=tile,
                                            interpret=True)
  np.testing.assert_array_equal(np.asarray(n_ker), np.asarray(n_ref))
  np.testing.assert_array_equal(np.asarray(tok_ker), np.asarray(tok_ref))
  np.testing.assert_allclose(np.asarray(logp_ker), np.asarray(logp_ref), atol=1e-5)
  assert np.asarray(n_ref)[0] == 0 and int(np.asarray(n_ref).max()) > 0


def test_the_general_rule_leaves_the_distribution_unchanged_for_a_draft_distribution():
  """d ~ q, accept with min(1, p(d)/q(d)), else draw from norm(max(0, p - q)):
  the emitted token is distributed as p (NumPy's), for a q near p, one far
  from it and one that misses part of p's support, with acceptance
  1 - TV(p, q). Negative control: drawing the rejected token from p
  instead of the residual is biased (towards tokens q under-proposes)."""
  r = np.random.default_rng(1)
  V, N = 10, 20000
  logits = (r.normal(size=V) * 1.5).astype(np.float32)
  p = filtered_distribution(logits, 1.0)
  seeds = jnp.asarray(r.integers(0, 2 ** 32, size=(N, 2), dtype=np.uint32))
  scores = jnp.broadcast_to(jnp.asarray(logits), (N, 2, V))
  far = np.roll(p, 3) ** 2
  no_tail = np.where(np.arange(V) < 6, p, 0.0)
  for q_V in (0.9 * p + 0.1 / V, far / far.sum(), no_tail / no_tail.sum()):
    u = draft_uniform(seeds[:, 0, None], seeds[:, 1, None], jnp.zeros((N, 1), jnp.uint32),
                      jnp.arange(V, dtype=jnp.uint32))
    d = np.asarray(jnp.argmax(jnp.log(jnp.asarray(q_V, jnp.float32)) - jnp.log(-jnp.log(u)), axis=-1))
    assert chi_square_pvalue(np.bincount(d, minlength=V), q_V) > 1e-3  # the drafts follow q
    q = jnp.broadcast_to(jnp.asarray(np.stack([q_V, np.zeros(V)]), jnp.float32), (N, 2, V))
    drafts = jnp.stack([jnp.asarray(d, jnp.int32), jnp.zeros(N, jnp.int32)], axis=1)
    one, zero = jnp.ones((N,), jnp.int32), jnp.zeros((N,), jnp.int32)
    n, tok, _ = verify_sampled_reference(scores, q, drafts, one, seeds, zero)
    assert chi_square_pvalue(np.bincount(np.asarray(tok)[:, 0], minlength=V), p) > 1e-3
    # Acceptance is 1 - TV(p, q).
    accept = 1.0 - 0.5 * np.abs(p - q_V).sum()
    assert abs(float(np.mean(np.asarray(n))) - accept) < 4 * np.sqrt(accept * (1 - accept) / N)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(spec_verify_sampled, "_residual_keys", _keys_from_p)
    _, wrong, _ = verify_sampled_reference(scores, q, drafts, one, seeds, zero)
  assert chi_square_pvalue(np.bincount(np.asarray(wrong)[:, 0], minlength=V), p) < 1e-6


def _keys_from_p(scores, q, lse, gumbel, use_residual):
  """A wrong residual: p itself, whatever was rejected."""
  return scores - lse + gumbel


def _emitted_first_tokens(scores_V, draft, seeds):
  """The first emitted token of one-draft passes over many row seeds."""
  B = seeds.shape[0]
  V = scores_V.shape[0]
  scores = jnp.broadcast_to(jnp.asarray(scores_V), (B, 2, V))
  drafts = jnp.full((B, 2), draft, jnp.int32)
  n, tok, _ = verify_reference(scores, drafts, jnp.ones((B,), jnp.int32), jnp.asarray(seeds),
                               jnp.zeros((B,), jnp.int32))
  return np.asarray(tok)[:, 0], np.asarray(n)


def test_the_accept_rule_leaves_the_distribution_unchanged_for_any_draft():
  """Accept d with p(d), else draw from p without d: the emitted token is
  distributed as p whatever d is (a likely, an unlikely and an impossible
  draft), against the NumPy distribution; accepting every draft is not."""
  r = np.random.default_rng(0)
  logits = r.normal(size=12) * 1.5
  logits[11] = -np.inf
  p = filtered_distribution(np.where(np.isinf(logits), -1e9, logits), 1.0)
  seeds = r.integers(0, 2 ** 32, size=(20000, 2), dtype=np.uint32)
  for d in (int(np.argmax(p)), int(np.argmin(p[:11])), 11):
    tokens, n = _emitted_first_tokens(logits.astype(np.float32), d, seeds)
    assert chi_square_pvalue(np.bincount(tokens, minlength=12), p) > 1e-3, d
    assert abs(n.mean() - p[d]) < 4 * np.sqrt(p[d] * (1 - p[d]) / len(n)) + 1e-9
  # Negative control: the emitted token if every draft were taken.
  wrong = np.where(n >= 0, int(np.argmin(p[:11])), 0)
  assert chi_square_pvalue(np.bincount(wrong, minlength=12), p) < 1e-6


def _model(V=8, scale=5.0, seed=0):
  model = Transformer(small_config(vocab_size=V), rngs=nnx.Rngs(seed))
  model.embed.embedding[...] = model.embed.embedding[...] * scale
  return model


def _far_layer_model(V=8):
  """A model whose second layer moves its next-token distribution far
  from what its first layer alone gives (total variation about 0.37 after
  PROMPT): a deliberately poor layer-skip draft model."""
  model = _model(V)
  down = model.layers[1].mlp.down.kernel
  down[...] = jax.random.normal(jax.random.key(3), down.shape) * 10.0
  return model


def _engine(model, spec, sampling=SamplingParams(), max_new=3, stop=(), slots=64):
  return RolloutEngine.for_model(model, num_slots=slots, max_prompt_len=8, max_new_tokens=max_new,
                                 sampling=sampling, stop_token_ids=list(stop), speculative=spec)


STOP = 0  # rows end at different steps, so a group's rows are not in lock-step


def _exact_joint(model, V, n=3):
  """Probability of every outcome of the first n tokens after PROMPT (a
  stop token ends the outcome), by teacher forcing over all V^n sequences."""
  seqs = np.asarray(list(itertools.product(range(V), repeat=n)), np.int32)
  full = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
  T = full.shape[1]
  logits, _ = model(jnp.asarray(full), jnp.broadcast_to(jnp.arange(T), full.shape))
  logp = jax.nn.log_softmax(logits, axis=-1)
  P = len(PROMPT)
  picked = np.take_along_axis(np.asarray(logp)[:, P - 1:T - 1], seqs[..., None], axis=-1)[..., 0]
  probs = np.zeros(_outcomes(V, n))
  for seq, lp in zip(seqs, picked.astype(np.float64)):
    ended = np.cumsum(seq == STOP) - (seq == STOP) > 0  # positions after a stop
    probs[_code(np.where(ended, V, seq), V)] = np.exp(lp[~ended].sum())
  assert abs(probs.sum() - 1.0) < 1e-4
  return probs / probs.sum()  # float32 logits: renormalise the rounding


def _outcomes(V, n=3):
  return (V + 1) ** n


def _code(seq, V):
  return int(sum(int(t) * (V + 1) ** i for i, t in enumerate(seq)))


def _joint_counts(traj, V, n=3):
  counts = np.zeros(_outcomes(V, n), np.int64)
  for toks, length in zip(traj.tokens_NxL, traj.length_N):
    seq = np.where(np.arange(n) < length, toks[:n], V)
    counts[_code(seq, V)] += 1
  return counts


def _bad_history(engine, V, rng):
  """Random responses: drafts that are nearly always wrong."""
  for _ in range(4):
    engine.history.add(PROMPT, rng.integers(0, V, size=3))


DRAFTERS = {
    "history": SpeculativeSpec(k=3, siblings=False, min_match=1, match_len=2),
    "siblings": SpeculativeSpec(k=3, history=False, min_match=1, match_len=2),
    "both, fixed k": SpeculativeSpec(k=2, min_match=1, match_len=3, adaptive=False),
    "layer skip": SpeculativeSpec(k=3, history=False, siblings=False, layer_skip=1),
}
LAYER_SKIP = DRAFTERS["layer skip"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DRAFTERS) + ["bad history", "far layer skip"])
def test_first_three_tokens_follow_the_exact_joint_distribution(name):
  """Chi-square of 4096 sampled 3-token continuations against the exact
  joint distribution of the policy, for each drafter and two bad ones."""
  V = 8
  model = _far_layer_model(V) if name == "far layer skip" else _model(V)
  spec = LAYER_SKIP if name == "far layer skip" else DRAFTERS.get(
      name, SpeculativeSpec(k=3, siblings=False, min_match=1, match_len=1))
  engine = _engine(model, spec, max_new=8, stop=(STOP,), slots=16)
  params = engine.load(model)
  rng = np.random.default_rng(1)
  if name == "bad history":
    _bad_history(engine, V, rng)
  else:  # a first call fills the history with the policy's own answers
    engine.rollout(params, [PROMPT] * 4, group_size=16, key=jax.random.key(99))
  probs = _exact_joint(model, V)
  traj = engine.rollout(params, [PROMPT] * 64, group_size=64, key=jax.random.key(0))
  assert engine.last_stats.drafted > 0 and engine.last_stats.accepted > 0
  assert chi_square_pvalue(_joint_counts(traj, V), probs) > 1e-3


def test_accepting_every_draft_fails_the_same_test(monkeypatch):
  """The negative control: a verifier that keeps every draft."""
  V = 8
  model = _model(V)

  def accept_all(scores, draft, k_B, seed, count, greedy=False):
    n, tok, logp = verify_reference(scores, draft, k_B, seed, count, greedy=greedy)
    T = draft.shape[1]
    j = jnp.arange(T)
    tok = jnp.where(j < k_B[:, None], draft, tok)
    return k_B, tok, logp

  monkeypatch.setattr(speculative, "_verifier", lambda: accept_all)
  engine = _engine(model, SpeculativeSpec(k=3, siblings=False, min_match=1, match_len=1),
                   max_new=8, stop=(STOP,), slots=16)
  params = engine.load(model)
  _bad_history(engine, V, np.random.default_rng(1))
  probs = _exact_joint(model, V)
  traj = engine.rollout(params, [PROMPT] * 64, group_size=64, key=jax.random.key(0))
  assert chi_square_pvalue(_joint_counts(traj, V), probs) < 1e-6


def test_drawing_rejections_from_p_fails_the_same_test_with_layer_skip_drafts(monkeypatch):
  """The negative control of the general rule in the engine: a rejected
  layer-skip draft replaced by a draw from p, not from the residual."""
  V = 8
  model = _far_layer_model(V)
  monkeypatch.setattr(spec_verify_sampled, "_residual_keys", _keys_from_p)
  engine = _engine(model, LAYER_SKIP, max_new=8, stop=(STOP,), slots=16)
  params = engine.load(model)
  probs = _exact_joint(model, V)
  traj = engine.rollout(params, [PROMPT] * 64, group_size=64, key=jax.random.key(0))
  assert chi_square_pvalue(_joint_counts(traj, V), probs) < 1e-6


@pytest.mark.slow
def test_per_position_marginals_over_32_tokens_match_plain_sampling():
  """Two-sample chi-square per position (32 positions), speculation with
  both drafters against plain decoding of the same policy."""
  V = 8
  model = _model(V, scale=4.0)
  spec = SpeculativeSpec(k=4, min_match=1, match_len=3)
  plain = _engine(model, None, max_new=32)
  spec_engine = _engine(model, spec, max_new=32)
  p_plain, p_spec = plain.load(model), spec_engine.load(model)
  spec_engine.rollout(p_spec, [PROMPT] * 4, group_size=16, key=jax.random.key(7))
  a = plain.rollout(p_plain, [PROMPT] * 32, group_size=64, key=jax.random.key(1))
  b = spec_engine.rollout(p_spec, [PROMPT] * 32, group_size=64, key=jax.random.key(2))
  assert spec_engine.last_stats.tokens_per_forward > 1.2
  from scipy import stats
  pvalues = []
  for t in range(32):
    table = np.stack([np.bincount(a.tokens_NxL[:, t], minlength=V),
                      np.bincount(b.tokens_NxL[:, t], minlength=V)])
    table = table[:, table.sum(0) > 0]
    pvalues.append(stats.chi2_contingency(table)[1])
  # 32 tests: Bonferroni at 1e-3 overall.
  assert min(pvalues) > 1e-3 / 32, pvalues


@pytest.mark.parametrize("layer_skip", [False, True], ids=["index drafts", "layer skip"])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(0.8, top_k=5),
                                      SamplingParams(1.0, top_p=0.9)], ids=["greedy", "top-k", "top-p"])
def test_recorded_logp_is_teacher_forced_and_greedy_is_token_identical(sampling, layer_skip):
  """Every emitted token records log p under the processed distribution of
  the target (as teacher forcing gives it); greedy output equals plain
  greedy decoding token for token, with stop tokens ending rows where
  plain decoding ends them."""
  model = small_model(3, vocab_size=64, num_layers=3)
  spec = SpeculativeSpec(k=4, history=False, siblings=False, layer_skip=2) if layer_skip \
      else SpeculativeSpec(k=4, min_match=1, match_len=3)
  kw = dict(sampling=sampling, max_new=24, stop=(5,), slots=8)
  plain, spec_engine = _engine(model, None, **kw), _engine(model, spec, **kw)
  pp, ps = plain.load(model), spec_engine.load(model)
  prompts = [[1, 2, 3], [4, 9, 11, 13], [7]]
  for call in range(2):  # the second call drafts from the first call's answers
    a = plain.rollout(pp, prompts, group_size=3, key=jax.random.key(call))
    b = spec_engine.rollout(ps, prompts, group_size=3, key=jax.random.key(call))
  assert spec_engine.last_stats.accepted > 0
  if sampling.greedy:
    np.testing.assert_array_equal(b.tokens_NxL, a.tokens_NxL)
    np.testing.assert_array_equal(b.finish_N, a.finish_N)
    np.testing.assert_array_equal(b.position_NxL, a.position_NxL)
  for n in range(len(b.length_N)):
    L = int(b.length_N[n])
    toks = b.tokens_NxL[n, :L]
    prompt = prompts[n // 3]
    seq = np.asarray([prompt + toks.tolist()])
    logits = np.asarray(model(jnp.asarray(seq), jnp.arange(seq.shape[1])[None])[0][0])
    P = len(prompt)
    for t in range(L):
      if sampling.greedy:
        assert b.logp_NxL[n, t] == 0.0
        continue
      p = filtered_distribution(logits[P - 1 + t], sampling.temperature, sampling.top_k, sampling.top_p)
      assert abs(b.logp_NxL[n, t] - np.log(p[toks[t]])) < 1e-5
    if b.finish_N[n] == FINISH_STOP:
      assert toks[-1] == 5 and 5 not in toks[:-1].tolist()


def test_bad_drafts_change_nothing_but_their_own_row():
  """Out-of-vocabulary ids, drafts past the remaining budget and drafts that
  cross a stop token: the row ends where its budget or stop says, and every
  other row's tokens and cache are those of a step without the bad drafts."""
  model = small_model(4, vocab_size=64)
  spec = SpeculativeSpec(k=4, siblings=False, min_match=1, match_len=1, adaptive=False)
  engine = _engine(model, spec, sampling=SamplingParams(temperature=0.0), max_new=6, stop=(5,),
                   slots=4)
  params = engine.load(model)
  greedy = [int(t) for t in _engine(model, None, sampling=SamplingParams(temperature=0.0),
                                    max_new=6, slots=4).rollout(
      params, [PROMPT], key=jax.random.key(0)).tokens_NxL[0]]
  prefix = engine.prefill(params, [PROMPT, PROMPT])
  R = spec.history_tokens

  def run(bad_source):
    state = engine.init_decode_state()
    good = np.full((R,), drafters.PAD, np.int32)
    good[:1 + len(greedy)] = [drafters.MARK] + greedy
    srcs = np.stack([bad_source, good])
    state = engine.insert(state, prefix, [0, 1], [0, 1], jax.random.split(jax.random.key(0), 2),
                          max_new_tokens=[3, 6], sources=srcs, groups=[0, 1])
    state, _ = engine.generate(params, state, max_steps=1)
    return jax.device_get(state)

  clean = np.full((R,), drafters.PAD, np.int32)
  clean[0] = drafters.MARK
  base = run(clean)
  oov = clean.copy()
  oov[:6] = [drafters.MARK, greedy[0], 64 + 3, -7, 1000, 2]
  long = clean.copy()
  long[:8] = [drafters.MARK] + greedy[:1] + [greedy[1]] * 6  # longer than the 3-token budget
  stop = clean.copy()
  stop[:6] = [drafters.MARK, greedy[0], 5, 5, 5, 5]  # crosses the stop token
  for src in (oov, long, stop):
    st = run(src)
    # Row 1 (the good one) is unchanged by what row 0 drafted.
    np.testing.assert_array_equal(st.out_tokens_BxL[1], base.out_tokens_BxL[1])
    c = int(st.pos_B[1])
    for layer in range(model.cfg.num_layers):
      np.testing.assert_array_equal(st.cache.k[layer][1, :, :, :c], base.cache.k[layer][1, :, :, :c])
      np.testing.assert_array_equal(st.cache.v[layer][1, :, :c], base.cache.v[layer][1, :, :c])
    assert np.isfinite(np.asarray(st.cache.k[0])).all()
    n0 = int(st.count_B[0])
    assert 1 <= n0 <= 3
    assert st.out_tokens_BxL[0, :n0].tolist() == greedy[:n0] or 5 in st.out_tokens_BxL[0, :n0].tolist()
    if n0 < 3:
      assert st.done_B[0] == (st.out_tokens_BxL[0, n0 - 1] == 5)
  assert int(base.count_B[1]) > 1  # the good row did accept its drafts


def test_drafters_propose_the_continuation_of_the_longest_latest_match():
  """Brute-force suffix matching on a small case."""
  M, P = drafters.MARK, drafters.PAD
  src = jnp.asarray([[M, 1, 2, 3, 4, M, 1, 2, 9, 8, P, P]], jnp.int32)
  ctx = jnp.asarray([[7, 1, 2]], jnp.int32)  # ends in "1 2": two matches, the later wins
  d, n = drafters.propose(src, ctx, k=3, min_match=2)
  assert d[0, :int(n[0])].tolist() == [9, 8]
  ctx = jnp.asarray([[M, 1, 2]], jnp.int32)  # "MARK 1 2" matches both fully; latest again
  d, n = drafters.propose(src, ctx, k=3, min_match=2)
  assert d[0, :int(n[0])].tolist() == [9, 8]
  ctx = jnp.asarray([[3, 1, 2]], jnp.int32)
  d, n = drafters.propose(src, ctx, k=3, min_match=3)
  assert int(n[0]) == 0
  ctx = jnp.asarray([[drafters._NOTHING, drafters._NOTHING, M]], jnp.int32)  # an empty row
  d, n = drafters.propose(src, ctx, k=2, min_match=1)
  assert d[0].tolist() == [1, 2] and int(n[0]) == 2


def _propose_numpy(src, ctx, k, min_match, count):
  """drafters.propose's rule, one row and one position at a time."""
  B, R = src.shape
  M = ctx.shape[1]
  drafts, avail = np.zeros((B, k), np.int32), np.zeros(B, np.int32)
  for b in range(B):
    best = None
    for i in range(R):
      length = 0
      while length < M and i - length >= 0 and src[b, i - length] == ctx[b, M - 1 - length]:
        length += 1
      follow = 0
      while follow < k and i + follow + 1 < R and src[b, i + follow + 1] >= 0:
        follow += 1
      aligned = int(i - count[b] >= 0 and src[b, i - count[b]] == drafters.MARK)
      if length >= min(min_match, count[b] + 1) and follow > 0:
        key = ((length * 2 + aligned) * (k + 1) + follow, i)
        best = key if best is None or key > best else best
    if best is not None:
      i = best[1]
      n = 0
      while n < k and i + 1 + n < R and src[b, i + 1 + n] >= 0:
        drafts[b, n] = src[b, i + 1 + n]
        n += 1
      avail[b] = n
  return drafts, avail


def test_propose_picks_the_position_a_brute_force_search_picks():
  """Random sources over a small alphabet (so matches of every length and
  ties occur), with MARKs and PAD runs: the drafts and their lengths equal
  a position-by-position search."""
  r = np.random.default_rng(3)
  B, R, L, M, k = 24, 57, 9, 4, 3
  src = r.integers(0, 3, size=(B, R)).astype(np.int32)
  src[r.random((B, R)) < 0.08] = drafters.MARK
  src[r.random((B, R)) < 0.08] = drafters.PAD
  src[:4, 40:] = drafters.PAD
  src[-2:] = 7  # a token no context holds, and no MARK: nothing matches
  out = r.integers(0, 3, size=(B, L)).astype(np.int32)
  count = r.integers(0, L, size=B).astype(np.int32)
  count[:3] = 0  # rows with no tokens yet: their context is [MARK]
  ctx = drafters.row_context(jnp.asarray(out), jnp.asarray(count), M)
  want_d, want_n = _propose_numpy(src, np.asarray(ctx), k, 2, count)
  d, n = drafters.propose(jnp.asarray(src), ctx, k, 2, jnp.asarray(count))
  assert np.asarray(n).tolist() == want_n.tolist()
  # Only the first `available` tokens of a draft are defined.
  assert [row[:m] for row, m in zip(np.asarray(d).tolist(), want_n)] == \
      [row[:m] for row, m in zip(want_d.tolist(), want_n)]
  assert 0 < int((want_n > 0).sum()) < B  # some rows draft and some find nothing


def test_sibling_sources_are_the_first_siblings_in_slot_order():
  """Against a NumPy construction: groups scattered over the slots, empty
  slots (group -1), finished siblings still readable, inactive slots left
  out, and fewer source places (S) than some rows have siblings."""
  r = np.random.default_rng(5)
  B, L, S = 20, 6, 3
  group = r.permutation(np.repeat(np.arange(4), 5))[:B].astype(np.int32)
  group[[2, 11]] = -1
  active = r.random(B) > 0.2
  out = r.integers(0, 9, size=(B, L)).astype(np.int32)
  count = r.integers(0, L + 1, size=B).astype(np.int32)
  got = np.asarray(drafters.sibling_sources(jnp.asarray(out), jnp.asarray(count), jnp.asarray(group),
                                            jnp.asarray(active), S))
  want = np.full((B, S, L + 1), drafters.PAD, np.int32)
  for b in range(B):
    sibs = [j for j in range(B) if j != b and group[b] >= 0 and group[j] == group[b] and active[j]]
    for place, j in enumerate(sibs[:S]):
      want[b, place, 0] = drafters.MARK
      want[b, place, 1:1 + count[j]] = out[j, :count[j]]
  assert got.tolist() == want.reshape(B, S * (L + 1)).tolist()
  assert any(len([j for j in range(B) if j != b and group[j] == group[b] >= 0 and active[j]]) > S
             for b in range(B))
  # A subset of the rows (the live rows' bucket, with a repeated filler row).
  rows = np.asarray([7, 0, 13, 2, 0], np.int32)
  sub = drafters.sibling_sources(jnp.asarray(out), jnp.asarray(count), jnp.asarray(group),
                                 jnp.asarray(active), S, jnp.asarray(rows))
  assert np.asarray(sub).tolist() == want.reshape(B, S * (L + 1))[rows].tolist()


def test_history_keeps_the_latest_answers_and_round_trips():
  h = DraftHistory(per_prompt=2)
  for r in ([1, 2], [3], [4, 5, 6]):
    h.add(PROMPT, r)
  src = h.source(PROMPT, 8)
  assert src.tolist() == [drafters.MARK, 3, drafters.MARK, 4, 5, 6, drafters.PAD, drafters.PAD]
  assert h.source(PROMPT, 3).tolist() == [4, 5, 6]
  assert (h.source([9], 4) == drafters.PAD).all()
  again = DraftHistory()
  again.load_state_dict(h.state_dict())
  assert again.source(PROMPT, 8).tolist() == src.tolist()


def test_the_global_window_holds_other_prompts_latest_answers_and_round_trips():
  M, P = drafters.MARK, drafters.PAD
  h = DraftHistory(per_prompt=2, recent=3)
  for prompt, r in (([1], [1, 1]), ([2], [2, 2]), (PROMPT, [9]), ([3], [3]), ([4], [4, 4])):
    h.add(prompt, r)
  # The last 3 responses are [9] (PROMPT's own, left out), [3] and [4, 4].
  assert h.global_source(PROMPT, 7).tolist() == [M, 3, M, 4, 4, P, P]
  assert h.global_source([3], 4).tolist() == [9, M, 4, 4]  # cut from the front
  again = DraftHistory()
  again.load_state_dict(h.state_dict())
  assert again.global_source(PROMPT, 7).tolist() == h.global_source(PROMPT, 7).tolist()
  old = {k: v for k, v in h.state_dict().items() if k in ("per_prompt", "responses")}
  again.load_state_dict(old)  # a checkpoint from before the window: it starts empty
  assert (again.global_source(PROMPT, 4) == P).all()


def test_a_new_prompt_drafts_from_other_prompts_answers_with_the_global_window():
  """Greedy decoding of a prompt never seen before: the history drafter
  alone has nothing to draft from; with the global window it drafts other
  prompts' answers, and the output is still plain greedy decoding's."""
  model = small_model(3, vocab_size=64)
  greedy = SamplingParams(temperature=0.0)
  # This model repeats a prompt's last token: [2, 3] answers as [1, 2, 3] did.
  seen, new = [[1, 2, 3], [4, 9, 11, 13]], [[2, 3]]
  plain = _engine(model, None, sampling=greedy, max_new=16, slots=4)
  want = plain.rollout(plain.load(model), new, key=jax.random.key(0)).tokens_NxL
  stats = {}
  for global_tokens in (0, 64):
    spec = SpeculativeSpec(k=4, siblings=False, min_match=1, match_len=2, history_tokens=64,
                           global_tokens=global_tokens)
    engine = _engine(model, spec, sampling=greedy, max_new=16, slots=4)
    params = engine.load(model)
    engine.rollout(params, seen, key=jax.random.key(0))
    got = engine.rollout(params, new, key=jax.random.key(0))
    np.testing.assert_array_equal(got.tokens_NxL, want)
    stats[global_tokens] = engine.last_stats
  assert stats[0].drafted == 0
  assert stats[64].accepted > 0


def test_partial_rollout_and_carry_over_work_with_speculation():
  """stop_after_groups, then a carried resume: every token keeps its
  teacher-forced log-prob and the resumed rows finish."""
  model = small_model(5, vocab_size=64)
  engine = _engine(model, SpeculativeSpec(k=3, min_match=1, match_len=2), max_new=16, stop=(5,),
                   slots=4)
  params = engine.load(model)
  prompts = [[1, 2, 3], [4, 6], [8, 9, 10]]
  first = engine.rollout(params, prompts, group_size=2, key=jax.random.key(0), stop_after_groups=1)
  rest = engine.rollout(params, prompts, group_size=2, key=jax.random.key(0), carried=first)
  assert (rest.finish_N != 0).all()
  for n in range(6):
    L = int(rest.length_N[n])
    seq = np.asarray([prompts[n // 2] + rest.tokens_NxL[n, :L].tolist()])
    ref = np.asarray(full_forward_logp(model, seq))
    P = len(prompts[n // 2])
    want = ref[np.arange(P - 1, P - 1 + L), rest.tokens_NxL[n, :L]]
    np.testing.assert_allclose(rest.logp_NxL[n, :L], want, atol=1e-5)


def test_spec_settings_are_checked():
  for bad in (dict(k=0), dict(history=False, siblings=False), dict(min_match=5, match_len=4),
              dict(history=False, global_tokens=8), dict(global_tokens=-1),
              dict(layer_skip=1), dict(layer_skip=-1, history=False, siblings=False)):
    with pytest.raises(ValueError):
      SpeculativeSpec(**bad)
  with pytest.raises(ValueError, match="exits after 2 layers, but the policy has 2"):
    _engine(small_model(0), SpeculativeSpec(history=False, siblings=False, layer_skip=2))


def test_layer_skip_drafts_in_a_paged_cache_are_token_identical_under_greedy():
  """The drafter writes its first layers' keys into the paged cache's pages
  (reserved for the verifying pass): greedy output equals plain decoding."""
  from jaxroll.model.paged_kv_cache import PagedSpec
  model = small_model(3, vocab_size=64, num_layers=3)
  greedy = SamplingParams(temperature=0.0)
  prompts = [[1, 2, 3], [4, 9, 11, 13], [7]]
  plain = _engine(model, None, sampling=greedy, max_new=20, stop=(5,), slots=8)
  want = plain.rollout(plain.load(model), prompts, group_size=2, key=jax.random.key(0))
  engine = RolloutEngine.for_model(model, num_slots=8, max_prompt_len=8, max_new_tokens=20,
                                   sampling=greedy, stop_token_ids=[5], paged=PagedSpec(page_size=4),
                                   speculative=SpeculativeSpec(k=3, history=False, siblings=False,
                                                               layer_skip=1))
  got = engine.rollout(engine.load(model), prompts, group_size=2, key=jax.random.key(0))
  assert engine.last_stats.accepted > 0
  np.testing.assert_array_equal(got.tokens_NxL, want.tokens_NxL)
  np.testing.assert_array_equal(got.finish_N, want.finish_N)
