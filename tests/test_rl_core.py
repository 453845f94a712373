"""Advantages and losses against direct NumPy statements of the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxroll.rl.advantages import group_advantages
from jaxroll.rl.losses import (aggregate, aipo_loss, capped_weights, decoupled_ppo_loss, kl_penalty,
                               masked_quantile, mismatch_rejection, mismatch_stats, ppo_clipped_loss)

# Three groups of G=4: mixed, degenerate (all 1), degenerate (all 0).
REWARDS = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0], np.float32)


def np_advantages(r, G, method, eps=1e-6):
  out = []
  for g in r.reshape(-1, G):
    if np.all(g == g[0]):
      out.append(np.zeros(G))
    elif method == "grpo":
      out.append((g - g.mean()) / (g.std(ddof=1) + eps))
    elif method == "dr_grpo":
      out.append(g - g.mean())
    else:  # rloo: leave-one-out baseline
      out.append([g[i] - np.delete(g, i).mean() for i in range(G)])
  return np.concatenate(out)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_match_numpy(method):
  adv, degenerate = group_advantages(REWARDS, 4, method)
  np.testing.assert_allclose(np.asarray(adv), np_advantages(REWARDS, 4, method), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(degenerate), [False, True, True])
  assert np.all(np.asarray(adv)[4:] == 0.0) and np.all(np.isfinite(adv))


def test_hand_checked_grpo_values():
  # Group [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3); advantages +-0.5*sqrt(3).
  adv, _ = group_advantages(REWARDS[:4], 4, "grpo", eps=0.0)
  np.testing.assert_allclose(np.asarray(adv), [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-5)


def test_bad_advantage_arguments():
  with pytest.raises(ValueError, match="unknown advantage method 'ppo'"):
    group_advantages(REWARDS, 4, "ppo")
  with pytest.raises(ValueError, match="group_size >= 2"):
    group_advantages(REWARDS, 1)


def _batch(seed=0, N=6, L=5):
  r = np.random.default_rng(seed)
  logp = np.log(r.uniform(0.05, 1.0, size=(N, L))).astype(np.float32)
  old = (logp + r.normal(0, 0.3, size=(N, L))).astype(np.float32)
  mask = np.ones((N, L), bool)
  for n, length in enumerate(r.integers(1, L + 1, size=N)):
    mask[n, length:] = False
  return logp, old, r.normal(size=N).astype(np.float32), mask


def np_aggregate(x, m, how):
  if how == "token_mean":
    return (x * m).sum() / m.sum()
  if how == "seq_mean_token_mean":
    return np.mean([(x[n] * m[n]).sum() / m[n].sum() for n in range(len(x))])
  return np.mean([(x[n] * m[n]).sum() / x.shape[1] for n in range(len(x))])


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_clipped_surrogate_matches_numpy(how):
  logp, old, adv, mask = _batch()
  loss, stats = ppo_clipped_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                 clip_low=0.2, clip_high=0.28, aggregation=how)
  ratio = np.exp(logp - old)
  a = adv[:, None]
  obj = np.minimum(ratio * a, np.clip(ratio, 0.8, 1.28) * a)
  np.testing.assert_allclose(float(loss), -np_aggregate(obj, mask, how), rtol=1e-5)
  clipped = (ratio * a > np.clip(ratio, 0.8, 1.28) * a)
  np.testing.assert_allclose(float(stats["clip_fraction"]), clipped[mask].mean(), rtol=1e-6)
  assert 0 < float(stats["clip_fraction"]) < 1  # the batch exercises both branches


def test_decoupled_objective_matches_numpy_with_truncated_weights():
  logp, prox, adv, mask = _batch(4)
  behaviour = (prox + np.random.default_rng(5).normal(0, 0.8, size=prox.shape)).astype(np.float32)
  loss, stats = decoupled_ppo_loss(*map(jnp.asarray, (logp, prox, behaviour, adv, mask)),
                                   clip_low=0.2, clip_high=0.28, is_cap=1.5)
  w = np.minimum(np.exp(prox - behaviour), 1.5)
  r = np.exp(logp - prox)
  a = adv[:, None]
  obj = w * np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)
  np.testing.assert_allclose(float(loss), -np_aggregate(obj, mask, "token_mean"), rtol=1e-5)
  wm = w[mask]
  np.testing.assert_allclose(float(stats["is_weight_mean"]), wm.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(stats["is_weight_max"]), wm.max(), rtol=1e-6)
  np.testing.assert_allclose(float(stats["is_ess"]), wm.sum() ** 2 / (wm.size * (wm ** 2).sum()), rtol=1e-5)
  truncated = (np.exp(prox - behaviour) > 1.5)[mask].mean()
  np.testing.assert_allclose(float(stats["is_capped_fraction"]), truncated, rtol=1e-6)
  assert 0 < truncated < 1  # the batch exercises both sides of the cap
  # AReaL's variant: tokens above the cap leave the update instead.
  masked, _ = decoupled_ppo_loss(*map(jnp.asarray, (logp, prox, behaviour, adv, mask)),
                                 clip_low=0.2, clip_high=0.28, is_cap=1.5, cap="mask")
  w_mask = np.where(np.exp(prox - behaviour) <= 1.5, np.exp(prox - behaviour), 0.0)
  obj = w_mask * np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)
  np.testing.assert_allclose(float(masked), -np_aggregate(obj, mask, "token_mean"), rtol=1e-5)


def test_aipo_gradient_is_the_truncated_ratio_times_the_advantage():
  logp, behaviour, adv, mask = _batch(7)
  grad = jax.grad(lambda lp: aipo_loss(lp, jnp.asarray(behaviour), jnp.asarray(adv), jnp.asarray(mask),
                                       is_cap=1.2)[0])(jnp.asarray(logp))
  w = np.minimum(np.exp(logp - behaviour), 1.2)
  want = -(w * adv[:, None] * mask) / mask.sum()  # d/dlogp of -token_mean(w * A * logp)
  np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)
  assert 0 < (np.exp(logp - behaviour) > 1.2)[mask].mean() < 1


def test_importance_weights_are_exactly_one_on_policy():
  logp, _, adv, mask = _batch(8)
  lp = jnp.asarray(logp)
  for how in ("truncate", "mask"):
    w, stats = capped_weights(lp - lp, jnp.asarray(mask), 2.0, how)
    assert np.all(np.asarray(w) == 1.0) and float(stats["is_ess"]) == 1.0
  _, stats = aipo_loss(lp, lp, jnp.asarray(adv), jnp.asarray(mask))
  assert float(stats["is_weight_mean"]) == 1.0 and float(stats["is_capped_fraction"]) == 0.0


def test_mismatch_is_zero_for_identical_log_probs_and_matches_numpy_otherwise():
  logp, sampler, _, mask = _batch(9)
  same = mismatch_stats(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(mask))
  assert int(same.pop("mismatch_tokens")) == mask.sum()
  assert float(same.pop("mismatch_agreement_p5")) == 1.0
  assert all(float(v) == 0.0 for v in same.values())
  got = mismatch_stats(jnp.asarray(logp), jnp.asarray(sampler), jnp.asarray(mask))
  d = (logp - sampler)[mask]
  np.testing.assert_allclose(float(got["mismatch_abs_mean"]), np.abs(d).mean(), rtol=1e-5)
  np.testing.assert_allclose(float(got["mismatch_max"]), np.abs(d).max(), rtol=1e-6)
  np.testing.assert_allclose(float(got["mismatch_kl"]), (np.exp(d) - 1 - d).mean(), rtol=1e-5)
  np.testing.assert_allclose(float(got["mismatch_agreement_p5"]), np.percentile(np.exp(-np.abs(d)), 5),
                             rtol=1e-5)


@pytest.mark.parametrize("q", [0.0, 0.05, 0.5, 1.0])
def test_masked_quantile_equals_numpy_percentile(q):
  rng = np.random.default_rng(4)
  for shape in ((1, 1), (3, 7), (6, 50)):
    x = rng.normal(size=shape).astype(np.float32)
    mask = rng.random(shape) < 0.6
    mask.flat[0] = True
    np.testing.assert_allclose(float(masked_quantile(jnp.asarray(x), jnp.asarray(mask), q)),
                               np.percentile(x[mask], 100 * q), rtol=1e-5, atol=1e-6)
  assert float(masked_quantile(jnp.zeros((2, 3)), jnp.zeros((2, 3), bool), 0.05)) == 1.0


def test_mismatch_rejection_drops_rows_with_a_large_gap():
  trainer = np.zeros((4, 5), np.float32)
  sampler = trainer.copy()
  sampler[1, 2] = -0.6  # gap 0.6 on a measured token
  sampler[2, 4] = 3.0  # a large gap, but on a token that is not measured
  sampler[3, 0] = 0.4
  mask = np.ones((4, 5), bool)
  mask[2, 4] = False
  keep = np.asarray(mismatch_rejection(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(mask), 0.5))
  assert keep.tolist() == [True, False, True, True]
  off = mismatch_rejection(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(mask), 0.0)
  assert np.asarray(off).all()


def test_decoupled_objective_reduces_to_ppo_when_proximal_is_behaviour():
  logp, old, adv, mask = _batch(6)
  args = (jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask))
  ppo = lambda lp: ppo_clipped_loss(lp, *args)[0]
  dec = lambda lp: decoupled_ppo_loss(lp, args[0], *args)[0]
  np.testing.assert_allclose(float(dec(jnp.asarray(logp))), float(ppo(jnp.asarray(logp))), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(jax.grad(dec)(jnp.asarray(logp))),
                             np.asarray(jax.grad(ppo)(jnp.asarray(logp))), rtol=1e-6)
  _, stats = decoupled_ppo_loss(jnp.asarray(logp), args[0], *args)
  assert float(stats["is_weight_mean"]) == 1.0 and float(stats["is_ess"]) == 1.0


def test_kl_k3_matches_numpy_and_is_zero_on_identical_policies():
  logp, ref, _, mask = _batch(1)
  d = ref - logp
  want = np_aggregate(np.exp(d) - d - 1, mask, "token_mean")
  np.testing.assert_allclose(float(kl_penalty(jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(mask))), want, rtol=1e-5)
  assert float(kl_penalty(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(mask))) == 0.0


def test_policy_gradient_is_zero_when_all_advantages_are_zero():
  logp, old, _, mask = _batch(2)
  adv, _ = group_advantages(np.ones(6, np.float32), 3, "grpo")  # two degenerate groups
  grad = jax.grad(lambda lp: ppo_clipped_loss(lp, jnp.asarray(old), adv, jnp.asarray(mask))[0])(jnp.asarray(logp))
  assert np.all(np.asarray(grad) == 0.0)


def test_gradient_is_nonzero_and_signed_by_advantage_on_policy():
  logp, _, _, mask = _batch(3)
  adv = jnp.asarray([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
  grad = jax.grad(lambda lp: ppo_clipped_loss(lp, jax.lax.stop_gradient(lp), adv, jnp.asarray(mask))[0])(jnp.asarray(logp))
  g = np.asarray(grad)
  # Descending the loss raises log-probs of positive-advantage tokens.
  assert np.all(g[0][mask[0]] < 0) and np.all(g[1][mask[1]] > 0) and np.all(g[~mask] == 0)


def test_unknown_aggregation_is_rejected():
  with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
    aggregate(jnp.ones((2, 2)), jnp.ones((2, 2), bool), "mean")
