"""A replay technique's swap (POPO): groups of the step replaced by groups
held in the replay buffer, then the step's effective fresh groups pushed.

Runs once per step over the groups the sampler keeps. The chain's
`replace` names a buffer slot per group (-1: keep it); a replayed group
comes back with the tokens, behaviour log-probs and policy versions it was
sampled with, so the off-policy loss weighs it. Fresh groups with reward
variance enter the buffer, prioritised by it; degenerate ones and those
just replaced (their rows were not trained on) do not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll.replay.protocol import Groups
from jaxroll.replay.state import group_moments, push_groups, release_slots
from jaxroll.rl.advantages import degenerate_groups_on_host
from jaxroll.types import FINISH_UNSAMPLED, Trajectories


def swap_replayed(replace, replay, tstate, kept, *, step: int, key, prompts, prompt_ids,
                  max_new_tokens: int):
  """`kept`: (dataset row, rows, reward_S, weight_S) per group. Returns
  (groups as (dataset row, rows, reward_S, weight_S, replayed), replay,
  tstate, metrics)."""
  L = max_new_tokens
  stats = dict(groups_replayed=0, replay_age_mean=0.0,
               replay_buffer_groups=int((np.asarray(replay.buffer.prompt_C) >= 0).sum()))
  if not kept:
    return [], replay, tstate, stats
  S = len(kept[0][2])
  pids = np.array([prompt_ids[index] for index, *_ in kept], np.int32)
  r_KxS = np.stack([g[2] for g in kept])
  w_KxS = np.stack([g[3] for g in kept])
  groups = Groups(jnp.asarray(pids), jnp.asarray(r_KxS), jnp.asarray(w_KxS > 0), jnp.asarray(w_KxS))
  slot_K, tstate = replace(groups, tstate, replay, key)
  slot_K = np.asarray(slot_K)
  replaced = np.flatnonzero(slot_K >= 0)
  # Only the replayed groups come to the host, not the whole buffer.
  buf = jax.device_get(jax.tree.map(lambda a: a[jnp.asarray(slot_K[replaced])], replay.buffer))
  out, ages = [(*g, False) for g in kept], []
  for c, k in enumerate(replaced):
    valid_S = buf.valid_CxG[c]
    index = int(buf.prompt_C[c])  # a prompt id is its first dataset row
    rows = Trajectories(
        prompt_index_N=np.zeros(S, np.int32), sample_index_N=np.arange(S, dtype=np.int32),
        tokens_NxL=buf.tokens_CxGxL[c], logp_NxL=buf.logp_CxGxL[c],
        position_NxL=np.broadcast_to(len(prompts[index]) + np.arange(L, dtype=np.int32), (S, L)).copy(),
        version_NxL=buf.version_CxGxL[c], length_N=np.where(valid_S, buf.length_CxG[c], 0),
        finish_N=np.where(valid_S, buf.finish_CxG[c], FINISH_UNSAMPLED).astype(np.int32))
    out[k] = (index, rows, buf.reward_CxG[c] * valid_S, valid_S.astype(np.float32), True)
    ages.append(step - int(buf.step_C[c]))
  buffer = release_slots(replay.buffer, jnp.asarray(slot_K))
  _, var_K, _ = group_moments(r_KxS, w_KxS > 0)
  informative_K = ~np.asarray(degenerate_groups_on_host(r_KxS, w_KxS > 0))
  push_K = np.where(informative_K & (slot_K < 0), pids, -1)
  field = lambda f: jnp.asarray(np.stack([getattr(g[1], f) for g in kept]))
  buffer = push_groups(buffer, jnp.asarray(push_K), jnp.asarray(var_K), step, jnp.asarray(r_KxS),
                       jnp.asarray(w_KxS > 0), field("length_N"), field("finish_N"),
                       field("tokens_NxL"), field("logp_NxL"), field("version_NxL"))
  stats.update(groups_replayed=len(ages), replay_age_mean=float(np.mean(ages)) if ages else 0.0,
               replay_buffer_groups=int((np.asarray(buffer.prompt_C) >= 0).sum()))
  return out, replay.replace(buffer=buffer), tstate, stats
