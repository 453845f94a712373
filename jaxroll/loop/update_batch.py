"""The host boundary between a sampled batch and the update.

`update_batch` turns a SampledBatch into what the update consumes: rewards
under the truncation treatment, group advantages scaled by each row's loss
weight, the token mask (stale tokens left out when asked), and the rows
that carry a loss (jaxroll.loop.compaction) packed at the narrowest width
that holds them, so the update's cost follows the kept rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxroll.loop.compaction import rows_for_update
from jaxroll.loop.sampler import SampledBatch
from jaxroll.rl.advantages import group_advantages_on_host
from jaxroll.rl.train_step import RLBatch, pack, padded_width
from jaxroll.rl.truncation import apply_truncation
from jaxroll.types import FINISH_LENGTH


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
  adv_N, degenerate_P = group_advantages_on_host(train_r_N, G, cfg.rl.advantage, valid_N=in_group_N)
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
