"""One RL step's rollout: the long-tail schedule and the algorithm's transforms in one loop.

Per step, until the update has P groups:
  1. hand over the complete groups in the pool, earliest completed first:
     score them, let the chain extend them (VIGOR's extra rounds, decoded
     at once), select (weights per trajectory), record them in the replay
     state, and keep those with weight left (with DAPO's refill a group
     selected out makes room for another);
  2. otherwise, if a launch round is left (`algorithm.fill_rounds`; one
     without techniques): draw K candidates, let the chain plan them (skip
     some, set how many rollouts each gets and its weight) and launch the
     first ones until ceil(over_provision * groups still needed) are in
     flight; planned candidates not launched go back to the queue front;
  3. decode every unfinished row in the admission order (FIFO, or longest
     predicted first by history or sibling probe) under the step's token
     budget, stopping once enough groups are complete when more are in
     flight, and after restarting rows older than `max_age` versions.
Unfinished groups, and complete ones not needed yet, stay in the pool for
the next step (partial rollout). With a replay technique (popo), the
chain's `replace` then swaps kept groups for groups of the replay buffer.

Without techniques and with the default schedule this is plain
synchronous GRPO: P groups launched per step, all finished in it.

Row keys are fixed at launch: row g of the j-th group launched at step s
samples with fold_in(fold_in(key, s), j * S + g), so a carried row
continues its own random stream. Their sampling seeds are drawn at launch,
for a fixed number of rows, and handed to the engine as they are.

Shapes are static in steady state, so nothing compiles after the first
steps however many groups a filter, a refill or over-provisioning leaves:
`select`, `extend` and `observe` always see P group slots (empty slots
have no valid row and prompt id Q, which every update of the replay state
drops), `plan` K candidates, and the seeds are drawn for the most rows a
launch can start.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll import distributed
from jaxroll.config import ConfigError
from jaxroll.replay import registry
from jaxroll.replay.protocol import Groups, uniform_plan
from jaxroll.loop.replay_swap import swap_replayed
from jaxroll.loop.shared_state import MULTI_PROCESS_TECHNIQUES, SharedStates, key_data
from jaxroll.replay.state import init_replay, observe
from jaxroll.rl.advantages import degenerate_groups_on_host
from jaxroll.rollout.sampling import SEED_COMPILE_OPTIONS, folded_row_seeds
from jaxroll.rl.truncation import budget_at, parse_budgets
from jaxroll.scheduling.admission import FixedOrder, SiblingProbe, longest_first
from jaxroll.scheduling.group_pool import GroupPool, empty_rows, stack_rows
from jaxroll.scheduling.length_predictor import HistoryLengthPredictor, prediction_error
from jaxroll.types import FINISH_RUNNING, FINISH_UNSAMPLED, SAMPLED, Trajectories


@functools.partial(jax.jit, static_argnums=3, compiler_options=SEED_COMPILE_OPTIONS)
def launch_seeds(key, step, first_row, num_rows: int):
  """Sampling seeds of rows first_row .. first_row + num_rows - 1 of step
  `step`: row n samples with fold_in(fold_in(key, step), n)."""
  step_key = jax.random.fold_in(key, step)
  rows = first_row + jnp.arange(num_rows)
  return folded_row_seeds(step_key, rows)


@dataclasses.dataclass
class SampledBatch:
  """What the sampler hands the learner: P groups of S rows, scored."""

  indices: list[int]  # dataset row of each group
  traj: Trajectories  # row n belongs to group n // S
  group_size: int  # S
  reward_N: np.ndarray  # float32, 0 where not sampled
  weight_N: np.ndarray  # float32 loss weight, 0 where not sampled or selected out
  replayed_N: np.ndarray  # bool: the row comes from the replay buffer, not this step
  reward_errors: int
  reward_timeouts: int
  metrics: dict[str, Any]  # this process's rollout metrics
  rollout_s: float  # seconds producing the batch, scoring excluded
  reward_s: float  # seconds scoring
  version: int  # the policy version of the weights the rollout started with
  # Several processes with techniques: the batch's writes to the replicated
  # replay and transform states, for the learner step to replay.
  state_log: list = dataclasses.field(default_factory=list)

  @property
  def sampled_N(self) -> np.ndarray:
    return np.isin(self.traj.finish_N, SAMPLED)


@dataclasses.dataclass
class _Kept:
  index: int
  rows: Trajectories
  reward_S: np.ndarray
  weight_S: np.ndarray
  replayed: bool = False


class Sampler:
  """Owns the groups in flight, the prompt queue, the length predictor, and
  the replay and transform states.

  Args:
    cfg: the experiment config.
    engine: the RolloutEngine.
    prompts: token ids of every training prompt (dataset order).
    prompt_ids: a stable id per dataset row (rows with equal text share one):
      the replay state and the length history are indexed by it.
    score: (rows of token ids, dataset indices) -> RewardReport.
    batches: the IndexBatches stream of dataset rows.
    key: the run's PRNG key.
  """

  def __init__(self, cfg, engine, prompts, prompt_ids, score: Callable, batches, key):
    self.cfg, self.sch = cfg, cfg.schedule
    self.engine, self.prompts, self.prompt_ids = engine, prompts, prompt_ids
    self.score, self.batches, self.key = score, batches, key
    self.multi = jax.process_count() > 1
    self.techniques = bool(registry.technique_names(cfg))
    if self.multi and self.techniques:
      others = sorted(registry.base_names(cfg) - set(MULTI_PROCESS_TECHNIQUES))
      if others:
        raise ConfigError(f"algorithm.techniques={','.join(others)} runs in a single process only "
                          f"(across processes: {', '.join(MULTI_PROCESS_TECHNIQUES)}); run it without "
                          "jax.distributed, or choose among those")
    rows = distributed.process_rows(cfg.rollout.prompts_per_step, "rollout.prompts_per_step")
    self.P, self.first_group = rows.stop - rows.start, rows.start
    self.S = registry.rows_per_group(cfg)
    self.samples = self.S if registry.draws_max_samples(cfg) else cfg.rollout.group_size
    self.pool = GroupPool(self.S, cfg.rollout.max_new_tokens)
    self.predictor = HistoryLengthPredictor(self.sch.history_window)
    self.stages = parse_budgets(self.sch.budgets, cfg.rollout.max_new_tokens)
    self.queue: list[int] = []  # drawn dataset rows not launched yet
    if self.techniques:
      self.K = math.ceil(cfg.algorithm.candidates * self.P)
      self.fill_rounds = cfg.algorithm.fill_rounds
      self.refill = registry.refills_after_select(cfg)
      self.transform = registry.build(cfg)
      self.replay = init_replay(len(prompts), buffer_groups=registry.buffer_groups(cfg),
                                group_size=self.S, max_new_tokens=cfg.rollout.max_new_tokens)
      self.tstate = self.transform.init(self.replay)
      # Across processes the states are replicated (jaxroll.loop.shared_state):
      # a batch works on the copy published with its weights and logs its writes.
      self.shared = (SharedStates(self.transform, self.replay, self.tstate, version=0,
                                  keep=cfg.pipeline.max_lag + 2) if self.multi else None)
      self.state_log: list[tuple[str, tuple]] = []
      self._plan = jax.jit(self.transform.plan)
      self._select = jax.jit(self.transform.select)
      self._extend = jax.jit(self.transform.extend) if self.transform.extend else None
      self._replace = jax.jit(self.transform.replace) if self.transform.replace else None
    else:
      self.fill_rounds, self.refill, self.shared = 1, False, None

  def _record(self, name: str, *arrays) -> None:
    """Logs a call that wrote the replay or transform state (several processes only)."""
    if self.shared is not None:
      self.state_log.append((name, tuple(np.asarray(a) for a in arrays)))

  def _key(self, *path: int):
    """The key of a technique call: one stream per process when there are several."""
    key = self.key
    for x in path:
      key = jax.random.fold_in(key, x)
    return jax.random.fold_in(key, jax.process_index()) if self.multi else key

  # -- prompts -----------------------------------------------------------------

  def _next_rows(self) -> list[int]:
    """The stream's next batch, or with several processes this process's
    slice of it: every process reads the same global batches, each at its
    own pace, and the slices are disjoint."""
    batch = next(self.batches)
    return (batch[self.first_group:self.first_group + self.P] if self.multi else batch).tolist()

  def _draw(self, n: int) -> list[int]:
    """The next n dataset rows."""
    K = self.sch.sorted_batches
    if not K:
      while len(self.queue) < n:
        self.queue.extend(self._next_rows())
      out, self.queue = self.queue[:n], self.queue[n:]
      return out
    # SortedRL: serve the shortest predicted prompts of a K-batch look-ahead;
    # leftovers go first once the buffer runs low, so none waits forever.
    out = []
    if len(self.queue) < n:
      out, self.queue = self.queue, []
      for _ in range(K):
        self.queue.extend(self._next_rows())
    want = n - len(out)
    predicted = self.predictor.predict([self.prompt_ids[i] for i in self.queue])
    pick = sorted(np.argsort(predicted, kind="stable")[:want].tolist())
    out += [self.queue[i] for i in pick]
    chosen = set(pick)
    self.queue = [x for i, x in enumerate(self.queue) if i not in chosen]
    return out

  def _launch(self, step: int, need: int, launched: int, rnd: int, m: dict) -> int:
    """Launches up to `need` groups (the chain plans them); returns how many."""
    if need <= 0:
      return 0
    if not self.techniques:
      picks = [(i, self.samples, 1.0) for i in self._draw(need)]
    else:
      cand = self._draw(self.K)
      key = self._key(step, 1 + rnd)
      plan = uniform_plan(np.array([self.prompt_ids[i] for i in cand]), self.samples, limit=need)
      self._record("plan", *plan, key_data(key))
      plan, self.tstate = self._plan(plan, self.tstate, self.replay, key)
      samples_K, weight_K, prompt_K = (np.asarray(x) for x in (plan.samples_K, plan.weight_K,
                                                              plan.prompt_K))
      planned = [k for k in range(self.K) if samples_K[k] > 0]
      m["prompts_considered"] += self.K
      m["prompts_skipped"] += self.K - len(planned)
      picks, back = [], [cand[k] for k in planned[need:]]  # planned, not needed now: unused
      for k in planned[:need]:
        q = int(prompt_K[k])
        if q == self.prompt_ids[cand[k]]:
          picks.append((cand[k], int(samples_K[k]), float(weight_K[k])))
        else:  # the plan replaced this candidate (VCRL's replay): it waits for a later step
          picks.append((q, int(samples_K[k]), float(weight_K[k])))
          back.append(cand[k])
      self.queue = back + self.queue
    # Seeds for the most groups a launch can start, so one shape compiles;
    # with several processes each draws from its own range of group slots
    # (a step launches at most ceil(over_provision) * P groups per process).
    most = math.ceil(self.sch.over_provision * self.P)
    offset = self.first_group * math.ceil(self.sch.over_provision) + launched
    seeds = np.asarray(launch_seeds(self.key, step, offset * self.S, most * self.S))
    for j, (index, samples, weight) in enumerate(picks):
      self.pool.launch(index, step, seeds[j * self.S:(j + 1) * self.S], samples, weight)
    m["rows_planned"] += sum(p[1] for p in picks)
    return len(picks)

  # -- decoding ----------------------------------------------------------------

  def _admission(self, rows: list[int], row_prompt_ids: list[int], length_N: np.ndarray):
    if self.sch.order == "fifo":
      return FixedOrder(rows)
    predicted = self.predictor.predict(row_prompt_ids)
    if self.sch.predictor == "sibling_probe":
      return SiblingProbe(rows, [n // self.S for n in rows], predicted)
    # Longest predicted remaining work first; rows carried from earlier
    # steps ahead of new ones (Kimi k1.5 resumes them first), which keeps
    # their tokens' age down and prefills them again in one batch.
    carried = length_N[rows] > 0
    return longest_first(rows, np.maximum(predicted - length_N[rows], 1.0) + carried * 1e9)

  def _predictions(self, admission, rows, row_prompt_ids) -> np.ndarray:
    """What the configured predictor said of each row (NaN: it had nothing)."""
    if isinstance(admission, SiblingProbe):
      return admission.probe_predictions(rows)
    known = self.predictor.known(row_prompt_ids)
    return np.where(known, self.predictor.predict(row_prompt_ids), np.nan)

  def _pids(self, rows) -> list[int]:
    return [self.prompt_ids[self.pool.groups[n // self.S].index] for n in rows]

  def _decode(self, dparams, step: int, stop_after: int, feed, d: dict) -> np.ndarray:
    """Decodes the pool's unfinished rows; returns each row's finish step."""
    before = self.pool.rows()
    seeds = np.concatenate([g.seeds_Gx2 for g in self.pool.groups])
    rows = [n for n in range(len(before.length_N)) if before.finish_N[n] == FINISH_RUNNING]
    row_pids = self._pids(rows)
    admission = self._admission(rows, row_pids, before.length_N)
    prompts = [self.prompts[g.index] for g in self.pool.groups]
    call = dict(group_size=self.S, row_seeds=seeds, max_new_tokens=budget_at(self.stages, step),
                stop_after_groups=stop_after if len(self.pool) > stop_after else None)
    if feed is not None:
      call.update(interrupt=feed.changed, interrupt_every=self.cfg.pipeline.interrupt_every)
    traj = self.engine.rollout(dparams, prompts, carried=before, admission=admission, **call)
    stats = self.engine.last_stats
    decode_steps, tokens = stats.decode_steps, stats.tokens_generated
    self._count_forwards(d, stats)
    finish_step_N = stats.finish_step_N.copy()
    while stats.interrupted and feed is not None:
      # Newer weights: the unfinished rows continue under them.
      d["rollout_interrupts"] += 1
      left = [n for n in rows if traj.finish_N[n] == FINISH_RUNNING]
      d["params"] = feed.take()
      traj = self.engine.rollout(d["params"], prompts, carried=traj,
                                 admission=self._admission(left, self._pids(left), traj.length_N), **call)
      stats = self.engine.last_stats
      self._count_forwards(d, stats)
      done = stats.finish_step_N >= 0
      finish_step_N[done] = decode_steps + stats.finish_step_N[done]
      decode_steps += stats.decode_steps
      tokens += stats.tokens_generated
    # What the predictor said of the rows that finished in this call.
    predicted = self._predictions(admission, rows, row_pids)
    finished = traj.finish_N[rows] != FINISH_RUNNING
    scored = finished & ~np.isnan(predicted)
    d["predicted"].append(predicted[scored])
    d["actual"].append(traj.length_N[rows][scored])
    self.predictor.observe(np.asarray(row_pids)[finished], traj.length_N[rows][finished])
    self.pool.set_rows(traj)
    d["decode_steps"] += decode_steps
    d["tokens"] += tokens
    d["rows_finished"] += int(finished.sum())
    return finish_step_N

  @staticmethod
  def _count_forwards(d, stats) -> None:
    # Row forward passes differ from tokens only under speculative decoding.
    d["row_forwards"] += stats.row_forwards or stats.tokens_generated
    d["drafted"] += stats.drafted
    d["accepted"] += stats.accepted
    d["kv_peak_bytes"] = max(d["kv_peak_bytes"], stats.kv_peak_bytes)
    d["kv_preemptions"] += stats.preemptions

  def _extend_rows(self, dparams, step, groups, reward_KxS, sampled_KxS, key, m) -> None:
    """VIGOR's rounds: more rows for the groups the chain asks, decoded at once."""
    S, K = self.S, len(groups)
    prompts = [self.prompts[g.index] for g in groups]
    seeds = np.concatenate([g.seeds_Gx2 for g in groups])
    ext = 1
    while True:
      g = self._groups(groups, reward_KxS, sampled_KxS)
      self._record("extend", *g, key_data(jax.random.fold_in(key, ext)))
      extra_K, self.tstate = self._extend(g, self.tstate, self.replay, jax.random.fold_in(key, ext))
      extra_K = np.asarray(extra_K)[:K]
      traj = stack_rows([g.rows for g in groups], S)
      have_K = sampled_KxS.sum(axis=1)
      more = [k * S + int(have_K[k]) + j for k in range(K) for j in range(int(extra_K[k]))
              if int(have_K[k]) + j < S]
      if not more:
        return
      traj.finish_N[more] = FINISH_RUNNING
      traj = self.engine.rollout(dparams, prompts, group_size=S, row_seeds=seeds, carried=traj,
                                 max_new_tokens=budget_at(self.stages, step), admission=FixedOrder(more))
      m["tokens_extended"] += self.engine.last_stats.tokens_generated
      m["rows_extended"] += len(more)
      m["rows_planned"] += len(more)
      for k, g in enumerate(groups):
        sl = slice(k * S, (k + 1) * S)
        for f in ("tokens_NxL", "logp_NxL", "position_NxL", "version_NxL", "length_N", "finish_N"):
          setattr(g.rows, f, getattr(traj, f)[sl].copy())
      self._score_rows(groups, more, reward_KxS, sampled_KxS, m)
      ext += 1

  # -- handing groups over -------------------------------------------------------

  def _groups(self, groups, reward_KxS, sampled_KxS) -> Groups:
    """The transforms' view of `groups`, padded to P slots (one compilation)."""
    K, pad = len(groups), self.P - len(groups)
    pids = [self.prompt_ids[g.index] for g in groups] + [len(self.prompts)] * pad
    zeros = np.zeros((pad, self.S), np.float32)
    reward = np.concatenate([reward_KxS, zeros])
    valid = np.concatenate([sampled_KxS, zeros.astype(bool)])
    weight = np.concatenate([sampled_KxS * np.array([g.weight for g in groups], np.float32)[:, None],
                             zeros]) if K else zeros
    return Groups(jnp.asarray(pids, jnp.int32), jnp.asarray(reward), jnp.asarray(valid),
                  jnp.asarray(weight, jnp.float32))

  def _score_rows(self, groups, rows, reward_KxS, sampled_KxS, m) -> None:
    """Scores rows `rows` (n = group * S + sample) of `groups`, in place."""
    S = self.S
    t0 = time.perf_counter()
    report = self.score([groups[n // S].rows.row(n % S) for n in rows], [groups[n // S].index for n in rows])
    m["reward_s"] += time.perf_counter() - t0
    reward_KxS.reshape(-1)[rows] = np.asarray(report.rewards, np.float32)
    sampled_KxS.reshape(-1)[rows] = True
    m["reward_errors"] += report.num_errors
    m["reward_timeouts"] += report.num_timeouts

  def _hand_over(self, dparams, step: int, groups, m) -> list[_Kept]:
    """Scores, extends, selects and records complete groups; returns those kept."""
    S, K = self.S, len(groups)
    reward_KxS = np.zeros((K, S), np.float32)
    sampled_KxS = np.zeros((K, S), bool)
    rows = [k * S + s for k, g in enumerate(groups) for s in range(S) if g.rows.finish_N[s] in SAMPLED]
    self._score_rows(groups, rows, reward_KxS, sampled_KxS, m)
    if not self.techniques:
      return [_Kept(g.index, g.rows, reward_KxS[k], sampled_KxS[k].astype(np.float32))
              for k, g in enumerate(groups)]
    key = self._key(step, 2**20 + m["hand_overs"])
    m["hand_overs"] += 1
    if self._extend is not None:
      self._extend_rows(dparams, step, groups, reward_KxS, sampled_KxS, key, m)
    g = self._groups(groups, reward_KxS, sampled_KxS)
    self._record("select", *g, key_data(jax.random.fold_in(key, 0)))
    selected, self.tstate = self._select(g, self.tstate, self.replay, jax.random.fold_in(key, 0))
    length = np.zeros((self.P, S), np.int32)
    length[:K] = np.stack([x.rows.length_N for x in groups])
    self._record("observe", g.prompt_K, g.reward_KxG, g.valid_KxG, length, np.int32(step))
    self.replay = observe(self.replay, g.prompt_K, g.reward_KxG, g.valid_KxG, jnp.asarray(length), step)
    weight_KxS = np.asarray(selected.weight_KxG)[:K] * sampled_KxS
    kept_K = weight_KxS.sum(axis=1) > 0
    m["groups_generated"] += K
    m["degenerate_generated"] += int(np.asarray(degenerate_groups_on_host(g.reward_KxG, g.valid_KxG))[:K].sum())
    m["groups_selected_out"] += int((~kept_K).sum())
    m["trajectories_selected_out"] += int((sampled_KxS & (weight_KxS == 0)).sum())
    # With DAPO's refill a group selected out makes room for another; else it
    # stays in the batch with weight 0 (the update shows what was dropped).
    return [_Kept(x.index, x.rows, reward_KxS[k], weight_KxS[k].astype(np.float32))
            for k, x in enumerate(groups) if kept_K[k] or not self.refill]

  # -- the step ------------------------------------------------------------------

  def run(self, dparams, step: int, feed=None) -> SampledBatch:
    """Rolls out step `step` with weights of policy version `step` (or, from
    the rollout thread, the newest published version).

    feed: with the pipeline's interrupt mode, an object whose `changed()`
      says newer weights were published and whose `take()` returns them;
      decoding stops when they appear and the unfinished rows resume under
      them (each token keeps the version that sampled it).
    """
    t_start = time.perf_counter()
    version = int(dparams.version)
    if self.shared is not None:
      self.replay, self.tstate = self.shared.base(version)
      self.state_log = []
    m = dict(reward_s=0.0, reward_errors=0, reward_timeouts=0, hand_overs=0, tokens_extended=0,
             rows_extended=0, rows_planned=0, groups_handed_over=0, prompts_considered=0,
             prompts_skipped=0, groups_generated=0, groups_selected_out=0,
             trajectories_selected_out=0, degenerate_generated=0)
    # d["params"]: the newest weights so far (an interrupt may switch them
    # mid-step; later rounds continue with them, so versions never go back).
    d = dict(decode_steps=0, tokens=0, rows_finished=0, rollout_interrupts=0, predicted=[], actual=[],
             row_forwards=0, drafted=0, accepted=0, kv_peak_bytes=0, kv_preemptions=0,
             params=dparams)
    discarded = self.pool.expire(step, self.sch.max_age)
    kept: list[_Kept] = []
    launched = rounds = 0
    finish_step_N = np.zeros(len(self.pool) * self.S, np.int32)
    while len(kept) < self.P:
      need = self.P - len(kept)
      ready = self.pool.complete_in_order(finish_step_N)[:need]
      if ready:
        finish_step_N = np.delete(finish_step_N.reshape(-1, self.S), ready, axis=0).reshape(-1)
        m["groups_handed_over"] += len(ready)
        kept += self._hand_over(d["params"], step, self.pool.remove(ready), m)
        continue
      if rounds == self.fill_rounds:
        break
      rounds += 1
      new = self._launch(step, math.ceil(self.sch.over_provision * need) - len(self.pool), launched,
                         rounds - 1, m)
      launched += new
      if not len(self.pool):
        break  # the plan skipped every candidate of the round
      finish_step_N = self._decode(d["params"], step, need, feed, d)
    if self.techniques and self._replace is not None:
      kept = self._replay(step, kept, m)
    batch = self._batch(step, kept, launched, rounds, discarded, m, d, time.perf_counter() - t_start)
    batch.version = version
    if self.shared is not None:
      batch.state_log, self.state_log = self.state_log, []
    return batch

  def _batch(self, step, kept, launched, rounds, discarded, m, d, total_s) -> SampledBatch:
    S, L, pad = self.S, self.cfg.rollout.max_new_tokens, self.P - len(kept)
    traj = stack_rows([k.rows for k in kept] + [empty_rows(S, L) for _ in range(pad)], S)
    traj.finish_N[len(kept) * S:] = FINISH_UNSAMPLED
    zeros = [np.zeros(S, np.float32)] * pad
    weight_N = np.concatenate([k.weight_S for k in kept] + zeros)
    sampled = np.isin(traj.finish_N, SAMPLED)
    age_NxL = step - traj.version_NxL
    mask = traj.mask_NxL & ~np.repeat([k.replayed for k in kept] + [False] * pad, S)[:, None]
    in_flight = self.pool.rows() if len(self.pool) else None
    running = None if in_flight is None else in_flight.finish_N == FINISH_RUNNING
    predicted, actual = np.concatenate(d["predicted"] or [[]]), np.concatenate(d["actual"] or [[]])
    error = (prediction_error(predicted, actual) if len(actual) >= 2 else {"mae": None, "spearman": None})
    metrics = {
        "rollout_makespan_steps": d["decode_steps"],
        "slot_idle_fraction": (1.0 - d["row_forwards"] / (d["decode_steps"] * self.engine.num_slots)
                               if d["decode_steps"] else 0.0),
        # Speculative decoding (1.0 and 0 without it).
        "spec_tokens_per_forward": d["tokens"] / max(1, d["row_forwards"]),
        "spec_acceptance_rate": d["accepted"] / max(1, d["drafted"]),
        "spec_drafted_tokens": d["drafted"],
        # KV memory: the most bytes the rollout's cache held at once, and
        # rows that lost their pages and were prefilled again (paged cache).
        "kv_peak_bytes": d["kv_peak_bytes"],
        "kv_preemptions": d["kv_preemptions"],
        "response_budget": budget_at(self.stages, step),
        # Accounting (jaxroll.loop.invariants): every launched group is handed
        # over or still in flight; every planned row finishes or is in flight.
        "groups_launched": launched, "groups_handed_over": m["groups_handed_over"],
        "rows_planned": m["rows_planned"],
        "rows_in_flight": 0 if in_flight is None else int(running.sum()),
        "tokens_decoded": d["tokens"] + m["tokens_extended"],
        "rows_finished": d["rows_finished"] + m["rows_extended"],
        "carried_tokens_in_update": int((mask & (age_NxL > 0)).sum()),
        "token_age_mean": float(age_NxL[mask].mean()) if mask.any() else 0.0,
        "token_age_max": int(age_NxL[mask].max()) if mask.any() else 0,
        "rows_carried_over": 0 if in_flight is None else int((running & (in_flight.length_N > 0)).sum()),
        "tokens_carried_over": 0 if in_flight is None else int(in_flight.length_N[running].sum()),
        "groups_in_flight": len(self.pool),
        "tokens_discarded_by_age": discarded,
        "length_pred_mae": error["mae"], "length_pred_spearman": error["spearman"],
    }
    if self.cfg.pipeline.mode == "interrupt":
      metrics["rollout_interrupts"] = d["rollout_interrupts"]
    if self.techniques:
      metrics.update({k: m[k] for k in ("prompts_considered", "prompts_skipped", "groups_generated",
                                        "groups_selected_out", "trajectories_selected_out",
                                        "degenerate_generated")})
      metrics.update(plan_rounds=rounds, groups_used=len(kept), groups_short=pad,
                     loss_weight_mean=float(weight_N[weight_N > 0].mean()) if (weight_N > 0).any() else 0.0)
      for k in ("groups_replayed", "replay_age_mean", "replay_buffer_groups"):
        if k in m:
          metrics[k] = m[k]
    # Empty groups take any prompt: their rows have no tokens and weight 0.
    indices = [k.index for k in kept] + [kept[0].index if kept else 0] * pad
    return SampledBatch(
        indices=indices, traj=traj, group_size=S,
        reward_N=np.concatenate([k.reward_S for k in kept] + zeros),
        weight_N=weight_N, replayed_N=np.repeat([k.replayed for k in kept] + [False] * pad, S) & sampled,
        reward_errors=m["reward_errors"], reward_timeouts=m["reward_timeouts"], metrics=metrics,
        rollout_s=total_s - m["reward_s"], reward_s=m["reward_s"], version=-1)

  def _replay(self, step, kept: list[_Kept], m) -> list[_Kept]:
    """The chain's `replace` over the kept groups (jaxroll.loop.replay_swap)."""
    key = jax.random.fold_in(jax.random.fold_in(self.key, step), 2**30)
    swapped, self.replay, self.tstate, stats = swap_replayed(
        self._replace, self.replay, self.tstate, [(g.index, g.rows, g.reward_S, g.weight_S) for g in kept],
        step=step, key=key, prompts=self.prompts, prompt_ids=self.prompt_ids,
        max_new_tokens=self.cfg.rollout.max_new_tokens)
    m.update(stats)
    return [_Kept(*g) for g in swapped]

  # -- checkpointing -------------------------------------------------------------

  def state(self) -> dict[str, Any]:
    """The sampler's state after its latest batch, as values: `json` for the
    checkpoint's metadata, `arrays` (replay and transform states, or None)
    saved beside the parameters. Fresh copies: the sampler moves on."""
    json_state = {"pool": self.pool.state_dict(), "queue": list(self.queue),
                  "predictor": self.predictor.state_dict()}
    history = getattr(self.engine, "history", None)
    if history is not None:  # speculative drafts: a resume drafts as well
      json_state["draft_history"] = history.state_dict()
    if self.shared is not None:  # the replicated state (the checkpoint names its version)
      arrays = self.shared.arrays(self.shared.latest)
    elif self.techniques:  # arrays are immutable: the references are a consistent snapshot
      arrays = {"replay": self.replay, "transform": self.tstate}
    else:
      arrays = None
    return {"json": json_state, "arrays": arrays}

  def reconcile(self, step: int, batch: SampledBatch) -> None:
    """With techniques across processes: every process's writes of `batch`
    (all processes call this together, at update `step`) make the
    replicated state published with version step + 1."""
    if self.shared is not None:
      self.shared.reconcile(batch.state_log, version=step + 1)

  def checkpoint_arrays(self, step: int, arrays):
    """The arrays a checkpoint after update `step` - 1 keeps: across processes
    the replicated state of version `step`, else the batch's own (`arrays`)."""
    return self.shared.arrays(step) if self.shared is not None else arrays

  def load_state(self, json_state: dict[str, Any], arrays, version: int = 0) -> None:
    self.pool.load_state_dict(json_state["pool"])
    self.queue = list(json_state["queue"])
    self.predictor.load_state_dict(json_state["predictor"])
    history = getattr(self.engine, "history", None)
    if history is not None and "draft_history" in json_state:
      history.load_state_dict(json_state["draft_history"])
    if self.techniques:
      self.replay, self.tstate = jax.tree.map(jnp.asarray, (arrays["replay"], arrays["transform"]))
      if self.shared is not None:
        self.shared = SharedStates(self.transform, self.replay, self.tstate, version=version,
                                   keep=self.shared.keep)
