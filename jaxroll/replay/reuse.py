"""Replay of past groups in place of degenerate ones (POPO; survey 6.1, 6.3).

A degenerate group (all rewards equal) has zero group-relative advantage,
so its rollouts were paid for and teach nothing. POPO (Mao et al., 2026)
substitutes an effective group sampled at an earlier step, taken from the
replay buffer (`ReplayState.buffer`), and corrects for its older behaviour
policy with the decoupled importance-sampling objective
(`jaxroll.rl.losses.decoupled_ppo_loss`; the trainer switches to it when
popo is in the chain).

The loop pushes every effective fresh group into the buffer with priority
= its reward variance (the quality of its signal). At replay time a slot's
score is priority * decay ** age: recent groups first, since the older the
behaviour policy the noisier the corrected update. Groups older than
`max_age` steps, groups of prompts already in the batch, and all but the
best-scored group of each prompt are not eligible. A replayed group leaves
the buffer, so no group is trained on twice through replay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxroll.replay.controls import random_subset
from jaxroll.replay.protocol import EmptyState, Groups, RolloutTransform, keep_groups, keep_plan
from jaxroll.replay.state import GroupBuffer
from jaxroll.rl.advantages import degenerate_groups


def replay_scores(buffer: GroupBuffer, step, exclude_prompt_K, *, max_age: int, decay: float):
  """score_C = priority * decay ** age for eligible slots, -inf for the rest.

  Eligible: a held group, sampled 1..max_age steps before `step`, whose
  prompt is not in exclude_prompt_K, and the best-scored of its prompt's
  groups (ties: the lower slot).
  """
  age_C = step - buffer.step_C
  score_C = buffer.priority_C * jnp.asarray(decay, jnp.float32) ** age_C.astype(jnp.float32)
  ok_C = (buffer.prompt_C >= 0) & (age_C >= 1) & (age_C <= max_age)
  ok_C &= ~(buffer.prompt_C[:, None] == exclude_prompt_K[None, :]).any(axis=1)
  score_C = jnp.where(ok_C, score_C, -jnp.inf)
  C = buffer.capacity
  same_CxC = buffer.prompt_C[:, None] == buffer.prompt_C[None, :]
  idx = jnp.arange(C)
  beats_CxC = (score_C[None, :] > score_C[:, None]) | (
      (score_C[None, :] == score_C[:, None]) & (idx[None, :] < idx[:, None]))
  dominated_C = (same_CxC & beats_CxC & ok_C[None, :]).any(axis=1)
  return jnp.where(dominated_C, -jnp.inf, score_C)


def assign_slots(replace_K, score_C):
  """slot_K: the i-th group to replace (in order) gets the i-th best slot;
  -1 where a group is kept or the eligible slots have run out."""
  order_C = jnp.argsort(-score_C, stable=True)
  available = jnp.isfinite(score_C).sum()
  rank_K = jnp.cumsum(replace_K) - 1
  slot_K = order_C[jnp.clip(rank_K, 0, score_C.shape[0] - 1)] if score_C.shape[0] else rank_K
  return jnp.where(replace_K & (rank_K < available), slot_K, -1).astype(jnp.int32)


def popo(*, max_age: int, decay: float, random: bool = False) -> RolloutTransform:
  """POPO's prioritised group replay (Mao et al., 2026).

  `replace` gives each degenerate group of the step (in batch order) the
  best-scored eligible buffer slot (`replay_scores`); the loop swaps the
  group's rows for the slot's recorded tokens, behaviour log-probs,
  versions and rewards, and empties the slot.

  With random=True, the matched-rate random control: as many groups as
  POPO would replace, chosen uniformly among all the step's groups, each
  given a uniformly drawn eligible slot. Its gain over nothing is doing
  more updates on replayed data; POPO's over it is the choice of which.

  Correctness: unbiased for the GRPO objective on the replayed groups up to
  the importance weight's truncation (decoupled_ppo_loss; is_cap) and the
  age cap; the batch composition is changed, so the weights it applied are
  in the metrics (is_weight_*, groups_replayed). Runs under jax.jit.

  Args:
    max_age: replay only groups sampled at most this many steps ago (>= 1).
    decay: recency factor in (0, 1] of the replay score.
  """
  if max_age < 1:
    raise ValueError(f"popo max_age must be >= 1 step, got {max_age}")
  if not 0.0 < decay <= 1.0:
    raise ValueError(f"popo decay must be in (0, 1], got {decay}")

  def replace(groups: Groups, state, replay, key):
    kept_K = ((groups.weight_KxG > 0) & groups.valid_KxG).any(axis=1)
    degenerate_K = kept_K & degenerate_groups(groups.reward_KxG, groups.valid_KxG)
    score_C = replay_scores(replay.buffer, replay.step, groups.prompt_K, max_age=max_age, decay=decay)
    if not random:
      return assign_slots(degenerate_K, score_C), state
    k_g, k_c = jax.random.split(key)
    count = jnp.minimum(degenerate_K.sum(), jnp.isfinite(score_C).sum())
    chosen_K = random_subset(k_g, kept_K, count)
    shuffled_C = jnp.where(jnp.isfinite(score_C), jax.random.uniform(k_c, score_C.shape), -jnp.inf)
    return assign_slots(chosen_K, shuffled_C), state

  return RolloutTransform(lambda replay: EmptyState(), keep_plan, keep_groups, replace=replace)
