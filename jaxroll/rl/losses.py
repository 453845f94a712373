"""Policy-gradient losses over token log-probabilities, with masks, jit-able.

All functions take per-token arrays [N, L] and a mask_NxL of the tokens that
enter the loss (generated tokens, minus anything a technique masks out).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
OFF_POLICY = ("ppo", "tis", "decoupled", "sis", "aipo")
# The objectives that take their trust region around the update's starting
# policy, whose log-probs the update computes first.
PROXIMAL = ("tis", "decoupled", "sis")


def aggregate(per_token_NxL, mask_NxL, how: str, max_len: int | None = None, weight_NxL=None):
  """Reduces a per-token quantity to a scalar: sum(x * w) over the mask, with
  w = `token_weights(mask, how, max_len)` unless `weight_NxL` gives them.

  Passing the whole batch's weights lets row chunks of one batch be
  reduced separately and add up to the batch's value (rl.chunked_update).

  token_mean: sum over all masked tokens / their count (DAPO's token-level
    loss: long sequences weigh more).
  seq_mean_token_mean: mean over each sequence's tokens, then over sequences
    (the original GRPO objective).
  seq_mean_token_sum_norm: each sequence's token sum / a constant max_len,
    then mean over sequences (Dr. GRPO: no length normalisation bias).
    The constant must not follow the batch's padded width: the trainer
    passes its full sequence length; None uses the array's width.
  """
  if weight_NxL is None:
    weight_NxL = token_weights(mask_NxL, how, max_len, xp=jnp)
  return (jnp.where(mask_NxL, per_token_NxL, 0.0) * weight_NxL).sum()


def token_weights(mask_NxL, how: str, max_len: int | None = None, xp=np):
  """Per-token weights w, zero off the mask, that hold the normalisation of
  `how` for these N rows (the one definition `aggregate` uses). `xp`: numpy
  on the host (computed once for a batch and split with its rows), or
  jax.numpy under jit."""
  m = xp.asarray(mask_NxL).astype(xp.float32)
  n = m.shape[0]
  if how == "token_mean":
    return m / xp.maximum(m.sum(), 1.0)
  if how == "seq_mean_token_mean":
    return m / xp.maximum(m.sum(axis=1, keepdims=True), 1.0) / n
  if how == "seq_mean_token_sum_norm":
    return m / float(max_len or m.shape[1]) / n
  raise ValueError(f"unknown loss aggregation {how!r}; expected one of {AGGREGATIONS}")


def _clipped_objective(ratio_NxL, adv_N, clip_low, clip_high):
  """PPO's min(r * A, clip(r) * A) per token, and where the clip was active."""
  adv_NxL = adv_N[:, None]
  clipped_NxL = jnp.clip(ratio_NxL, 1.0 - clip_low, 1.0 + clip_high)
  return (jnp.minimum(ratio_NxL * adv_NxL, clipped_NxL * adv_NxL),
          ratio_NxL * adv_NxL > clipped_NxL * adv_NxL)


def _masked_mean(x_NxL, mask_NxL):
  m = mask_NxL.astype(jnp.float32)
  return (x_NxL * m).sum() / jnp.maximum(m.sum(), 1.0)


def ppo_clipped_loss(logp_NxL, behaviour_logp_NxL, adv_N, mask_NxL, *, clip_low: float = 0.2,
                     clip_high: float = 0.2, aggregation: str = "token_mean",
                     max_len: int | None = None, weight_NxL=None):
  """PPO's clipped surrogate with a per-token importance ratio.

  ratio = exp(logp - behaviour_logp); objective = min(ratio * A,
  clip(ratio, 1 - clip_low, 1 + clip_high) * A); loss = -aggregate(objective).
  clip_high > clip_low is DAPO's asymmetric ("clip-higher") variant.

  Returns:
    (loss, stats) over masked tokens: clip_fraction, ratio_mean, and the
    ratio's `capped_weights` statistics (uncapped).
  """
  ratio_NxL = jnp.exp(logp_NxL - behaviour_logp_NxL)
  objective_NxL, was_clipped = _clipped_objective(ratio_NxL, adv_N, clip_low, clip_high)
  loss = -aggregate(objective_NxL, mask_NxL, aggregation, max_len, weight_NxL)
  # The ratio is this objective's importance weight: the same statistics as the others'.
  _, w_stats = capped_weights(logp_NxL - behaviour_logp_NxL, mask_NxL, jnp.inf, "truncate")
  return loss, {"clip_fraction": _masked_mean(was_clipped, mask_NxL),
                "ratio_mean": _masked_mean(ratio_NxL, mask_NxL), **w_stats}


