"""Prompt filtering and selection before rollout (survey 6.2).

Each factory returns a RolloutTransform whose `plan` sets samples_K = 0 for
the candidates it skips and whose `select` learns from the groups it sees.
All maths runs under jax.jit; K (candidates) and the number of prompts to
keep are static.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxroll.replay.protocol import Groups, RolloutPlan, RolloutTransform
from jaxroll.replay.state import ReplayState, group_moments
from jaxroll.rl.advantages import degenerate_groups


def _keep_best(plan: RolloutPlan, score_K, num_keep: int) -> RolloutPlan:
  """Keeps the num_keep (at most `limit`) planned candidates with the highest
  score (ties: lower index)."""
  score_K = jnp.where(plan.samples_K > 0, score_K, -jnp.inf)
  order = jnp.argsort(-score_K, stable=True)
  rank_K = jnp.empty_like(order).at[order].set(jnp.arange(order.shape[0]))
  keep = jnp.minimum(num_keep, plan.limit)
  return plan._replace(samples_K=jnp.where(rank_K < keep, plan.samples_K, 0))


# -- GRESO --------------------------------------------------------------------

class GresoState(NamedTuple):
  explore_easy: jax.Array  # p_e for prompts whose degenerate groups were all correct
  explore_hard: jax.Array  # ... all wrong


def greso(target: float = 0.25, step: float = 0.01, floor: float = 0.05,
          solved: float = 1.0) -> RolloutTransform:
  """GRESO (Zheng et al., 2026b): skip prompts whose recent groups were all
  degenerate, before rollout.

  A prompt whose last z groups in a row were degenerate is skipped with
  probability 1 - p_e ** z (z = 0: never skipped). p_e is kept separately
  for easy prompts (their degenerate groups were solved) and hard ones, and
  after each step moves by `step` toward the rate at which sampled groups
  of that kind came out degenerate: down (more skipping) while that rate is
  above `target`, up while below. p_e stays within [floor, 1], and a skip
  never exceeds 1 - floor, so every prompt keeps a chance `floor` of being
  revisited (later regression stays visible).

  Correctness: empirical only. The effective prompt distribution becomes
  policy dependent (survey 6.3); the loop records the skip rate.

  Args:
    target: the degenerate-group rate per kind that p_e is steered to.
    step: change of p_e per step.
    floor: the least probability of sampling any prompt (exploration).
    solved: a group mean reward at or above this counts as easy.
  """
  for name, v in (("target", target), ("floor", floor)):
    if not 0.0 < v < 1.0:
      raise ValueError(f"greso {name} must be in (0, 1), got {v}")
  if step <= 0:
    raise ValueError(f"greso step must be positive, got {step}")

  def init(replay):
    return GresoState(jnp.float32(1.0), jnp.float32(1.0))

  def plan(p: RolloutPlan, state: GresoState, replay: ReplayState, key):
    q = p.prompt_K
    z_K = replay.degenerate_run_Q[q].astype(jnp.float32)
    easy_K = replay.last_mean_Q[q] >= solved
    explore_K = jnp.where(easy_K, state.explore_easy, state.explore_hard)
    skip_K = jnp.minimum(1.0 - explore_K ** z_K, 1.0 - floor)
    skipped_K = jax.random.uniform(key, q.shape) < skip_K
    return p._replace(samples_K=jnp.where(skipped_K, 0, p.samples_K)), state

  def select(g: Groups, state: GresoState, replay, key):
    del replay, key
    mean_K, var_K, n_K = group_moments(g.reward_KxG, g.valid_KxG)
    sampled_K = n_K > 0
    degenerate_K = sampled_K & degenerate_groups(g.reward_KxG, g.valid_KxG)

    def adapt(p_e, kind_K):
      rate = (degenerate_K & kind_K).sum() / jnp.maximum(sampled_K.sum(), 1)
      moved = jnp.where(rate > target, p_e - step, p_e + step)
      return jnp.where(sampled_K.any(), jnp.clip(moved, floor, 1.0), p_e)

    easy_K = mean_K >= solved
    return g, GresoState(adapt(state.explore_easy, easy_K), adapt(state.explore_hard, ~easy_K))

  return RolloutTransform(init, plan, select)


# -- MoPPS --------------------------------------------------------------------

class BetaState(NamedTuple):
  alpha_Q: jax.Array
  beta_Q: jax.Array


def beta_update(state: BetaState, prompt_K, successes_K, trials_K, decay: float,
                prior: tuple[float, float]) -> BetaState:
  """Discounted Beta-Bernoulli update of the observed prompts:
  a <- decay * a + (1 - decay) * a0 + successes, likewise b with failures.
  Unobserved prompts (trials 0) keep their posterior."""
  a0, b0 = prior
  seen_K = trials_K > 0
  q = jnp.where(seen_K, prompt_K, state.alpha_Q.shape[0])
  a = decay * state.alpha_Q[prompt_K] + (1 - decay) * a0 + successes_K
  b = decay * state.beta_Q[prompt_K] + (1 - decay) * b0 + (trials_K - successes_K)
  return BetaState(state.alpha_Q.at[q].set(a, mode="drop"), state.beta_Q.at[q].set(b, mode="drop"))


def mopps(num_keep: int, target: float = 0.5, decay: float = 0.9,
          prior: tuple[float, float] = (1.0, 1.0), success: float = 1.0) -> RolloutTransform:
  """MoPPS (Qu et al., 2026): a Beta posterior of each prompt's success rate,
  Thompson-sampled; the `num_keep` candidates whose sampled rate is nearest
  `target` get rollouts. Posteriors decay toward the prior each time a
  prompt is observed, tracking a policy that keeps changing.

  Correctness: empirical only (policy-dependent prompt distribution).

  Args:
    num_keep: prompts rolled out per step (the rest are skipped).
    target: the success rate that is most informative (0.5 for binary rewards).
    decay: lambda in (0, 1]; 1 keeps all history.
    success: a reward at or above this is a success.
  """
  if not 0.0 < target < 1.0:
    raise ValueError(f"mopps target must be in (0, 1), got {target}")
  if not 0.0 < decay <= 1.0:
    raise ValueError(f"mopps decay must be in (0, 1], got {decay}")

  def init(replay: ReplayState):
    Q = replay.num_prompts
    return BetaState(jnp.full((Q,), prior[0], jnp.float32), jnp.full((Q,), prior[1], jnp.float32))

  def plan(p: RolloutPlan, state: BetaState, replay, key):
    q = p.prompt_K
    theta_K = jax.random.beta(key, state.alpha_Q[q], state.beta_Q[q])
    return _keep_best(p, -jnp.abs(theta_K - target), num_keep), state

  def select(g: Groups, state: BetaState, replay, key):
    del replay, key
    wins_K = ((g.reward_KxG >= success) & g.valid_KxG).sum(axis=1).astype(jnp.float32)
    trials_K = g.valid_KxG.sum(axis=1).astype(jnp.float32)
    return g, beta_update(state, g.prompt_K, wins_K, trials_K, decay, prior)

  return RolloutTransform(init, plan, select)


# -- KGPS ---------------------------------------------------------------------

class KalmanState(NamedTuple):
  mean_Q: jax.Array  # posterior mean of the success logit
  var_Q: jax.Array  # its variance at the step last updated
  step_Q: jax.Array  # float32 step of the last update
  now: jax.Array  # float32 current step (advanced by each select)


def kalman_predict(var_Q, elapsed_Q, drift: float):
  """Random-walk prediction: the logit's variance grows by drift per step unseen."""
  return var_Q + drift * elapsed_Q


