"""Budget allocation: how many rollouts each prompt gets (survey 6.2).

  vigor_round  VIGOR's probe-then-reallocate rule, one round at a time.
  vigor(...)   that rule as a transform: probes in the plan, rounds in extend.
  vip_allocate VIP's variance-minimising allocation under a total budget.
  vip(...)     the VIP rule as a plan transform over the replay state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxroll.replay.protocol import EmptyState, Groups, RolloutPlan, RolloutTransform, keep_groups, taken
from jaxroll.replay.state import ReplayState, group_moments


def vigor_round(reward_KxG, valid_KxG, remaining, round_size: int, max_per_prompt: int, key=None):
  """Extra rollouts for the next round of VIGOR (Jiang et al., 2026a).

  After probe rollouts for every prompt, each round gives one more rollout
  to each of the `round_size` groups with the highest observed reward
  variance (ties to the lower index), never past `max_per_prompt` per group
  and never past the `remaining` budget; repeating rounds spends the budget
  exactly unless every group is full. Runs under jax.jit. With `key`, the
  groups are ranked at random instead (the matched-rate control: the same
  rollouts per round, since that count depends only on the room left).

  Returns:
    extra_K: int32 rollouts to add per prompt this round.
  """
  _, var_K, n_K = group_moments(reward_KxG, valid_KxG)
  room_K = n_K < max_per_prompt
  rank_by_K = var_K if key is None else jax.random.uniform(key, var_K.shape)
  score_K = jnp.where(room_K, rank_by_K, -jnp.inf)
  order = jnp.argsort(-score_K, stable=True)
  rank_K = jnp.empty_like(order).at[order].set(jnp.arange(order.shape[0]))
  give = jnp.minimum(round_size, remaining)
  return ((rank_K < give) & room_K).astype(jnp.int32)


class VigorState(NamedTuple):
  remaining: jax.Array  # int32 rollouts of the step's budget not yet allocated


def vigor(budget: int, probes: int = 2, round_size: int = 8, max_per_prompt: int = 16,
          random: bool = False) -> RolloutTransform:
  """VIGOR (Jiang et al., 2026a): `probes` rollouts for every planned prompt,
  then the rest of a fixed per-step `budget` in rounds, each round's
  rollouts going to the groups with the highest observed reward variance.
  The budget is spent exactly unless every group reaches `max_per_prompt`.
  `random=True` is its matched-rate control: the same probes and rounds,
  each round's rollouts given to groups drawn at random, so it spends
  exactly the rollouts VIGOR spends.

  Correctness: empirical only. Prompts whose probes agree get few rollouts,
  so the update sees their groups with fewer samples (weights unchanged).
  Runs under jax.jit.
  """
  if probes < 1 or round_size < 1 or max_per_prompt < probes:
    raise ValueError("vigor needs probes >= 1, round_size >= 1 and max_per_prompt >= probes")

  def plan(p: RolloutPlan, state, replay, key):
    del replay, key
    take_K = taken(p)
    samples_K = jnp.where(take_K, probes, p.samples_K).astype(jnp.int32)
    spent = jnp.where(take_K, probes, 0).sum()
    return p._replace(samples_K=samples_K), VigorState(jnp.maximum(budget - spent, 0).astype(jnp.int32))

  def extend(g: Groups, state: VigorState, replay, key):
    del replay
    planned_KxG = g.valid_KxG.any(axis=1)[:, None]
    extra_K = vigor_round(jnp.where(planned_KxG, g.reward_KxG, 0.0), g.valid_KxG, state.remaining,
                          round_size, max_per_prompt, key=key if random else None)
    extra_K = extra_K * planned_KxG[:, 0]
    return extra_K, VigorState(state.remaining - extra_K.sum())

  return RolloutTransform(lambda replay: VigorState(jnp.int32(0)), plan, keep_groups, extend)


def vip_allocate(sigma_K, budget: int, n_min: int, n_max: int, mask_K=None):
  """Integer allocation minimising sum_k sigma_k^2 / n_k subject to
  sum_k n_k = budget and n_min <= n_k <= n_max, over the prompts in mask_K
  (others get 0).

  Each term is convex and decreasing in n_k, so adding rollouts one at a
  time where the variance drops most is optimal (greedy marginal
  allocation for separable convex objectives). Runs under jax.jit with a
  static budget; when the masked prompts cannot take the whole budget
  within n_max each, they all get n_max.

  Raises (eagerly, without a mask): ValueError when the bounds cannot meet the budget.
  """
  K = sigma_K.shape[0]
  if n_min < 1:
    raise ValueError(f"n_min must be >= 1 (the objective divides by n), got {n_min}")
  if mask_K is None:
    if not n_min * K <= budget <= n_max * K:
      raise ValueError(f"budget {budget} cannot be split over {K} prompts within [{n_min}, {n_max}] each")
    mask_K = jnp.ones((K,), bool)
  var_K = jnp.asarray(sigma_K, jnp.float32) ** 2

  def add_one(n_K, _):
    gain_K = var_K / jnp.maximum(n_K, 1) - var_K / (n_K + 1)
    gain_K = jnp.where(mask_K & (n_K < n_max), gain_K, -jnp.inf)
    room = (n_K.sum() < budget) & jnp.isfinite(gain_K.max())
    return n_K.at[jnp.argmax(gain_K)].add(room.astype(jnp.int32)), None

  start_K = jnp.where(mask_K, n_min, 0).astype(jnp.int32)
  n_K, _ = jax.lax.scan(add_one, start_K, None, length=budget)
  return n_K


def vip(budget: int, n_min: int, n_max: int, prior: float = 1.0, random: bool = False) -> RolloutTransform:
  """VIP-style allocation (Nguyen et al., 2026): per-prompt rollout counts
  that minimise the summed policy-gradient variance sum_k p_k(1-p_k)/n_k of
  the prompts the step takes (`protocol.taken`) under a total budget, with
  per-prompt bounds.

  The success estimate p_k is the replay state's smoothed success rate
  (reward sum + prior) / (samples + 2 prior), a simpler estimator than VIP's
  Gaussian process; the allocation rule is VIP's.

  Correctness: unbiased for a modified objective. Each prompt's gradient
  estimate stays unbiased; the allocation changes how precisely each is
  estimated, not which prompts are trained on. Runs under jax.jit.
  `random=True` is its matched-rate control: the same allocation rule over
  random per-prompt deviations, which spends the same budget.
  """

  def plan(p: RolloutPlan, state, replay: ReplayState, key):
    q = p.prompt_K
    rate_K = (replay.reward_sum_Q[q] + prior) / (replay.samples_Q[q] + 2 * prior)
    sigma_K = jnp.sqrt(rate_K * (1 - rate_K))
    if random:
      sigma_K = jax.random.uniform(key, sigma_K.shape, minval=0.05, maxval=0.5)
    take_K = taken(p)
    n_K = vip_allocate(sigma_K, budget, n_min, n_max, take_K)
    return p._replace(samples_K=jnp.where(take_K, n_K, p.samples_K)), state

  return RolloutTransform(lambda replay: EmptyState(), plan, keep_groups)
