"""The sampling rule against a NumPy statement of it, statistically and exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxroll.rollout.sampling import (SCAN_BLOCK, SamplingParams, prefix_sums, row_seeds, row_uniforms,
                                      sample_tokens)
from reference_sampling import chi_square_pvalue, filtered_distribution

V = 40
LOGITS_V = np.random.default_rng(0).normal(size=V).astype(np.float32) * 2.0
DRAWS = 40_000

CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.7),
]


def _draw(params, n=DRAWS, seed=0):
  seeds = row_seeds(jax.random.split(jax.random.key(seed), n))
  u = row_uniforms(seeds, jnp.zeros((n,), jnp.int32))
  logits = jnp.broadcast_to(jnp.asarray(LOGITS_V), (n, V))
  tok, logp = jax.jit(sample_tokens, static_argnums=2)(logits, u, params)
  return np.asarray(tok), np.asarray(logp)


@pytest.mark.parametrize("params", CASES, ids=str)
def test_frequencies_match_filtered_softmax(params):
  tok, _ = _draw(params)
  probs = filtered_distribution(LOGITS_V, params.temperature, params.top_k, params.top_p)
  counts = np.bincount(tok, minlength=V)
  # Fixed seed; a correct sampler fails this at rate 1e-3.
  assert chi_square_pvalue(counts, probs) > 1e-3
  # And no removed token is ever drawn.
  assert counts[probs == 0].sum() == 0
  tv = 0.5 * np.abs(counts / DRAWS - probs).sum()
  assert tv < 0.02


@pytest.mark.parametrize("params", CASES, ids=str)
def test_logp_is_log_of_filtered_distribution(params):
  tok, logp = _draw(params, n=2000, seed=1)
  probs = filtered_distribution(LOGITS_V, params.temperature, params.top_k, params.top_p)
  np.testing.assert_allclose(logp, np.log(probs[tok]), atol=2e-5)


def test_a_wrong_temperature_is_detected():
  # The test above can fail: samples at temperature 1.0 against the 0.6 rule.
  tok, _ = _draw(SamplingParams(temperature=1.0))
  probs = filtered_distribution(LOGITS_V, 0.6)
  assert chi_square_pvalue(np.bincount(tok, minlength=V), probs) < 1e-6


def test_greedy_is_argmax_with_zero_logp():
  logits = jnp.asarray(np.random.default_rng(3).normal(size=(5, V)), jnp.float32)
  tok, logp = sample_tokens(logits, jnp.zeros((5,)), SamplingParams(temperature=0.0))
  np.testing.assert_array_equal(tok, np.argmax(np.asarray(logits), -1))
  np.testing.assert_array_equal(logp, 0.0)


def test_uniform_edge_never_picks_zero_probability_token():
  # u just below 1 with trailing -inf logits must still land on a real token.
  logits = jnp.asarray([[0.0, 1.0, -jnp.inf, -jnp.inf]], jnp.float32)
  tok, logp = sample_tokens(logits, jnp.asarray([np.nextafter(np.float32(1), np.float32(0))]),
                            SamplingParams())
  assert int(tok[0]) == 1 and np.isfinite(float(logp[0]))


def _large_vocab_case(seed, V=5000):
  """Logits over a vocabulary the two-level cdf splits into blocks (not a
  whole number of them), a stretch of removed tokens in the middle and at
  the end, and the float64 cdf of its softmax."""
  r = np.random.default_rng(seed)
  logits = (r.normal(size=V) * 3.0).astype(np.float32)
  logits[1200:1900] = -np.inf
  logits[V - 300:] = -np.inf
  p = np.exp(np.asarray(jax.nn.log_softmax(jnp.asarray(logits)), np.float64))
  return logits, p, np.cumsum(p)


def test_a_large_vocabulary_draws_the_token_whose_cdf_interval_holds_u():
  """The inverse cdf taken in blocks (jaxroll.rollout.sampling.CDF_BLOCK)
  picks, for u at the middle of a token's interval, that token: checked
  for every token with non-negligible mass, against the float64 cdf."""
  from jaxroll.rollout.sampling import CDF_BLOCK

  logits, p, cdf = _large_vocab_case(0)
  assert len(logits) > 4 * CDF_BLOCK and len(logits) % CDF_BLOCK  # the two-level path
  ids = np.flatnonzero(p > 1e-5)
  u = ((cdf[ids] - p[ids] / 2) / cdf[-1]).astype(np.float32)
  tok, logp = sample_tokens(jnp.broadcast_to(jnp.asarray(logits), (len(ids), len(logits))),
                            jnp.asarray(u), SamplingParams())
  np.testing.assert_array_equal(np.asarray(tok), ids)
  np.testing.assert_allclose(np.asarray(logp), np.log(p[ids]), rtol=1e-4)
  # The ends of [0, 1): the first and the last token with mass, never a removed one.
  edge_u = jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0))])
  tok, _ = sample_tokens(jnp.broadcast_to(jnp.asarray(logits), (2, len(logits))), edge_u,
                         SamplingParams())
  assert np.asarray(tok).tolist() == [int(np.flatnonzero(p)[0]), int(np.flatnonzero(p)[-1])]


def test_a_large_vocabulary_samples_the_softmax():
  logits, p, _ = _large_vocab_case(1, V=2600)
  n = 40_000
  u = row_uniforms(row_seeds(jax.random.split(jax.random.key(5), n)), jnp.zeros((n,), jnp.int32))
  tok, _ = jax.jit(sample_tokens, static_argnums=2)(
      jnp.broadcast_to(jnp.asarray(logits), (n, len(logits))), u, SamplingParams())
  counts = np.bincount(np.asarray(tok), minlength=len(logits))
  assert counts[p == 0].sum() == 0
  # Tokens of small mass pooled into one bin, so every expected count is large.
  big = p * n >= 20
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(p[big], p[~big].sum())
  assert chi_square_pvalue(obs, exp / exp.sum()) > 1e-3


def test_row_draws_depend_on_key_and_counter_only():
  seeds = row_seeds(jax.random.split(jax.random.key(7), 4))
  a = row_uniforms(seeds, jnp.array([0, 1, 2, 3]))
  b = row_uniforms(seeds[::-1], jnp.array([3, 2, 1, 0]))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[::-1])


def test_row_uniforms_are_uniform_and_independent_across_counters():
  """Kolmogorov-Smirnov on draws across rows and along one row's counter, and
  no correlation between consecutive draws of a row."""
  from scipy import stats

  seeds = row_seeds(jax.random.split(jax.random.key(8), 20_000))
  across = np.asarray(row_uniforms(seeds, jnp.zeros((20_000,), jnp.int32)))
  one_row = np.asarray(row_uniforms(jnp.repeat(seeds[:1], 20_000, axis=0), jnp.arange(20_000)))
  for u in (across, one_row):
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-3
  assert abs(np.corrcoef(one_row[:-1], one_row[1:])[0, 1]) < 0.03


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_invalid_params_are_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("K", [1, 7, SCAN_BLOCK, SCAN_BLOCK + 1, 1000, SCAN_BLOCK ** 2 + 5, 40_000])
def test_prefix_sums_are_cumulative_sums(K):
  """The matmul prefix sums (one block, two levels, and the recursive third
  level past SCAN_BLOCK**2 entries) against NumPy's float64 cumsum, with
  zeros in stretches as a filtered distribution has them."""
  x = np.random.default_rng(K).random((3, K)).astype(np.float32)
  x[:, K // 3:K // 2] = 0.0
  got = np.asarray(jax.jit(prefix_sums)(jnp.asarray(x)), np.float64)
  want = np.cumsum(x.astype(np.float64), axis=-1)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * want[:, -1:].max())