def capped_weights(log_ratio_NxL, mask_NxL, cap: float, how: str):
  """Importance weights exp(log_ratio) under a cap, held constant, and their statistics.

  how "truncate": min(w, cap) (TIS; IMPALA's truncation). "mask": w where
  w <= cap, else 0 (the token leaves the update; AReaL's behaviour-weight
  cap, MIS). Stats over masked tokens: is_weight_mean / _max of the applied
  weights, is_capped_fraction (tokens above the cap), and is_ess, the
  effective sample size (sum w)^2 / (n sum w^2) as a fraction of n.
  """
  raw_NxL = jnp.exp(log_ratio_NxL)
  if how == "truncate":
    w_NxL = jnp.minimum(raw_NxL, cap)
  elif how == "mask":
    w_NxL = jnp.where(raw_NxL <= cap, raw_NxL, 0.0)
  else:
    raise ValueError(f"unknown cap handling {how!r}; expected 'truncate' or 'mask'")
  w_NxL = jax.lax.stop_gradient(w_NxL)
  m = mask_NxL.astype(jnp.float32)
  n = jnp.maximum(m.sum(), 1.0)
  wm = w_NxL * m
  stats = {"is_weight_mean": wm.sum() / n, "is_weight_max": jnp.max(jnp.where(mask_NxL, w_NxL, 0.0)),
           "is_capped_fraction": _masked_mean(raw_NxL > cap, mask_NxL),
           # <= 1 by Cauchy-Schwarz; the minimum removes float32 rounding above it.
           "is_ess": jnp.minimum(1.0, wm.sum() ** 2 / jnp.maximum(n * (wm * w_NxL).sum(), 1e-30))}
  return w_NxL, stats


def decoupled_ppo_loss(logp_NxL, proximal_logp_NxL, behaviour_logp_NxL, adv_N, mask_NxL, *,
                       clip_low: float = 0.2, clip_high: float = 0.2, is_cap: float = 2.0,
                       cap: str = "truncate", aggregation: str = "token_mean",
                       max_len: int | None = None, weight_NxL=None, level: str = "token"):
  """The decoupled PPO objective (Hilton et al., 2021; AReaL; TIS; POPO's replay).

  Tokens were sampled by a behaviour policy mu (an older version, or the
  sampler's numerics). The trust region is taken around a proximal policy
  (the parameters at the start of this update), and the importance weight
  pi_prox / mu, capped and held constant, corrects for mu:

    w = cap(exp(prox - behaviour));  r = exp(logp - prox)
    objective = w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

  cap="truncate" is TIS (Yao et al., 2025): min(w, is_cap), a bias towards
  mu on the truncated tokens for bounded variance. cap="mask" is AReaL's:
  tokens with w > is_cap leave the update. With prox == behaviour, w = 1
  and this is `ppo_clipped_loss`.

  level="sequence" weighs every token of a row by the row's weight
  w = cap(prod_t pi_prox / mu) (rl.off_policy=sis). Uncapped, its gradient
  at the proximal point is an unbiased estimate of the on-policy one for
  any per-row loss (E_mu[w f] = E_pi[f]); per-token weights are not
  (they ignore that mu also changed the prefix), but vary far less.

  Returns:
    (loss, stats): the PPO stats plus `capped_weights`' statistics.
  """
  log_w_NxL = proximal_logp_NxL - behaviour_logp_NxL
  if level == "sequence":
    log_w_N = jnp.sum(jnp.where(mask_NxL, log_w_NxL, 0.0), axis=1)
    log_w_NxL = jnp.broadcast_to(log_w_N[:, None], log_w_NxL.shape)
  elif level != "token":
    raise ValueError(f"unknown importance-weight level {level!r}; expected 'token' or 'sequence'")
  w_NxL, w_stats = capped_weights(log_w_NxL, mask_NxL, is_cap, cap)
  ratio_NxL = jnp.exp(logp_NxL - proximal_logp_NxL)
  objective_NxL, was_clipped = _clipped_objective(ratio_NxL, adv_N, clip_low, clip_high)
  loss = -aggregate(w_NxL * objective_NxL, mask_NxL, aggregation, max_len, weight_NxL)
  return loss, {"clip_fraction": _masked_mean(was_clipped, mask_NxL),
                "ratio_mean": _masked_mean(ratio_NxL, mask_NxL), **w_stats}


