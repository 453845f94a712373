"""One RL step's rollout under a chain of rollout transforms (`algorithm.techniques`).

Per step, until the update has prompts_per_step groups or `fill_rounds`
planning rounds are used:
  1. draw K candidate prompts and let the chain plan them (skip some, set
     how many rollouts each gets);
  2. generate the planned rollouts and score them; while the chain's
     `extend` asks for more rollouts (VIGOR's rounds), generate those too;
  3. let the chain select (weights per trajectory), record every generated
     group in the replay state, and keep the groups with any weight left.
Planned prompts beyond what the step needs go back to the front of the
queue; skipped candidates are counted (a filter's decision, not a loss).
With a replay technique (popo), the chain's `replace` then swaps groups of
the step for groups held in the replay buffer, and the step's effective
fresh groups enter the buffer.

The update batch holds P groups of S rows each (static shapes; S =
registry.rows_per_group); rows that were not sampled or were selected out
have weight 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll.replay import registry
from jaxroll.replay.protocol import Groups, uniform_plan
from jaxroll.replay.state import group_moments, init_replay, observe, push_groups, release_slots
from jaxroll.rl.advantages import degenerate_groups
from jaxroll.scheduling.admission import FixedOrder
from jaxroll.scheduling.group_pool import empty_rows, split_rows, stack_rows
from jaxroll.scheduling.step_rollout import row_key_data
from jaxroll.types import FINISH_RUNNING, Trajectories


@dataclasses.dataclass
class PlannedStep:
  indices: list[int]  # dataset rows of the P (or fewer) groups for the update
  traj: Trajectories  # their rows, S per group (row n: group n // S)
  reward_N: np.ndarray  # float32, 0 where not sampled
  weight_N: np.ndarray  # float32 loss weight, 0 where not sampled or selected out
  replayed_N: np.ndarray  # bool: the row comes from the replay buffer, not this step
  reward_errors: int
  reward_timeouts: int
  metrics: dict[str, Any]


class PlannedRollout:
  """Owns the replay state, the chain's state and the prompt queue.

  Args:
    cfg: the experiment config.
    engine: the RolloutEngine.
    prompts: token ids of every training prompt.
    prompt_ids: a stable id per dataset row (equal texts share one): the
      replay state is indexed by it.
    score: (rows of token ids, dataset indices) -> RewardReport.
    batches: the IndexBatches stream.
    key: the run's PRNG key.
  """

  def __init__(self, cfg, engine, prompts, prompt_ids, score, batches, key):
    if jax.process_count() > 1:
      raise ValueError("algorithm.techniques run in a single process for now")
    self.cfg, self.engine, self.prompts, self.prompt_ids = cfg, engine, prompts, prompt_ids
    self.score, self.batches, self.key = score, batches, key
    self.P, self.G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    self.S = registry.rows_per_group(cfg)
    self.K = math.ceil(cfg.algorithm.candidates * self.P)
    self.transform = registry.build(cfg)
    self.refill = registry.refills_after_select(cfg)
    self.samples = self.S if registry.draws_max_samples(cfg) else self.G
    self.replay = init_replay(len(prompts), buffer_groups=registry.buffer_groups(cfg),
                              group_size=self.S, max_new_tokens=cfg.rollout.max_new_tokens)
    self.tstate = self.transform.init(self.replay)
    self.queue: list[int] = []
    self._plan = jax.jit(self.transform.plan)
    self._select = jax.jit(self.transform.select)
    self._extend = jax.jit(self.transform.extend) if self.transform.extend else None
    self._replace = jax.jit(self.transform.replace) if self.transform.replace else None

  def _draw(self, n: int) -> list[int]:
    while len(self.queue) < n:
      self.queue.extend(next(self.batches).tolist())
    out, self.queue = self.queue[:n], self.queue[n:]
    return out

  def _generate(self, dparams, indices, rows, carried, key_data):
    """Decodes `rows` (n = group * S + sample) of the groups of `indices`."""
    traj = self.engine.rollout(dparams, [self.prompts[i] for i in indices], group_size=self.S,
                               row_keys=jax.random.wrap_key_data(jnp.asarray(key_data)),
                               carried=carried, admission=FixedOrder(rows))
    return traj, self.engine.last_stats.tokens_generated

  def run(self, dparams, step: int) -> PlannedStep:
    S = self.S
    # (dataset row, its S rows, rewards_S, loss weights_S, replayed from the buffer)
    kept_groups: list[tuple[int, Trajectories, np.ndarray, np.ndarray, bool]] = []
    m = dict(prompts_considered=0, prompts_skipped=0, rollouts_generated=0, tokens_generated=0,
             groups_generated=0, groups_selected_out=0, trajectories_selected_out=0, plan_rounds=0,
             reward_errors=0, reward_timeouts=0, degenerate_generated=0)
    for rnd in range(self.cfg.algorithm.fill_rounds):
      need = self.P - len(kept_groups)
      if need <= 0:
        break
      m["plan_rounds"] += 1
      key = jax.random.fold_in(jax.random.fold_in(self.key, step), 1 + rnd)
      cand = self._draw(self.K)
      plan = uniform_plan(np.array([self.prompt_ids[i] for i in cand]), self.samples, limit=need)
      plan, self.tstate = self._plan(plan, self.tstate, self.replay, jax.random.fold_in(key, 0))
      samples_K = np.asarray(plan.samples_K)
      planned = [k for k in range(self.K) if samples_K[k] > 0]
      m["prompts_considered"] += self.K
      m["prompts_skipped"] += self.K - len(planned)
      take, spare = planned[:need], planned[need:]
      # Planned but not needed now: back to the front of the queue, unused.
      back = [cand[k] for k in spare]
      indices = []
      for k in take:
        q = int(plan.prompt_K[k])
        if q == self.prompt_ids[cand[k]]:
          indices.append(cand[k])
        else:  # the plan replaced this candidate (VCRL's replay): it waits for a later step
          indices.append(q)
          back.append(cand[k])
      self.queue = back + self.queue
      if take:
        kept_groups.extend(self._round(dparams, step, rnd, indices, samples_K[take],
                                       np.asarray(plan.weight_K)[take], key, m))
    if self._replace is not None:
      kept_groups = self._replay(step, kept_groups, m)
    # A round plans at most the groups still needed, so there are at most P.
    pad = self.P - len(kept_groups)
    m["groups_used"], m["groups_short"] = len(kept_groups), pad
    L = self.cfg.rollout.max_new_tokens
    traj = stack_rows([g[1] for g in kept_groups] + [empty_rows(S, L) for _ in range(pad)], S)
    zeros = [np.zeros(S, np.float32)] * pad
    reward_N = np.concatenate([g[2] for g in kept_groups] + zeros)
    weight_N = np.concatenate([g[3] for g in kept_groups] + zeros)
    replayed_N = np.repeat([g[4] for g in kept_groups] + [False] * pad, S)
    m["loss_weight_mean"] = float(weight_N[weight_N > 0].mean()) if (weight_N > 0).any() else 0.0
    errors, timeouts = m.pop("reward_errors"), m.pop("reward_timeouts")
    # Empty groups take any prompt: their rows have no tokens and weight 0.
    indices = [g[0] for g in kept_groups] + [kept_groups[0][0] if kept_groups else 0] * pad
    return PlannedStep(indices, traj, reward_N, weight_N, replayed_N, errors, timeouts, m)

  def _round(self, dparams, step, rnd, indices, samples_K, weight_K, key, m):
    """Generates, extends, selects and records one round's groups."""
    S, Kt = self.S, len(indices)
    rows = np.arange((rnd * self.K) * S, (rnd * self.K + Kt) * S)
    key_data = np.asarray(row_key_data(self.key, step, rows))
    want = [k * S + g for k in range(Kt) for g in range(int(samples_K[k]))]
    traj, tokens = self._generate(dparams, indices, want, None, key_data)
    reward_N = np.zeros(Kt * S, np.float32)
    valid_N = np.zeros(Kt * S, bool)
    self._score(traj, indices, want, reward_N, valid_N, m)
    m["tokens_generated"] += tokens
    pids = jnp.asarray([self.prompt_ids[i] for i in indices], jnp.int32)
    # A plan's prompt weight (e.g. an importance weight) starts each row's loss weight.
    prompt_w_KxS = np.broadcast_to(np.asarray(weight_K, np.float32)[:, None], (Kt, S))
    groups = Groups(pids, jnp.asarray(reward_N.reshape(Kt, S)), jnp.asarray(valid_N.reshape(Kt, S)),
                    jnp.asarray(valid_N.reshape(Kt, S) * prompt_w_KxS))
    ext = 1
    while self._extend is not None:
      extra_K, self.tstate = self._extend(groups, self.tstate, self.replay, jax.random.fold_in(key, ext))
      extra_K = np.asarray(extra_K)
      have_K = valid_N.reshape(Kt, S).sum(axis=1)
      more = [k * S + int(have_K[k]) + j for k in range(Kt) for j in range(int(extra_K[k]))
              if int(have_K[k]) + j < S]
      if not more:
        break
      traj, tokens = self._generate(dparams, indices, more, traj, key_data)
      self._score(traj, indices, more, reward_N, valid_N, m)
      m["tokens_generated"] += tokens
      groups = groups._replace(reward_KxG=jnp.asarray(reward_N.reshape(Kt, S)),
                               valid_KxG=jnp.asarray(valid_N.reshape(Kt, S)),
                               weight_KxG=jnp.asarray(valid_N.reshape(Kt, S) * prompt_w_KxS))
      ext += 1
    selected, self.tstate = self._select(groups, self.tstate, self.replay, jax.random.fold_in(key, 10**6))
    r_KxS, v_KxS = reward_N.reshape(Kt, S), valid_N.reshape(Kt, S)
    self.replay = observe(self.replay, pids, groups.reward_KxG, groups.valid_KxG,
                          jnp.asarray(traj.length_N.reshape(Kt, S)), step)
    weight_KxS = np.asarray(selected.weight_KxG) * v_KxS
    degenerate_K = np.asarray(degenerate_groups(r_KxS, v_KxS))
    kept_K = weight_KxS.sum(axis=1) > 0
    m["groups_generated"] += Kt
    m["degenerate_generated"] += int(degenerate_K.sum())
    m["groups_selected_out"] += int((~kept_K).sum())
    m["trajectories_selected_out"] += int((v_KxS & (weight_KxS == 0)).sum())
    parts = split_rows(traj, S)
    # With DAPO's refill a group selected out makes room for another; else it
    # stays in the batch with weight 0 (the update shows what was dropped).
    return [(indices[k], parts[k], r_KxS[k], weight_KxS[k].astype(np.float32), False)
            for k in range(Kt) if kept_K[k] or not self.refill]

  def _replay(self, step, kept_groups, m):
    """Swaps groups for buffer groups (the chain's `replace`), then adds the
    step's effective fresh groups to the buffer (priority: reward variance)."""
    S, L = self.S, self.cfg.rollout.max_new_tokens
    m.update(groups_replayed=0, replay_age_mean=0.0,
             replay_buffer_groups=int((np.asarray(self.replay.buffer.prompt_C) >= 0).sum()))
    if not kept_groups:
      return kept_groups
    pids = np.array([self.prompt_ids[g[0]] for g in kept_groups], np.int32)
    r_KxS = np.stack([g[2] for g in kept_groups])
    w_KxS = np.stack([g[3] for g in kept_groups])
    groups = Groups(jnp.asarray(pids), jnp.asarray(r_KxS), jnp.asarray(w_KxS > 0), jnp.asarray(w_KxS))
    key = jax.random.fold_in(jax.random.fold_in(self.key, step), 2**30)
    slot_K, self.tstate = self._replace(groups, self.tstate, self.replay, key)
    slot_K = np.asarray(slot_K)
    replaced = np.flatnonzero(slot_K >= 0)
    # Only the replayed groups come to the host, not the whole buffer.
    buf = jax.device_get(jax.tree.map(lambda a: a[jnp.asarray(slot_K[replaced])], self.replay.buffer))
    out, ages = list(kept_groups), []
    for c, k in enumerate(replaced):
      valid_S = buf.valid_CxG[c]
      index = int(buf.prompt_C[c])  # a prompt id is its first dataset row
      rows = Trajectories(
          prompt_index_N=np.zeros(S, np.int32), sample_index_N=np.arange(S, dtype=np.int32),
          tokens_NxL=buf.tokens_CxGxL[c], logp_NxL=buf.logp_CxGxL[c],
          position_NxL=np.broadcast_to(len(self.prompts[index]) + np.arange(L, dtype=np.int32),
                                       (S, L)).copy(),
          version_NxL=buf.version_CxGxL[c], length_N=np.where(valid_S, buf.length_CxG[c], 0),
          finish_N=np.where(valid_S, buf.finish_CxG[c], FINISH_RUNNING).astype(np.int32))
      out[k] = (index, rows, buf.reward_CxG[c] * valid_S, valid_S.astype(np.float32), True)
      ages.append(step - int(buf.step_C[c]))
    buffer = release_slots(self.replay.buffer, jnp.asarray(slot_K))
    # Fresh groups with reward variance enter the buffer; degenerate ones and
    # the groups just replaced (whose rows were not trained on) do not.
    _, var_K, _ = group_moments(r_KxS, w_KxS > 0)
    informative_K = ~np.asarray(degenerate_groups(r_KxS, w_KxS > 0))
    push_K = np.where(informative_K & (slot_K < 0), pids, -1)
    parts = [g[1] for g in kept_groups]
    field = lambda f: jnp.asarray(np.stack([getattr(t, f) for t in parts]))
    buffer = push_groups(buffer, jnp.asarray(push_K), jnp.asarray(var_K), step, jnp.asarray(r_KxS),
                         jnp.asarray(w_KxS > 0), field("length_N"), field("finish_N"),
                         field("tokens_NxL"), field("logp_NxL"), field("version_NxL"))
    self.replay = self.replay.replace(buffer=buffer)
    m["groups_replayed"] = len(ages)
    m["replay_age_mean"] = float(np.mean(ages)) if ages else 0.0
    m["replay_buffer_groups"] = int((np.asarray(buffer.prompt_C) >= 0).sum())
    return out

  def _score(self, traj, indices, rows, reward_N, valid_N, m):
    S = self.S
    report = self.score([traj.row(n) for n in rows], [indices[n // S] for n in rows])
    reward_N[rows] = np.asarray(report.rewards, np.float32)
    valid_N[rows] = True
    m["rollouts_generated"] += len(rows)
    m["reward_errors"] += report.num_errors
    m["reward_timeouts"] += report.num_timeouts

  # -- checkpointing -------------------------------------------------------------

  def arrays(self):
    """The replay and chain states: a pytree the checkpoint saves."""
    return {"replay": self.replay, "transform": self.tstate}

  def load_arrays(self, tree) -> None:
    self.replay, self.tstate = tree["replay"], tree["transform"]

  def state_dict(self) -> dict[str, Any]:
    return {"queue": list(self.queue)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.queue = list(state["queue"])

