"""Replay and transform states across processes: replicated, written only by the global learner step.

In a multi-process run each process plans, selects and records its own
groups, but a technique's decisions must rest on one state that every
process holds alike. So each process works, for one batch, on a copy of
the replicated state published with the weights the batch samples with
(the plan is then exactly as stale as the weights), and logs every call
that writes the state: `plan`, `extend`, `select` with their inputs and
keys, and `observe` with the groups it records. At the learner step, in
the main threads of all processes together, the logs are gathered and
replayed in process order onto the replicated state; every process
computes the same next state, which a digest compared across processes
confirms, and that state is the one published with the next weights and
saved in the step's checkpoint.

A single process needs none of this: its working copy is the state.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll import distributed
from jaxroll.replay.protocol import Groups, RolloutPlan
from jaxroll.replay.state import observe

# Techniques whose per-process use is what they mean: each decides over its
# own candidates and groups. Budget allocations (vigor, vip) spend a
# global budget, top-k filters (mopps, kgps) keep a global count, and
# replay techniques (vcrl, popo) would hand the same buffered group to
# several processes; those stay one-process.
MULTI_PROCESS_TECHNIQUES = ("dapo", "greso", "pods")


def _op_fns(transform):
  """name -> jitted (replay, tstate, *args) -> (replay, tstate)."""

  def plan(replay, tstate, prompt_K, samples_K, weight_K, limit, key):
    _, tstate = transform.plan(RolloutPlan(prompt_K, samples_K, weight_K, limit), tstate, replay,
                               jax.random.wrap_key_data(key))
    return replay, tstate

  def groups_op(method):
    def run(replay, tstate, prompt_K, reward, valid, weight, key):
      _, tstate = getattr(transform, method)(Groups(prompt_K, reward, valid, weight), tstate, replay,
                                             jax.random.wrap_key_data(key))
      return replay, tstate
    return run

  def record(replay, tstate, prompt_K, reward, valid, length, step):
    return observe(replay, prompt_K, reward, valid, length, step), tstate

  fns = {"plan": plan, "select": groups_op("select"), "observe": record}
  if transform.extend is not None:
    fns["extend"] = groups_op("extend")
  return {name: jax.jit(f) for name, f in fns.items()}


def encode_call(op: tuple[str, tuple]) -> dict[str, Any]:
  name, arrays = op
  return {"op": name, "arrays": [{"dtype": str(np.asarray(a).dtype), "shape": list(np.shape(a)),
                                  "data": np.asarray(a).reshape(-1).tolist()} for a in arrays]}


def decode_call(entry: dict[str, Any]) -> tuple[str, list[np.ndarray]]:
  return entry["op"], [np.asarray(a["data"], a["dtype"]).reshape(a["shape"]) for a in entry["arrays"]]


def digest(tree) -> str:
  """A hash of every leaf's bytes: equal states, equal digests."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return h.hexdigest()[:16]


def key_data(key) -> np.ndarray:
  return np.asarray(jax.random.key_data(key))


class SharedStates:
  """The replicated (replay, transform) states by the policy version they are published with.

  Args:
    transform: the run's RolloutTransform chain.
    replay, tstate: the state the run starts from (fresh or restored).
    version: the policy version of the weights the run starts with.
    keep: how many versions back a batch may still start from (max_lag + 1).
  """

  def __init__(self, transform, replay, tstate, version: int, keep: int):
    self._fns = _op_fns(transform)
    self._bases = {version: (replay, tstate)}
    self.keep = keep

  @property
  def latest(self) -> int:
    return max(self._bases)

  def base(self, version: int):
    """The state published with the weights of `version`."""
    return self._bases[version]

  def reconcile(self, log: list[tuple[str, tuple]], version: int) -> None:
    """Replays every process's `log` (this process's is `log`) in process
    order onto the newest state; the result is published with `version`.
    Called by all processes together."""
    logs = distributed.gather_json([encode_call(op) for op in log])
    replay, tstate = self._bases[self.latest]
    for process_log in logs:
      for entry in process_log:
        name, arrays = decode_call(entry)
        replay, tstate = self._fns[name](replay, tstate, *(jnp.asarray(a) for a in arrays))
    mine = digest((replay, tstate))
    every = distributed.gather_json(mine)
    if any(d != mine for d in every):
      raise RuntimeError(f"the replicated replay state diverged across processes at version {version} "
                         f"(digests {every}): the logged transform calls are not deterministic")
    self._bases[version] = (replay, tstate)
    for old in [v for v in self._bases if v <= version - self.keep]:
      del self._bases[old]

  def arrays(self, version: int) -> dict[str, Any]:
    """The state of `version` as host arrays, for a checkpoint (every process saves the same)."""
    replay, tstate = self._bases[version]
    return jax.tree.map(np.asarray, {"replay": replay, "transform": tstate})
