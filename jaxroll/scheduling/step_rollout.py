"""One RL step's rollout under a long-tail schedule (`ExperimentConfig.schedule`).

Per step:
  1. launch new groups until ceil(over_provision * P) are in flight (SortedRL
     may choose which prompts from a look-ahead buffer);
  2. restart carried rows older than `max_age` policy versions;
  3. decode every unfinished row in the admission order (FIFO, or longest
     predicted first by history or sibling probe), under the step's token
     budget, stopping once P groups are complete when more are in flight;
  4. hand the P earliest-completed groups to the update and keep the rest,
     unfinished rows included, for the next step.

With the defaults (FIFO, no over-provisioning) this is plain synchronous
GRPO: the P groups launched in a step all finish in it.

The launched rows' PRNG keys are fixed at launch: row g of the j-th group
launched at step s samples with fold_in(fold_in(key, s), j * G + g), so a
carried row continues its own random stream and the default schedule draws
the keys it always drew.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll import distributed
from jaxroll.config import ExperimentConfig
from jaxroll.rl.truncation import budget_at, parse_budgets
from jaxroll.scheduling.admission import FixedOrder, SiblingProbe, longest_first
from jaxroll.scheduling.group_pool import Group, GroupPool, stack_rows
from jaxroll.scheduling.length_predictor import HistoryLengthPredictor, prediction_error
from jaxroll.types import FINISH_RUNNING, Trajectories


@jax.jit
def row_key_data(key, step, rows):
  """Key data of rows `rows` of step `step`: fold_in(fold_in(key, step), n)."""
  step_key = jax.random.fold_in(key, step)
  return jax.random.key_data(jax.vmap(lambda n: jax.random.fold_in(step_key, n))(rows))


@dataclasses.dataclass
class StepRolloutResult:
  groups: list[Group]  # the P groups for the update, earliest completed first
  traj: Trajectories  # their rows stacked: row n is groups[n // G]
  metrics: dict[str, Any]  # this process's rollout metrics (see StepRollout.run)


class StepRollout:
  """Owns the groups in flight, the length predictor and the prompt look-ahead.

  Args:
    cfg: the experiment config (rollout and schedule sections).
    engine: the RolloutEngine.
    prompts: token ids of every training prompt (dataset order).
    prompt_ids: a stable id per dataset row (rows with equal text share one).
    batches: the IndexBatches stream of dataset rows.
    key: the run's PRNG key.
  """

  def __init__(self, cfg: ExperimentConfig, engine, prompts, prompt_ids, batches, key):
    self.cfg, self.sch = cfg, cfg.schedule
    self.engine, self.prompts, self.prompt_ids = engine, prompts, prompt_ids
    self.batches, self.key = batches, key
    self.G = cfg.rollout.group_size
    self.multi = jax.process_count() > 1
    if self.multi and (self.sch.over_provision > 1.0 or self.sch.sorted_batches):
      raise ValueError("schedule.over_provision > 1 and schedule.sorted_batches run in a single "
                       "process only (each host would consume prompts at its own pace)")
    rows = distributed.process_rows(cfg.rollout.prompts_per_step, "rollout.prompts_per_step")
    self.P, self.first_group = rows.stop - rows.start, rows.start
    self.pool = GroupPool(self.G, cfg.rollout.max_new_tokens)
    self.predictor = HistoryLengthPredictor(self.sch.history_window)
    self.stages = parse_budgets(self.sch.budgets, cfg.rollout.max_new_tokens)
    self.queue: list[int] = []  # drawn dataset rows not launched yet

  # -- prompts -----------------------------------------------------------------

  def _draw(self, n: int) -> list[int]:
    """The next n dataset rows to launch."""
    if self.multi:  # every process draws the global batch and keeps its slice
      batch = next(self.batches)
      return batch[self.first_group:self.first_group + self.P].tolist()
    K = self.sch.sorted_batches
    if not K:
      while len(self.queue) < n:
        self.queue.extend(next(self.batches).tolist())
      out, self.queue = self.queue[:n], self.queue[n:]
      return out
    # SortedRL: serve the shortest predicted prompts of a K-batch look-ahead;
    # leftovers go first once the buffer runs low, so none waits forever.
    out = []
    if len(self.queue) < n:
      out, self.queue = self.queue, []
      for _ in range(K):
        self.queue.extend(next(self.batches).tolist())
    want = n - len(out)
    predicted = self.predictor.predict([self.prompt_ids[i] for i in self.queue])
    pick = sorted(np.argsort(predicted, kind="stable")[:want].tolist())
    out += [self.queue[i] for i in pick]
    chosen = set(pick)
    self.queue = [x for i, x in enumerate(self.queue) if i not in chosen]
    return out

  def _launch(self, step: int) -> int:
    need = self.P if self.multi else math.ceil(self.sch.over_provision * self.P) - len(self.pool)
    if need <= 0:
      return 0
    offset = self.first_group if self.multi else 0
    rows = np.arange(offset * self.G, (offset + need) * self.G)
    key_data = np.asarray(row_key_data(self.key, step, rows))
    for j, index in enumerate(self._draw(need)):
      self.pool.launch(index, step, key_data[j * self.G:(j + 1) * self.G])
    return need

  # -- admission ---------------------------------------------------------------

  def _admission(self, rows: list[int], row_prompt_ids: list[int], length_N: np.ndarray):
    if self.sch.order == "fifo":
      return FixedOrder(rows)
    predicted = self.predictor.predict(row_prompt_ids)
    if self.sch.predictor == "sibling_probe":
      return SiblingProbe(rows, [n // self.G for n in rows], predicted)
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

  # -- the step ----------------------------------------------------------------

  def run(self, dparams, step: int, feed=None) -> StepRolloutResult:
    """Rolls out step `step` with weights of policy version `step` (or, from
    the rollout thread, the newest published version).

    feed: with the pipeline's interrupt mode, an object whose `changed()`
      says newer weights were published and whose `take()` returns them;
      decoding stops when they appear and the unfinished rows resume under
      them (each token keeps the version that sampled it).
    """
    launched = self._launch(step)
    discarded = self.pool.expire(step, self.sch.max_age)
    before = self.pool.rows()
    key_data = np.concatenate([g.key_data_Gx2 for g in self.pool.groups])
    row_keys = jax.random.wrap_key_data(jnp.asarray(key_data))
    rows = [n for n in range(len(before.length_N)) if before.finish_N[n] == FINISH_RUNNING]
    row_pids = [self.prompt_ids[self.pool.groups[n // self.G].index] for n in rows]
    admission = self._admission(rows, row_pids, before.length_N)
    budget = budget_at(self.stages, step)
    prompts = [self.prompts[g.index] for g in self.pool.groups]
    call = dict(group_size=self.G, row_keys=row_keys, max_new_tokens=budget,
                stop_after_groups=self.P if len(self.pool) > self.P else None)
    if feed is not None:
      call.update(interrupt=feed.changed, interrupt_every=self.cfg.pipeline.interrupt_every)
    traj = self.engine.rollout(dparams, prompts, carried=before, admission=admission, **call)
    stats = self.engine.last_stats
    decode_steps, tokens = stats.decode_steps, stats.tokens_generated
    finish_step_N, interrupts = stats.finish_step_N.copy(), 0
    while stats.interrupted and feed is not None:
      # Newer weights: the unfinished rows continue under them.
      interrupts += 1
      left = [n for n in rows if traj.finish_N[n] == FINISH_RUNNING]
      left_pids = [self.prompt_ids[self.pool.groups[n // self.G].index] for n in left]
      traj = self.engine.rollout(feed.take(), prompts, carried=traj,
                                 admission=self._admission(left, left_pids, traj.length_N), **call)
      stats = self.engine.last_stats
      done = stats.finish_step_N >= 0
      finish_step_N[done] = decode_steps + stats.finish_step_N[done]
      decode_steps += stats.decode_steps
      tokens += stats.tokens_generated
    slot_idle = 1.0 - tokens / max(1, decode_steps * self.engine.num_slots)
    # What the predictor said, scored on the rows that finished in this step.
    predicted = self._predictions(admission, rows, row_pids)
    finished = traj.finish_N[rows] != FINISH_RUNNING
    scored = finished & ~np.isnan(predicted)
    error = (prediction_error(predicted[scored], traj.length_N[rows][scored])
             if scored.sum() >= 2 else {"mae": None, "spearman": None})
    self.predictor.observe(np.asarray(row_pids)[finished], traj.length_N[rows][finished])
    self.pool.set_rows(traj)
    taken = self.pool.take_complete(self.P, finish_step_N)
    out = stack_rows([g.rows for g in taken], self.G)
    in_flight = self.pool.rows() if len(self.pool) else None
    age_NxL = step - out.version_NxL
    mask = out.mask_NxL
    metrics = {
        "rollout_makespan_steps": decode_steps,
        "slot_idle_fraction": slot_idle if decode_steps else 0.0,
        "response_budget": budget,
        "groups_launched": launched,
        "tokens_decoded": tokens,
        "rows_finished": int(finished.sum()),
        "carried_tokens_in_update": int((mask & (age_NxL > 0)).sum()),
        "token_age_mean": float(age_NxL[mask].mean()) if mask.any() else 0.0,
        "token_age_max": int(age_NxL[mask].max()) if mask.any() else 0,
        "rows_carried_over": 0 if in_flight is None else int(
            ((in_flight.finish_N == FINISH_RUNNING) & (in_flight.length_N > 0)).sum()),
        "tokens_carried_over": 0 if in_flight is None else int(
            in_flight.length_N[in_flight.finish_N == FINISH_RUNNING].sum()),
        "groups_in_flight": len(self.pool),
        "tokens_discarded_by_age": discarded,
        "length_pred_mae": error["mae"], "length_pred_spearman": error["spearman"],
    }
    if feed is not None:
      metrics["rollout_interrupts"] = interrupts
    return StepRolloutResult(taken, out, metrics)

  # -- checkpointing -------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    return {"pool": self.pool.state_dict(), "queue": list(self.queue),
            "predictor": self.predictor.state_dict()}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.pool.load_state_dict(state["pool"])
    self.queue = list(state["queue"])
    self.predictor.load_state_dict(state["predictor"])