def kalman_update(mean, var, y, r):
  """Scalar Kalman update with observation y of noise variance r."""
  gain = var / (var + r)
  return mean + gain * (y - mean), (1.0 - gain) * var


def empirical_logit(successes, trials):
  """The group's success logit and its delta-method variance, smoothed by 1/2."""
  rate = (successes + 0.5) / (trials + 1.0)
  return jnp.log(rate / (1 - rate)), 1.0 / ((trials + 1.0) * rate * (1 - rate))


def kgps(num_keep: int, group_size: int, drift: float = 0.05, prior_var: float = 4.0,
         success: float = 1.0) -> RolloutTransform:
  """KGPS-style tracking (Zhu et al., 2026c): a linear-Gaussian state-space
  estimate of each prompt's success logit. Between observations the logit
  is a random walk, so its variance grows by `drift` per step unseen; each
  group is an observation (its smoothed empirical logit, with delta-method
  variance). The `num_keep` candidates with the highest expected
  informativeness, the probability that a group of `group_size` is not
  degenerate at the posterior's predictive success rate, get rollouts.

  Correctness: empirical only (policy-dependent prompt distribution).
  """
  if drift < 0 or prior_var <= 0:
    raise ValueError("kgps drift must be >= 0 and prior_var > 0")

  def init(replay: ReplayState):
    Q = replay.num_prompts
    return KalmanState(jnp.zeros((Q,), jnp.float32), jnp.full((Q,), prior_var, jnp.float32),
                       jnp.zeros((Q,), jnp.float32), jnp.float32(0.0))

  def plan(p: RolloutPlan, state: KalmanState, replay, key):
    del key
    q = p.prompt_K
    var_K = kalman_predict(state.var_Q[q], state.now - state.step_Q[q], drift)
    # Predictive success rate of a logit-normal (probit approximation).
    rate_K = jax.nn.sigmoid(state.mean_Q[q] / jnp.sqrt(1.0 + jnp.pi * var_K / 8.0))
    informative_K = 1.0 - rate_K ** group_size - (1.0 - rate_K) ** group_size
    return _keep_best(p, informative_K, num_keep), state

  def select(g: Groups, state: KalmanState, replay, key):
    del replay, key
    wins_K = ((g.reward_KxG >= success) & g.valid_KxG).sum(axis=1).astype(jnp.float32)
    trials_K = g.valid_KxG.sum(axis=1).astype(jnp.float32)
    q = g.prompt_K
    var_K = kalman_predict(state.var_Q[q], state.now - state.step_Q[q], drift)
    y_K, r_K = empirical_logit(wins_K, trials_K)
    mean_K, var_K = kalman_update(state.mean_Q[q], var_K, y_K, r_K)
    idx = jnp.where(trials_K > 0, q, state.mean_Q.shape[0])
    put = lambda a, x: a.at[idx].set(x, mode="drop")
    return g, KalmanState(put(state.mean_Q, mean_K), put(state.var_Q, var_K),
                          put(state.step_Q, jnp.full_like(mean_K, state.now)), state.now + 1.0)

  return RolloutTransform(init, plan, select)


