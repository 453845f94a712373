"""Matched-rate random controls (survey Section 8.7, protocol 1).

`random_control(t)` runs technique t to learn how much it removes, then
removes the same amount chosen uniformly at random instead: as many
prompts skipped at plan time, and, after generation, as many whole groups
dropped (when t drops whole groups) plus, within each other group, as many
trajectories. What t would have kept is discarded; t's state still learns
from the groups generated, so its rate follows the same dynamics. A gain
of t over its control is the value of t's criterion, not of doing less.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxroll.replay.protocol import Groups, RolloutPlan, RolloutTransform


def random_subset(key, eligible_K, count):
  """A mask of `count` entries drawn uniformly without replacement from eligible_K."""
  u_K = jnp.where(eligible_K, jax.random.uniform(key, eligible_K.shape), jnp.inf)
  order = jnp.argsort(u_K)
  rank_K = jnp.empty_like(order).at[order].set(jnp.arange(order.shape[0]))
  return eligible_K & (rank_K < count)


def random_control(t: RolloutTransform) -> RolloutTransform:
  if t.replace is not None or t.extend is not None:
    # Which buffer slots a random replacement may draw (age cap, one group
    # per prompt), or how many rollouts a round adds, is the technique's own
    # rule: it builds its control.
    raise ValueError("replay and allocation techniques provide their own random control "
                     "(e.g. popo(random=True), vigor(random=True))")
  def plan(p: RolloutPlan, state, replay, key):
    k_t, k_r = jax.random.split(key)
    chosen, state = t.plan(p, state, replay, k_t)
    # Prompts the criterion skipped (it may also have replaced or reweighted
    # candidates; the control keeps the original candidates and weights).
    eligible_K = p.samples_K > 0
    skipped = (eligible_K & (chosen.samples_K == 0)).sum()
    drop_K = random_subset(k_r, eligible_K, skipped)
    return p._replace(samples_K=jnp.where(drop_K, 0, p.samples_K)), state

  def select(g: Groups, state, replay, key):
    k_t, k_g, k_n = jax.random.split(key, 3)
    chosen, state = t.select(g, state, replay, k_t)
    kept_KxG = (g.weight_KxG > 0) & g.valid_KxG
    had_K = kept_KxG.any(axis=1)
    now_KxG = kept_KxG & (chosen.weight_KxG > 0)
    whole_K = had_K & ~now_KxG.any(axis=1)
    # Whole groups dropped by the criterion: as many random groups.
    drop_group_K = random_subset(k_g, had_K, whole_K.sum())
    # Partial drops within a group: as many random trajectories of the same
    # group (the group keeps its identity; only the choice is random).
    partial_K = jnp.where(whole_K, 0, (kept_KxG & ~now_KxG).sum(axis=1))
    keys = jax.random.split(k_n, g.prompt_K.shape[0])
    drop_traj_KxG = jax.vmap(random_subset)(keys, kept_KxG, partial_K)
    keep_KxG = kept_KxG & ~drop_group_K[:, None] & ~drop_traj_KxG
    return g._replace(weight_KxG=jnp.where(keep_KxG, g.weight_KxG, 0.0)), state

  return RolloutTransform(t.init, plan, select)
