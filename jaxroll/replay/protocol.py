"""The rollout-transform protocol: every technique is a pair of pure functions.

Modelled on optax's GradientTransformation. A technique is a factory that
closes over its hyperparameters and returns a `RolloutTransform`:

  init(replay)                              -> state
  plan(plan, state, replay, key)            -> (plan, state)     before generation
  select(groups, state, replay, key)        -> (groups, state)   after generation
  extend(groups, state, replay, key)        -> (extra_K, state)  optional: more rollouts
                                                                 after a round (VIGOR)
  replace(groups, state, replay, key)       -> (slot_K, state)   optional: once per step,
                                                                 swap groups for buffer
                                                                 slots (POPO's replay)

`plan` decides which candidate prompts get rollouts and how many
(`RolloutPlan.samples_K`, 0 = skipped) and with what weight their groups
enter the loss; `select` decides which generated trajectories enter the
update and with what weight (`Groups.weight_KxG`, 0 = dropped) and may
record what it learned in its state. Neither changes array shapes: the
loop compacts at the host boundary, so transforms stay jit-able.

`chain(a, b)` runs a's plan then b's, and a's select then b's; its state is
the tuple of their states. `identity()` changes nothing.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxroll.replay.state import ReplayState


class RolloutPlan(NamedTuple):
  """K candidate prompts and what to do with each.

  The loop rolls out the first `limit` planned candidates (samples > 0) in
  candidate order; planned ones past the limit wait for a later step.
  Allocation transforms spend their budget on those first `limit` only.
  """

  prompt_K: jax.Array  # int32 index into the prompt pool
  samples_K: jax.Array  # int32 rollouts to draw (0: skip the prompt)
  weight_K: jax.Array  # float32 loss weight of the prompt's group (1: unweighted)
  limit: jax.Array  # int32 scalar: prompts the step can still take


def taken(plan: RolloutPlan):
  """Mask of the candidates the loop will roll out: the first `limit` planned."""
  planned_K = plan.samples_K > 0
  return planned_K & (jnp.cumsum(planned_K) <= plan.limit)


class Groups(NamedTuple):
  """What generation produced for K prompts, padded to G trajectories each."""

  prompt_K: jax.Array  # int32
  reward_KxG: jax.Array  # float32
  valid_KxG: jax.Array  # bool: the trajectory was sampled
  weight_KxG: jax.Array  # float32 loss weight (0: left out of the update)


class RolloutTransform(NamedTuple):
  init: Callable[[ReplayState], Any]
  plan: Callable[[RolloutPlan, Any, ReplayState, jax.Array], tuple[RolloutPlan, Any]]
  select: Callable[[Groups, Any, ReplayState, jax.Array], tuple[Groups, Any]]
  # Optional: after a round of generation, more rollouts per prompt
  # (extra_K int32; all zero ends the rounds). VIGOR's reallocation.
  extend: Optional[Callable[[Groups, Any, ReplayState, jax.Array], tuple[jax.Array, Any]]] = None
  # Optional: once per step, over all the groups the step keeps, the replay
  # buffer slot to put in each group's place (slot_K int32, -1: keep it).
  replace: Optional[Callable[[Groups, Any, ReplayState, jax.Array], tuple[jax.Array, Any]]] = None


class EmptyState(NamedTuple):
  """The state of a transform that keeps none."""


def keep_plan(plan, state, replay, key):
  del replay, key
  return plan, state


def keep_groups(groups, state, replay, key):
  del replay, key
  return groups, state


def identity() -> RolloutTransform:
  """Changes nothing: chain(identity(), t) behaves as t."""
  return RolloutTransform(lambda replay: EmptyState(), keep_plan, keep_groups)


def chain(*transforms: RolloutTransform) -> RolloutTransform:
  """Composes transforms; plans and selections run in the order given."""

  def init(replay):
    return tuple(t.init(replay) for t in transforms)

  def in_order(method: str):
    """Threads a plan or groups through every transform's `method`."""

    def run(x, states, replay, key):
      new = []
      for i, (t, s) in enumerate(zip(transforms, states)):
        x, s = getattr(t, method)(x, s, replay, jax.random.fold_in(key, i))
        new.append(s)
      return x, tuple(new)

    return run

  plan, select = in_order("plan"), in_order("select")

  def extend(g, states, replay, key):
    extra = jnp.zeros(g.prompt_K.shape, jnp.int32)
    new = []
    for i, (t, s) in enumerate(zip(transforms, states)):
      if t.extend is not None:
        more, s = t.extend(g, s, replay, jax.random.fold_in(key, i))
        extra = extra + more
      new.append(s)
    return extra, tuple(new)

  replacers = [i for i, t in enumerate(transforms) if t.replace is not None]
  if len(replacers) > 1:
    raise ValueError("a chain can hold at most one replay technique (two would compete for the buffer)")

  def replace(g, states, replay, key):
    i = replacers[0]
    slot_K, s = transforms[i].replace(g, states[i], replay, jax.random.fold_in(key, i))
    return slot_K, states[:i] + (s,) + states[i + 1:]

  has_extend = any(t.extend is not None for t in transforms)
  return RolloutTransform(init, plan, select, extend if has_extend else None,
                          replace if replacers else None)


def uniform_plan(prompt_K, group_size: int, limit: int | None = None) -> RolloutPlan:
  """Every candidate gets `group_size` rollouts at weight 1 (plain GRPO)."""
  prompt_K = jnp.asarray(prompt_K, jnp.int32)
  K = prompt_K.shape[0]
  return RolloutPlan(prompt_K, jnp.full(prompt_K.shape, group_size, jnp.int32),
                     jnp.ones(prompt_K.shape, jnp.float32), jnp.int32(K if limit is None else limit))


def groups_from(prompt_K, reward_KxG, valid_KxG) -> Groups:
  valid_KxG = jnp.asarray(valid_KxG, bool)
  return Groups(jnp.asarray(prompt_K, jnp.int32), jnp.asarray(reward_KxG, jnp.float32), valid_KxG,
                valid_KxG.astype(jnp.float32))
