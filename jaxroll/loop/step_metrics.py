"""The step's record: `step_metrics` gives metrics.jsonl's entry of an
update and the length trace `jaxroll simulate` replays; both cover every
process's rows (gathered in a multi-process run).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxroll import distributed
from jaxroll.loop.sampler import SampledBatch
from jaxroll.loop.update_batch import UpdateBatch
from jaxroll.types import FINISH_LENGTH

ACCOUNTING = ("groups_launched", "groups_handed_over", "groups_in_flight", "rows_planned", "rows_in_flight")



def _length_stats(length_N: np.ndarray) -> dict[str, float | None]:
  if not length_N.size:  # a step whose plan left no rows (metrics record None)
    return {k: None for k in ("length_mean", "length_median", "length_p90", "length_p99", "length_cv")}
  mean = float(length_N.mean())
  p50, p90, p99 = (float(x) for x in np.percentile(length_N, [50, 90, 99]))
  return {"length_mean": mean, "length_median": p50, "length_p90": p90, "length_p99": p99,
          "length_cv": float(length_N.std() / mean) if mean > 0 else 0.0}


def _unanimous_groups(r_N, rows_N, G: int):
  """Per group with rows in `rows_N`: all of them wrong (reward <= 0), all
  right (reward >= 1). Their fractions tell how much work filters and
  budget allocation have (a group of either kind has no signal)."""
  r_PxG, in_PxG = np.asarray(r_N, np.float32).reshape(-1, G), np.asarray(rows_N).reshape(-1, G)
  has_P = in_PxG.any(axis=1)
  wrong_P = np.where(in_PxG, r_PxG, -np.inf).max(axis=1) <= 0.0
  right_P = np.where(in_PxG, r_PxG, np.inf).min(axis=1) >= 1.0
  return wrong_P[has_P], right_P[has_P]


def _distinct_responses(traj, rows_N, G: int) -> np.ndarray:
  """Per group with rows in `rows_N`: how many distinct responses they hold
  (the rollout diversity R2PO claims to raise)."""
  out = []
  for p in range(len(rows_N) // G):
    seqs = {traj.tokens_NxL[n, :traj.length_N[n]].tobytes() for n in range(p * G, (p + 1) * G) if rows_N[n]}
    if seqs:
      out.append(len(seqs))
  return np.asarray(out, np.float64)


def _mean(x: np.ndarray) -> float | None:
  return float(np.mean(x)) if np.size(x) else None


def step_metrics(step: int, sample: SampledBatch, ub: UpdateBatch, stats: dict, prompt_ids,
                 counters: dict, **extra) -> tuple[dict[str, Any], dict[str, Any]]:
  """(metrics, length trace) of update `step` (0-based); adds the step's
  decoded tokens and finished rollouts to `counters`. `extra`: more
  entries for the record (learning rate, weight-sync bytes)."""
  traj, G = sample.traj, sample.group_size
  sampled_N = sample.sampled_N
  gather = distributed.gather_rows  # identity in one process
  mask = traj.mask_NxL
  # Reward and length statistics describe this step's rollouts, not rows
  # replayed from earlier steps (the update still trains on those).
  fresh_N = sampled_N & ~sample.replayed_N
  all_wrong_P, all_right_P = (gather(x) for x in _unanimous_groups(sample.reward_N, fresh_N, G))
  r_N, length_N = gather(sample.reward_N[fresh_N]), gather(traj.length_N[fresh_N])
  finish_N = gather(traj.finish_N[fresh_N])
  # Groups with at least one sampled row (a plan may leave groups empty).
  degenerate_P = gather(ub.degenerate_P[sampled_N.reshape(-1, G).any(axis=1)])
  ro = dict(sample.metrics)
  decoded, finished = ro.pop("tokens_decoded"), ro.pop("rows_finished")
  # The loop's accounting covers every process's groups (its invariants
  # compare it with the gathered rollout count).
  ro.update(zip(ACCOUNTING, (int(x) for x in gather(np.array(
      [ro[k] for k in ACCOUNTING], np.int64)).reshape(-1, len(ACCOUNTING)).sum(axis=0))))
  neg_logp, token_count, errors, timeouts, num_tokens, rollouts, loss_tokens = gather(np.array(
      [-(traj.logp_NxL * mask).sum(), mask.sum(), sample.reward_errors, sample.reward_timeouts,
       decoded, finished, ub.loss_tokens], np.float64)).reshape(-1, 7).sum(axis=0)
  # Cost counts what was decoded this step, including rows carried on.
  num_tokens, N = int(num_tokens), int(rollouts)
  counters["cumulative_tokens"] += num_tokens
  counters["cumulative_rollouts"] += N
  metrics = {
      "step": step + 1, "reward_mean": _mean(r_N), "accuracy": _mean(r_N >= 1.0),
      "degenerate_fraction": _mean(degenerate_P), "degenerate_groups": int(degenerate_P.sum()),
      "all_wrong_fraction": _mean(all_wrong_P), "all_right_fraction": _mean(all_right_P),
      "distinct_responses_mean": _mean(gather(_distinct_responses(traj, fresh_N, G))),
      **_length_stats(length_N),
      "truncated_fraction": _mean(finish_N == FINISH_LENGTH),
      "loss_tokens": int(loss_tokens), "update_rows": int(len(ub.rows)),
      "tokens_generated": num_tokens, "rollouts_generated": N,
      "cumulative_tokens": counters["cumulative_tokens"],
      "cumulative_rollouts": counters["cumulative_rollouts"],
      "reward_errors": int(errors), "reward_timeouts": int(timeouts),
      "entropy_estimate": float(neg_logp / max(token_count, 1)),
      **extra,
      **{k: float(v) for k, v in stats.items()},
      # Scheduling: this process's view (all processes run the same schedule).
      **ro,
  }
  # The length trace `jaxroll simulate` replays: every request of the step.
  row_ids = np.repeat([prompt_ids[i] for i in sample.indices], G)[fresh_N]
  trace = {"step": step + 1, "prompt_ids": gather(row_ids).tolist(), "lengths": length_N.tolist()}
  return metrics, trace
