"""Rollout selection: which generated trajectories enter the update (survey 6.1).

Transforms here act after generation (`select`); their plans pass through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxroll.replay.protocol import EmptyState, Groups, RolloutTransform, keep_plan
from jaxroll.rl.advantages import degenerate_groups


def max_variance_subset(reward_G, valid_G, m: int):
  """Mask of the m valid rewards with the largest variance (PODS's rule).

  For a fixed subset size the variance is maximised by the k highest and the
  m - k lowest rewards for some k (Xu et al., 2025), so it suffices to try
  the m + 1 splits. A group with at most m valid rewards keeps them all.
  """
  G = reward_G.shape[0]
  order_hi = jnp.argsort(jnp.where(valid_G, -reward_G, jnp.inf), stable=True)  # valid, highest first
  order_lo = jnp.argsort(jnp.where(valid_G, reward_G, jnp.inf), stable=True)  # valid, lowest first
  rank_hi = jnp.empty(G, jnp.int32).at[order_hi].set(jnp.arange(G, dtype=jnp.int32))
  rank_lo = jnp.empty(G, jnp.int32).at[order_lo].set(jnp.arange(G, dtype=jnp.int32))

  def split(k):
    take = valid_G & ((rank_hi < k) | (rank_lo < m - k))
    # Overlapping picks (k + (m - k) > valid count) leave fewer than m: not a valid split.
    x = jnp.where(take, reward_G, 0.0)
    n = take.sum()
    var = (jnp.where(take, (reward_G - x.sum() / jnp.maximum(n, 1)) ** 2, 0.0)).sum() / jnp.maximum(n, 1)
    return jnp.where(n == m, var, -jnp.inf), take

  variances, takes = jax.vmap(split)(jnp.arange(m + 1))
  best = takes[jnp.argmax(variances)]
  return jnp.where(valid_G.sum() <= m, valid_G, best)


def pods(keep: int) -> RolloutTransform:
  """PODS (Xu et al., 2025): train on the `keep` of each group's n rollouts
  whose rewards have maximal variance.

  Correctness: empirical only. Selecting trajectories by their realised
  rewards makes the update depend on the signal itself (survey 6.3); the
  weights of dropped trajectories are 0 and recorded by the loop.
  Runs under jax.jit.

  Args:
    keep: m, trajectories kept per group (>= 2).
  """
  if keep < 2:
    raise ValueError(f"pods keep must be >= 2 (a group needs two rewards to differ), got {keep}")

  def select(groups: Groups, state, replay, key):
    del replay, key
    take_KxG = jax.vmap(lambda r, v: max_variance_subset(r, v, keep))(groups.reward_KxG, groups.valid_KxG)
    return groups._replace(weight_KxG=groups.weight_KxG * take_KxG), state

  return RolloutTransform(lambda replay: EmptyState(), keep_plan, select)


def drop_zero_variance_groups() -> RolloutTransform:
  """DAPO's dynamic-sampling filter (Yu et al., 2025): a group whose rewards
  are all equal has zero group-relative advantage, so it leaves the batch.
  The loop keeps sampling new prompts until the batch is full.

  Correctness: exact for the GRPO objective as usually computed (those
  groups contribute zero gradient); it changes which prompts fill a batch of
  fixed size, so batch statistics shift. Runs under jax.jit.
  """

  def select(groups: Groups, state, replay, key):
    del replay, key
    informative_K = ~degenerate_groups(groups.reward_KxG, groups.valid_KxG)
    return groups._replace(weight_KxG=groups.weight_KxG * informative_K[:, None]), state

  return RolloutTransform(lambda replay: EmptyState(), keep_plan, select)
