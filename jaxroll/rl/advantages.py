"""Group-relative advantages for N = P * G trajectories (rows grouped by prompt).

Rows n = p * G .. p * G + G - 1 are the G samples of prompt p, the order
`RolloutEngine.rollout` returns. A degenerate group (all rewards equal)
carries no learning signal: every method gives it advantages of exactly 0.
"""

from __future__ import annotations

import jax.numpy as jnp

METHODS = ("grpo", "dr_grpo", "rloo")


def group_advantages(rewards_N, group_size: int, method: str = "grpo", eps: float = 1e-6):
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

  Returns:
    (adv_N float32, degenerate_P bool).
  """
  if method not in METHODS:
    raise ValueError(f"unknown advantage method {method!r}; expected one of {METHODS}")
  G = group_size
  if G < 2:
    raise ValueError(f"group-relative advantages need group_size >= 2, got {G}")
  r_PxG = jnp.asarray(rewards_N, jnp.float32).reshape(-1, G)
  centred_PxG = r_PxG - r_PxG.mean(axis=1, keepdims=True)
  degenerate_P = jnp.all(r_PxG == r_PxG[:, :1], axis=1)
  if method == "grpo":
    adv_PxG = centred_PxG / (r_PxG.std(axis=1, ddof=1, keepdims=True) + eps)
  elif method == "dr_grpo":
    adv_PxG = centred_PxG
  else:
    adv_PxG = centred_PxG * (G / (G - 1))
  # Exactly zero for degenerate groups (centring can leave rounding residue).
  adv_PxG = jnp.where(degenerate_P[:, None], 0.0, adv_PxG)
  return adv_PxG.reshape(-1), degenerate_P
