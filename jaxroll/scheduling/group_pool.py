"""Groups in flight across RL steps: the state of partial rollout.

A group is one prompt's G samples. It is launched with fixed per-row
sampling seeds (drawn from the rows' PRNG keys) and lives in the pool
until all G rows have finished and an update takes it; a row still
decoding when a step stops is carried into the next step and resumed there
under the newer weights (Kimi k1.5's partial rollout; APRIL's recycling of
unfinished responses). Every generated token
keeps the policy version and behaviour log-prob it was sampled with.

The pool is host-side and small (a few hundred rows of at most L tokens),
and it is saved in the checkpoint's JSON metadata, so a resumed run carries
exactly the rows it carried before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxroll.types import FINISH_RUNNING, FINISH_UNSAMPLED, Trajectories

_ROW_FIELDS = ("tokens_NxL", "logp_NxL", "position_NxL", "version_NxL", "length_N", "finish_N")


@dataclasses.dataclass
class Group:
  index: int  # dataset row of the prompt
  launch_step: int  # RL step that launched it
  seeds_Gx2: np.ndarray  # uint32 sampling seeds, one per row (`sampling.row_seeds` of its key)
  rows: Trajectories  # G rows, possibly unfinished (FINISH_UNSAMPLED: not asked for)
  weight: float = 1.0  # the plan's loss weight for the group's rows

  @property
  def complete(self) -> bool:
    return bool((self.rows.finish_N != FINISH_RUNNING).all())


def empty_rows(G: int, L: int) -> Trajectories:
  z = lambda dt: np.zeros((G, L), dt)
  return Trajectories(prompt_index_N=np.zeros(G, np.int32), sample_index_N=np.arange(G, dtype=np.int32),
                      tokens_NxL=z(np.int32), logp_NxL=z(np.float32), position_NxL=z(np.int32),
                      version_NxL=z(np.int32), length_N=np.zeros(G, np.int32),
                      finish_N=np.zeros(G, np.int32))


def stack_rows(parts: Sequence[Trajectories], group_size: int) -> Trajectories:
  """Concatenates groups' rows; row n belongs to group n // G."""
  N = len(parts) * group_size
  cat = {f: np.concatenate([getattr(t, f) for t in parts]) for f in _ROW_FIELDS}
  return Trajectories(prompt_index_N=(np.arange(N) // group_size).astype(np.int32),
                      sample_index_N=(np.arange(N) % group_size).astype(np.int32), **cat)


def split_rows(traj: Trajectories, group_size: int) -> list[Trajectories]:
  G = group_size
  out = []
  for p in range(len(traj.length_N) // G):
    sl = slice(p * G, (p + 1) * G)
    out.append(Trajectories(prompt_index_N=np.zeros(G, np.int32),
                            sample_index_N=np.arange(G, dtype=np.int32),
                            **{f: getattr(traj, f)[sl].copy() for f in _ROW_FIELDS}))
  return out


class GroupPool:
  """The groups launched and not yet used by an update, in launch order."""

  def __init__(self, group_size: int, max_new_tokens: int):
    self.G, self.L = group_size, max_new_tokens
    self.groups: list[Group] = []

  def __len__(self) -> int:
    return len(self.groups)

  def launch(self, index: int, step: int, seeds_Gx2: np.ndarray, samples: int | None = None,
             weight: float = 1.0) -> None:
    """Adds a group whose first `samples` rows (all by default) are to be decoded."""
    rows = empty_rows(self.G, self.L)
    if samples is not None:
      rows.finish_N[samples:] = FINISH_UNSAMPLED
    self.groups.append(Group(int(index), int(step), np.asarray(seeds_Gx2, np.uint32), rows,
                             float(weight)))

  def rows(self) -> Trajectories:
    return stack_rows([g.rows for g in self.groups], self.G)

  def set_rows(self, traj: Trajectories) -> None:
    for g, rows in zip(self.groups, split_rows(traj, self.G)):
      g.rows = rows

  def expire(self, version: int, max_age: int) -> int:
    """Restarts rows holding a token more than `max_age` versions older than
    `version`; returns how many generated tokens were discarded.

    A restarted row is sampled afresh, with its key, under the current weights.
    """
    discarded = 0
    for g in self.groups:
      r = g.rows
      for n in range(self.G):
        c = int(r.length_N[n])
        if c and version - int(r.version_NxL[n, :c].min()) > max_age:
          discarded += c
          for f in ("tokens_NxL", "logp_NxL", "position_NxL", "version_NxL"):
            getattr(r, f)[n] = 0
          r.length_N[n] = 0
          r.finish_N[n] = FINISH_RUNNING
    return discarded

  def complete_in_order(self, finish_step_N: np.ndarray) -> list[int]:
    """Indices of the complete groups, earliest completed first.

    A group completes at its last row's finish step (0 for one completed in
    an earlier step); ties keep launch order.
    """
    done_at = finish_step_N.reshape(-1, self.G).max(axis=1)
    return sorted((i for i, g in enumerate(self.groups) if g.complete), key=lambda i: (done_at[i], i))

  def remove(self, indices) -> list[Group]:
    """Removes and returns the groups at `indices`, in that order."""
    taken = [self.groups[i] for i in indices]
    drop = set(indices)
    self.groups = [g for i, g in enumerate(self.groups) if i not in drop]
    return taken

  def take_complete(self, k: int, finish_step_N: np.ndarray) -> list[Group]:
    """Removes and returns k complete groups, earliest completed first."""
    complete = self.complete_in_order(finish_step_N)
    if len(complete) < k:
      raise RuntimeError(f"{len(complete)} complete groups for an update of {k}")
    return self.remove(complete[:k])

  # -- checkpointing (JSON) ---------------------------------------------------

  def state_dict(self) -> list[dict[str, Any]]:
    out = []
    for g in self.groups:
      rows = {f: getattr(g.rows, f).tolist() for f in _ROW_FIELDS}
      out.append({"index": g.index, "launch_step": g.launch_step, "weight": g.weight,
                  "seeds": g.seeds_Gx2.tolist(), "rows": rows})
    return out

  def load_state_dict(self, state: list[dict[str, Any]]) -> None:
    dtypes = {"tokens_NxL": np.int32, "logp_NxL": np.float32, "position_NxL": np.int32,
              "version_NxL": np.int32, "length_N": np.int32, "finish_N": np.int32}
    self.groups = []
    for s in state:
      rows = empty_rows(self.G, self.L)
      for f, dt in dtypes.items():
        setattr(rows, f, np.asarray(s["rows"][f], dt))
      self.groups.append(Group(s["index"], s["launch_step"], np.asarray(s["seeds"], np.uint32), rows,
                               s["weight"]))
