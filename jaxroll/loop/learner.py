"""The learner side of a step.

`make_rl_update` builds the jitted update; `update_batch` turns a SampledBatch into what the update consumes: rewards
under the truncation treatment, group advantages scaled by each row's loss
weight, the token mask (stale tokens left out when asked), the rows that
carry a loss (jaxroll.loop.compaction) packed at the narrowest width that
holds them. `step_metrics` is the step's record for metrics.jsonl and the
length trace `jaxroll simulate` replays; both cover every process's rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxroll import distributed
from jaxroll.loop.compaction import rows_for_update
from jaxroll.loop.sampler import SampledBatch
from jaxroll.replay import registry
from jaxroll.rl.advantages import group_advantages
from jaxroll.rl.chunked_update import make_chunked_update
from jaxroll.rl.train_step import RLBatch, make_update, pack, padded_width
from jaxroll.rl.truncation import apply_truncation
from jaxroll.types import FINISH_LENGTH


def make_rl_update(cfg, graphdef, tx, sampling, placement, *, seq_len: int, chunked: bool):
  """The jitted RL update the config names: over length chunks of the rows
  (rl.microbatch_tokens > 0, one process) or one padded array."""
  rl = cfg.rl
  args = dict(sampling=sampling, minibatches=rl.minibatches, clip_low=rl.clip_low,
              clip_high=rl.clip_high, aggregation=rl.aggregation, kl_coef=rl.kl_coef,
              is_cap=rl.is_cap, off_policy=registry.off_policy_loss(cfg),
              measure_mismatch=rl.measure_mismatch, mismatch_reject=rl.mismatch_reject,
              state_shardings=placement.state_shardings,
              # Next-token arrays are one shorter than a row.
              max_len=seq_len - 1)
  if chunked:
    return make_chunked_update(graphdef, tx, **args, microbatch_tokens=rl.microbatch_tokens,
                               row_multiple=placement.row_multiple, place=placement.place_batch)
  return make_update(graphdef, tx, **args)


ACCOUNTING = ("groups_launched", "groups_handed_over", "groups_in_flight", "rows_planned", "rows_in_flight")


@dataclasses.dataclass
class UpdateBatch:
  packed: RLBatch  # the rows the update runs over
  lengths_N: np.ndarray  # their token counts (prompt + generated)
  rows: np.ndarray  # their indices in the sampled batch
  degenerate_P: np.ndarray  # bool per group: no group-relative signal
  loss_tokens: int


def update_batch(cfg, sample: SampledBatch, prompts, step: int, *, seq_len: int,
                 all_rows: bool = False) -> UpdateBatch:
  """`prompts`: the token ids of each group's prompt. `all_rows`: keep every
  row at the full width (several processes must share one global shape)."""
  traj, G, weight_N = sample.traj, sample.group_size, sample.weight_N
  truncated_N = traj.finish_N == FINISH_LENGTH
  train_r_N, in_group_N, in_loss_N = apply_truncation(sample.reward_N, truncated_N, cfg.schedule.truncation)
  # Rows a plan did not sample (or selected out) are not group members.
  members_N = weight_N > 0
  in_group_N, in_loss_N = in_group_N & members_N, in_loss_N & members_N
  adv_N, degenerate_P = group_advantages(train_r_N, G, cfg.rl.advantage, valid_N=in_group_N)
  # A trajectory's loss weight scales its advantage: for weights > 0 the
  # clipped objective scales by the same factor.
  adv_N = np.asarray(adv_N) * weight_N
  in_loss_NxL = np.repeat(in_loss_N[:, None], traj.tokens_NxL.shape[1], axis=1)
  if cfg.schedule.stale_tokens == "mask":
    # Only tokens sampled since this batch's rollout began (its own lag,
    # with async, is the off-policy loss's to correct).
    in_loss_NxL &= traj.version_NxL >= sample.version
  rows = (np.arange(len(traj.length_N)) if all_rows else
          rows_for_update(in_loss_NxL.any(axis=1), traj.length_N,
                          cfg.rollout.prompts_per_step * cfg.rollout.group_size))
  traj_u = traj.take(rows)
  lengths_N = np.array([len(prompts[int(traj_u.prompt_index_N[n])]) + int(traj_u.length_N[n])
                        for n in range(len(rows))])
  # The batch's width follows its longest row (a few static widths), so
  # short responses are not trained at the longest possible length.
  width = seq_len if all_rows else padded_width(int(lengths_N.max(initial=1)), seq_len)
  packed = pack(prompts, traj_u, adv_N[rows], width, in_loss_NxL[rows], version=step)
  return UpdateBatch(packed, lengths_N, rows, np.asarray(degenerate_P), int(packed.loss_mask_NxT.sum()))


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