# -- VCRL ---------------------------------------------------------------------

def vcrl(threshold: float = 0.3, replay_slots: int = 0) -> RolloutTransform:
  """VCRL (Jiang et al., 2025): a curriculum on group reward variance.

  After generation, a group whose variance, normalised by the largest a
  reward in [0, 1] can have (1/4), is below `threshold` leaves the update.
  Before generation, the last `replay_slots` candidates are replaced by the
  prompts with the highest variance last seen (the memory bank), among
  those not already candidates and not sampled at the current step.

  Correctness: empirical only.
  """
  if not 0.0 <= threshold <= 1.0:
    raise ValueError(f"vcrl threshold must be in [0, 1], got {threshold}")

  def plan(p: RolloutPlan, state, replay: ReplayState, key):
    del key
    if not replay_slots:
      return p, state
    Q = replay.num_prompts
    in_plan_Q = jnp.zeros((Q,), bool).at[p.prompt_K].set(True)
    score_Q = jnp.where((replay.last_step_Q >= 0) & ~in_plan_Q & (replay.last_var_Q * 4.0 >= threshold),
                        replay.last_var_Q, -jnp.inf)
    best_R = jnp.argsort(-score_Q, stable=True)[:replay_slots]
    usable_R = jnp.isfinite(score_Q[best_R])
    K = p.prompt_K.shape[0]
    slot_R = K - replay_slots + jnp.arange(replay_slots)
    return p._replace(prompt_K=p.prompt_K.at[slot_R].set(
        jnp.where(usable_R, best_R, p.prompt_K[slot_R]).astype(jnp.int32))), state

  def select(g: Groups, state, replay, key):
    del replay, key
    _, var_K, _ = group_moments(g.reward_KxG, g.valid_KxG)
    return g._replace(weight_KxG=g.weight_KxG * (var_K * 4.0 >= threshold)[:, None]), state

  return RolloutTransform(lambda replay: (), plan, select)
