"""ReplayState: what rollout techniques learn across steps, as one pytree.

Per prompt of the training pool (Q prompts) it holds counts, the latest
group's reward mean and variance, a run of degenerate groups, the latest
response length and the step last seen; and a bounded buffer of C past
groups with the tokens, behaviour log-probs and policy versions they were
sampled with (for replay). Everything is an array, so the state is saved
with the training checkpoint and updated under `jax.jit`.

Techniques keep their own extra state (a Beta posterior, a Kalman filter)
in their transform state; this is the shared record the loop writes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxroll.rl.advantages import degenerate_groups


@struct.dataclass
class GroupBuffer:
  """C past groups of up to G trajectories of up to L tokens (prompt_C < 0: empty slot)."""

  prompt_C: jax.Array  # int32
  step_C: jax.Array  # int32 RL step the group was sampled at
  priority_C: jax.Array  # float32 (higher is replayed first)
  reward_CxG: jax.Array  # float32
  valid_CxG: jax.Array  # bool: the trajectory exists
  length_CxG: jax.Array  # int32 generated tokens
  finish_CxG: jax.Array  # int32 FINISH_* code
  tokens_CxGxL: jax.Array  # int32
  logp_CxGxL: jax.Array  # float32 behaviour log-probs
  version_CxGxL: jax.Array  # int32 policy version of each token

  @property
  def capacity(self) -> int:
    return self.prompt_C.shape[0]


@struct.dataclass
class ReplayState:
  groups_Q: jax.Array  # int32 groups sampled per prompt
  samples_Q: jax.Array  # float32 trajectories sampled per prompt
  reward_sum_Q: jax.Array  # float32 sum of their rewards
  last_mean_Q: jax.Array  # float32 mean reward of the latest group
  last_var_Q: jax.Array  # float32 reward variance (ddof 0) of the latest group
  degenerate_run_Q: jax.Array  # int32 consecutive degenerate groups, latest last
  last_length_Q: jax.Array  # float32 mean response length of the latest group
  last_step_Q: jax.Array  # int32 step of the latest group (-1: never sampled)
  step: jax.Array  # int32 scalar: the step of the latest observation (-1: none)
  buffer: GroupBuffer

  @property
  def num_prompts(self) -> int:
    return self.groups_Q.shape[0]


def init_replay(num_prompts: int, *, buffer_groups: int = 0, group_size: int = 1,
                max_new_tokens: int = 1) -> ReplayState:
  Q, C, G, L = num_prompts, buffer_groups, group_size, max_new_tokens
  zf = lambda *s: jnp.zeros(s, jnp.float32)
  zi = lambda *s: jnp.zeros(s, jnp.int32)
  buffer = GroupBuffer(prompt_C=jnp.full((C,), -1, jnp.int32), step_C=zi(C),
                       priority_C=jnp.full((C,), -jnp.inf, jnp.float32), reward_CxG=zf(C, G),
                       valid_CxG=jnp.zeros((C, G), bool), length_CxG=zi(C, G), finish_CxG=zi(C, G),
                       tokens_CxGxL=zi(C, G, L), logp_CxGxL=zf(C, G, L), version_CxGxL=zi(C, G, L))
  return ReplayState(groups_Q=zi(Q), samples_Q=zf(Q), reward_sum_Q=zf(Q), last_mean_Q=zf(Q),
                     last_var_Q=zf(Q), degenerate_run_Q=zi(Q), last_length_Q=zf(Q),
                     last_step_Q=jnp.full((Q,), -1, jnp.int32), step=jnp.int32(-1), buffer=buffer)


def group_moments(reward_KxG, valid_KxG):
  """(mean_K, var_K ddof 0, count_K) over each group's valid trajectories.

  var_K is exactly 0 for a degenerate group (`degenerate_groups`), so the
  `var_K == 0` and `var_K > 0` tests of the transforms agree with the
  advantages on which groups carry signal.
  """
  v = valid_KxG.astype(jnp.float32)
  n_K = v.sum(axis=1)
  mean_K = (reward_KxG * v).sum(axis=1) / jnp.maximum(n_K, 1.0)
  var_K = (((reward_KxG - mean_K[:, None]) ** 2) * v).sum(axis=1) / jnp.maximum(n_K, 1.0)
  var_K = jnp.where(degenerate_groups(reward_KxG, valid_KxG), 0.0, var_K)
  return mean_K, var_K, n_K


@jax.jit
def observe(replay: ReplayState, prompt_K, reward_KxG, valid_KxG, length_KxG, step) -> ReplayState:
  """Records K sampled groups (rows with no valid trajectory are ignored).

  A group is degenerate when its valid rewards are all equal (no
  group-relative signal). A prompt listed twice keeps its last group.
  """
  mean_K, var_K, n_K = group_moments(reward_KxG, valid_KxG)
  seen_K = n_K > 0
  q_K = jnp.where(seen_K, prompt_K, replay.num_prompts)  # out of range: dropped
  degenerate_K = degenerate_groups(reward_KxG, valid_KxG)
  length_K = (length_KxG * valid_KxG).sum(axis=1) / jnp.maximum(n_K, 1.0)
  add = lambda a, x: a.at[q_K].add(x, mode="drop")
  put = lambda a, x: a.at[q_K].set(x, mode="drop")
  run_K = jnp.where(degenerate_K, replay.degenerate_run_Q[prompt_K] + 1, 0)
  return replay.replace(
      groups_Q=add(replay.groups_Q, jnp.ones_like(prompt_K)),
      samples_Q=add(replay.samples_Q, n_K),
      reward_sum_Q=add(replay.reward_sum_Q, (reward_KxG * valid_KxG).sum(axis=1)),
      last_mean_Q=put(replay.last_mean_Q, mean_K), last_var_Q=put(replay.last_var_Q, var_K),
      degenerate_run_Q=put(replay.degenerate_run_Q, run_K),
      last_length_Q=put(replay.last_length_Q, length_K),
      last_step_Q=put(replay.last_step_Q, jnp.full_like(prompt_K, step)),
      step=jnp.asarray(step, jnp.int32))


@jax.jit
def push_groups(buffer: GroupBuffer, prompt_K, priority_K, step, reward_KxG, valid_KxG,
                length_KxG, finish_KxG, tokens_KxGxL, logp_KxGxL, version_KxGxL) -> GroupBuffer:
  """Adds K groups, each over the lowest-priority slot (empty slots first,
  then the oldest among equals); a group whose priority is below every held
  one is not added. prompt_K < 0 marks rows to skip."""

  def add_one(buf, k):
    slot = jnp.lexsort((buf.step_C, buf.priority_C))[0]  # lowest priority, then oldest
    take = (prompt_K[k] >= 0) & (priority_K[k] >= buf.priority_C[slot])
    idx = jnp.where(take, slot, buf.capacity)  # out of range: dropped
    put = lambda a, x: a.at[idx].set(x, mode="drop")
    return buf.replace(
        prompt_C=put(buf.prompt_C, prompt_K[k]), step_C=put(buf.step_C, step),
        priority_C=put(buf.priority_C, priority_K[k]), reward_CxG=put(buf.reward_CxG, reward_KxG[k]),
        valid_CxG=put(buf.valid_CxG, valid_KxG[k]), length_CxG=put(buf.length_CxG, length_KxG[k]),
        finish_CxG=put(buf.finish_CxG, finish_KxG[k]),
        tokens_CxGxL=put(buf.tokens_CxGxL, tokens_KxGxL[k]), logp_CxGxL=put(buf.logp_CxGxL, logp_KxGxL[k]),
        version_CxGxL=put(buf.version_CxGxL, version_KxGxL[k])), None

  if buffer.capacity == 0:
    return buffer
  buffer, _ = jax.lax.scan(add_one, buffer, jnp.arange(prompt_K.shape[0]))
  return buffer


@jax.jit
def release_slots(buffer: GroupBuffer, slot_K) -> GroupBuffer:
  """Empties the slots a replay consumed (slot_K < 0: none), so no group is
  replayed twice."""
  idx = jnp.where(slot_K >= 0, slot_K, buffer.capacity)  # out of range: dropped
  return buffer.replace(prompt_C=buffer.prompt_C.at[idx].set(-1, mode="drop"),
                        priority_C=buffer.priority_C.at[idx].set(-jnp.inf, mode="drop"))
