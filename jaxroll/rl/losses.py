"""Policy-gradient losses over token log-probabilities, with masks, jit-able.

All functions take per-token arrays [N, L] and a mask_NxL of the tokens that
enter the loss (generated tokens, minus anything a technique masks out).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
OFF_POLICY = ("ppo", "decoupled")


def aggregate(per_token_NxL, mask_NxL, how: str, max_len: int | None = None):
  """Reduces a per-token quantity to a scalar.

  token_mean: sum over all masked tokens / their count (DAPO's token-level
    loss: long sequences weigh more).
  seq_mean_token_mean: mean over each sequence's tokens, then over sequences
    (the original GRPO objective).
  seq_mean_token_sum_norm: each sequence's token sum / a constant max_len,
    then mean over sequences (Dr. GRPO: no length normalisation bias).
  """
  m = mask_NxL.astype(jnp.float32)
  x = per_token_NxL * m
  if how == "token_mean":
    return x.sum() / jnp.maximum(m.sum(), 1.0)
  if how == "seq_mean_token_mean":
    return (x.sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)).mean()
  if how == "seq_mean_token_sum_norm":
    return (x.sum(axis=1) / float(max_len or per_token_NxL.shape[1])).mean()
  raise ValueError(f"unknown loss aggregation {how!r}; expected one of {AGGREGATIONS}")


def ppo_clipped_loss(logp_NxL, behaviour_logp_NxL, adv_N, mask_NxL, *, clip_low: float = 0.2,
                     clip_high: float = 0.2, aggregation: str = "token_mean"):
  """PPO's clipped surrogate with a per-token importance ratio.

  ratio = exp(logp - behaviour_logp); objective = min(ratio * A,
  clip(ratio, 1 - clip_low, 1 + clip_high) * A); loss = -aggregate(objective).
  clip_high > clip_low is DAPO's asymmetric ("clip-higher") variant.

  Returns:
    (loss, stats) with stats = {"clip_fraction", "ratio_mean"} over masked tokens.
  """
  ratio_NxL = jnp.exp(logp_NxL - behaviour_logp_NxL)
  adv_NxL = adv_N[:, None]
  clipped_NxL = jnp.clip(ratio_NxL, 1.0 - clip_low, 1.0 + clip_high)
  objective_NxL = jnp.minimum(ratio_NxL * adv_NxL, clipped_NxL * adv_NxL)
  loss = -aggregate(objective_NxL, mask_NxL, aggregation)
  m = mask_NxL.astype(jnp.float32)
  count = jnp.maximum(m.sum(), 1.0)
  was_clipped = (ratio_NxL * adv_NxL > clipped_NxL * adv_NxL).astype(jnp.float32)
  stats = {"clip_fraction": (was_clipped * m).sum() / count, "ratio_mean": (ratio_NxL * m).sum() / count}
  return loss, stats


def decoupled_ppo_loss(logp_NxL, proximal_logp_NxL, behaviour_logp_NxL, adv_N, mask_NxL, *,
                       clip_low: float = 0.2, clip_high: float = 0.2, is_cap: float = 2.0,
                       aggregation: str = "token_mean"):
  """The decoupled PPO objective (Hilton et al., 2021; AReaL; POPO's replay).

  Off-policy tokens were sampled by a behaviour policy mu, which may be
  several versions old. The trust region is taken around a proximal policy
  (the parameters at the start of this update), and the importance weight
  pi_prox / mu, truncated at `is_cap` and held constant, corrects for mu:

    w = min(exp(prox - behaviour), is_cap);  r = exp(logp - prox)
    objective = w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

  With prox == behaviour, w = 1 and this is `ppo_clipped_loss`. The
  truncation keeps the update's variance bounded at the price of a bias
  towards mu on tokens whose weight exceeds the cap.

  Returns:
    (loss, stats): the PPO stats plus is_weight_mean / _max,
    is_truncated_fraction and is_ess (effective sample size of the weights
    as a fraction of the masked tokens, 1 when all weights are equal).
  """
  w_NxL = jax.lax.stop_gradient(jnp.minimum(jnp.exp(proximal_logp_NxL - behaviour_logp_NxL), is_cap))
  ratio_NxL = jnp.exp(logp_NxL - proximal_logp_NxL)
  adv_NxL = adv_N[:, None]
  clipped_NxL = jnp.clip(ratio_NxL, 1.0 - clip_low, 1.0 + clip_high)
  objective_NxL = w_NxL * jnp.minimum(ratio_NxL * adv_NxL, clipped_NxL * adv_NxL)
  loss = -aggregate(objective_NxL, mask_NxL, aggregation)
  m = mask_NxL.astype(jnp.float32)
  count = jnp.maximum(m.sum(), 1.0)
  was_clipped = (ratio_NxL * adv_NxL > clipped_NxL * adv_NxL).astype(jnp.float32)
  raw_NxL = jnp.exp(proximal_logp_NxL - behaviour_logp_NxL)
  wm = w_NxL * m
  stats = {"clip_fraction": (was_clipped * m).sum() / count, "ratio_mean": (ratio_NxL * m).sum() / count,
           "is_weight_mean": wm.sum() / count, "is_weight_max": jnp.max(jnp.where(mask_NxL, w_NxL, 0.0)),
           "is_truncated_fraction": ((raw_NxL > is_cap) * m).sum() / count,
           "is_ess": wm.sum() ** 2 / jnp.maximum(count * (wm * w_NxL).sum(), 1e-30)}
  return loss, stats


def kl_penalty(logp_NxL, ref_logp_NxL, mask_NxL, aggregation: str = "token_mean"):
  """KL(policy || reference) from sampled tokens, the non-negative "k3" estimator.

  k3 = exp(ref - logp) - (ref - logp) - 1 per token (Schulman, 2020), as in
  DeepSeekMath's GRPO. Unbiased for the KL when tokens are drawn from the policy.
  """
  d_NxL = ref_logp_NxL - logp_NxL
  return aggregate(jnp.exp(d_NxL) - d_NxL - 1.0, mask_NxL, aggregation)
