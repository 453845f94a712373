"""Group-relative advantages for N = P * G trajectories (rows grouped by prompt).

Rows n = p * G .. p * G + G - 1 are the G samples of prompt p, the order
`RolloutEngine.rollout` returns. A degenerate group (all rewards equal)
carries no learning signal: every method gives it advantages of exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

METHODS = ("grpo", "dr_grpo", "rloo")


def degenerate_groups(reward_PxG, valid_PxG=None):
  """True for each group whose valid rewards are all equal, or that has
  fewer than 2 valid rows: no group-relative signal.

  The one definition every module uses (advantages, filters, replay
  bookkeeping, replay buffers). It compares rewards exactly (max == min):
  a variance test would call seven rewards of 0.1 informative, since their
  floating-point variance is about 5.6e-17, not 0. Runs under jax.jit.
  """
  r_PxG = jnp.asarray(reward_PxG, jnp.float32)
  v_PxG = jnp.ones_like(r_PxG, bool) if valid_PxG is None else jnp.asarray(valid_PxG, bool)
  hi_P = jnp.where(v_PxG, r_PxG, -jnp.inf).max(axis=1)
  lo_P = jnp.where(v_PxG, r_PxG, jnp.inf).min(axis=1)
  return (hi_P == lo_P) | (v_PxG.sum(axis=1) < 2)


def group_advantages(rewards_N, group_size: int, method: str = "grpo", eps: float = 1e-6,
                     valid_N=None):
  """Per-trajectory advantages and the degenerate-group mask.

  Methods:
    grpo: (r - mean_group) / (std_group + eps), std with Bessel's correction
      (ddof=1) as in DeepSeekMath's GRPO implementations.
    dr_grpo: r - mean_group (Dr. GRPO drops the std normalisation, which
      up-weights near-degenerate groups).
    rloo: r - mean of the other G-1 rewards = G/(G-1) * (r - mean_group).

  Args:
    rewards_N: float rewards, N = P * G.
    group_size: G (>= 2).
    method: one of METHODS.
    eps: std floor for grpo.
    valid_N: optional bool mask of the rows that are group members (for
      example, truncated rows dropped from their group): the statistics use
      the valid rows only, with k = their count in place of G, and invalid
      rows get advantage 0. A group with fewer than 2 valid rows is
      degenerate.

  Returns:
    (adv_N float32, degenerate_P bool).
  """
  if method not in METHODS:
    raise ValueError(f"unknown advantage method {method!r}; expected one of {METHODS}")
  G = group_size
  if G < 2:
    raise ValueError(f"group-relative advantages need group_size >= 2, got {G}")
  r_PxG = jnp.asarray(rewards_N, jnp.float32).reshape(-1, G)
  v_PxG = jnp.ones_like(r_PxG, bool) if valid_N is None else jnp.asarray(valid_N, bool).reshape(-1, G)
  k_P1 = v_PxG.sum(axis=1, keepdims=True).astype(jnp.float32)
  safe_k = jnp.maximum(k_P1, 2.0)
  mean_P1 = jnp.where(v_PxG, r_PxG, 0.0).sum(axis=1, keepdims=True) / jnp.maximum(k_P1, 1.0)
  centred_PxG = jnp.where(v_PxG, r_PxG - mean_P1, 0.0)
  degenerate_P = degenerate_groups(r_PxG, v_PxG)
  if method == "grpo":
    std_P1 = jnp.sqrt((centred_PxG ** 2).sum(axis=1, keepdims=True) / (safe_k - 1.0))
    adv_PxG = centred_PxG / (std_P1 + eps)
  elif method == "dr_grpo":
    adv_PxG = centred_PxG
  else:
    adv_PxG = centred_PxG * (safe_k / (safe_k - 1.0))
  # Exactly zero for degenerate groups (centring can leave rounding residue).
  adv_PxG = jnp.where(degenerate_P[:, None] | ~v_PxG, 0.0, adv_PxG)
  return adv_PxG.reshape(-1), degenerate_P


# For callers on the host (numpy in, once a step): one compiled program per
# shape. Called eagerly, each of their array ops compiles on its own the
# first time it meets a shape (a dozen compilations in a run's first step).
degenerate_groups_on_host = jax.jit(degenerate_groups)
group_advantages_on_host = jax.jit(group_advantages, static_argnames=("group_size", "method", "eps"))