def aipo_loss(logp_NxL, behaviour_logp_NxL, adv_N, mask_NxL, *, is_cap: float = 2.0,
              aggregation: str = "token_mean", max_len: int | None = None, weight_NxL=None):
  """AIPO (LlamaRL, Wu et al., 2025): policy gradient with the importance
  ratio pi / mu truncated from above and held constant, no PPO clip.

    w = min(exp(logp - behaviour), is_cap);  gradient = w * A * grad logp

  For one-step-lagged data the ratio stays near 1 and the truncation only
  guards against rare large ratios. The per-token value is w * A (written
  as w * A * exp(logp - stop_gradient(logp)) so its gradient is the above).
  """
  w_NxL, w_stats = capped_weights(logp_NxL - behaviour_logp_NxL, mask_NxL, is_cap, "truncate")
  objective_NxL = w_NxL * adv_N[:, None] * jnp.exp(logp_NxL - jax.lax.stop_gradient(logp_NxL))
  loss = -aggregate(objective_NxL, mask_NxL, aggregation, max_len, weight_NxL)
  return loss, {"clip_fraction": w_stats["is_capped_fraction"],
                "ratio_mean": _masked_mean(jnp.exp(logp_NxL - behaviour_logp_NxL), mask_NxL), **w_stats}


def mismatch_stats(trainer_logp_NxL, sampler_logp_NxL, mask_NxL):
  """How far the sampler's recorded log-probs are from the trainer's on the
  same weights and tokens (rollout-training mismatch).

  d = trainer - sampler per token; mismatch_abs_mean = mean |d|,
  mismatch_max = max |d|, mismatch_kl = mean(exp(d) - 1 - d), the k3
  estimate of KL(sampler || trainer) from the sampler's tokens (>= 0,
  exactly 0 when the two agree); mismatch_tokens counts the tokens measured
  (0 when every token is from another version: nothing to compare).
  mismatch_agreement_p5 is the 5th percentile over tokens of the agreement
  exp(-|d|) (1 when the two agree; Sparrow's monitor for sparse rollout).
  """
  d_NxL = jnp.where(mask_NxL, trainer_logp_NxL - sampler_logp_NxL, 0.0)
  return {"mismatch_tokens": mask_NxL.sum(), "mismatch_abs_mean": _masked_mean(jnp.abs(d_NxL), mask_NxL),
          "mismatch_max": jnp.max(jnp.abs(d_NxL)),
          "mismatch_kl": _masked_mean(jnp.exp(d_NxL) - 1.0 - d_NxL, mask_NxL),
          "mismatch_agreement_p5": masked_quantile(jnp.exp(-jnp.abs(d_NxL)), mask_NxL, 0.05)}


def masked_quantile(x_NxL, mask_NxL, q: float):
  """The q-quantile of the masked entries (numpy's default "linear" rule);
  1.0 when nothing is masked in (an agreement with nothing to compare)."""
  n = mask_NxL.sum()
  v = jnp.sort(jnp.where(mask_NxL, x_NxL, jnp.inf).reshape(-1))
  pos = q * jnp.maximum(n - 1, 0).astype(jnp.float32)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
  frac = pos - lo
  value = v[lo] * (1.0 - frac) + jnp.where(frac > 0, v[hi], 0.0) * frac
  return jnp.where(n > 0, value, 1.0)


def mismatch_rejection(trainer_logp_NxL, sampler_logp_NxL, mask_NxL, threshold: float):
  """Rows to drop from the loss (Sparse-RL's rejection of anomalous rollouts):
  those with a token whose |trainer - sampler| log-prob gap exceeds
  `threshold`. Returns keep_N (bool); 0 turns the rule off."""
  gap_N = jnp.max(jnp.where(mask_NxL, jnp.abs(trainer_logp_NxL - sampler_logp_NxL), 0.0), axis=1)
  return (gap_N <= threshold) | (threshold <= 0)


def kl_penalty(logp_NxL, ref_logp_NxL, mask_NxL, aggregation: str = "token_mean",
               max_len: int | None = None, weight_NxL=None):
  """KL(policy || reference) from sampled tokens, the non-negative "k3" estimator.

  k3 = exp(ref - logp) - (ref - logp) - 1 per token (Schulman, 2020), as in
  DeepSeekMath's GRPO. Unbiased for the KL when tokens are drawn from the policy.
  """
  d_NxL = ref_logp_NxL - logp_NxL
  return aggregate(jnp.exp(d_NxL) - d_NxL - 1.0, mask_NxL, aggregation, max_len, weight_NxL)
