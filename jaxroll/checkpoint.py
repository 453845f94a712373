"""Run checkpoints through orbax: params, optimiser state and run metadata.

A checkpoint holds everything a resumed run needs to continue exactly: the
parameters, the optimiser state, and a JSON record with the step, the data
iterator state, the PRNG seed words, the cost counters and a fingerprint of
the config that fixes array shapes. Restoring into a run whose fingerprint
differs is an error that names the differing keys, before orbax sees it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxroll.errors import JaxrollError


class CheckpointMismatchError(JaxrollError, ValueError):
  """The checkpoint folder was written by an incompatible config."""


class Checkpointer:
  """Saves and restores run state under `folder` (keeps the newest `keep`).

  Saves are synchronous: a run killed mid-save leaves only orbax's temporary
  folder, which is ignored, and the previous checkpoint stays usable.

  Example:
    ckpt = Checkpointer("runs/x/checkpoints", keep=2)
    ckpt.save(10, params, opt_state, {"step": 10})
    step, params, opt_state, meta = ckpt.restore_latest(params, opt_state, fingerprint)
  """

  def __init__(self, folder: str, keep: int = 2):
    self.folder = os.path.abspath(folder)
    self._manager = ocp.CheckpointManager(
        self.folder, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, params: nnx.State, opt_state, meta: dict[str, Any], extra=None) -> None:
    """`extra`: any other pytree of arrays to keep with the step (e.g. the replay state)."""
    items = dict(params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
                 opt_state=ocp.args.StandardSave(_leaves_dict(opt_state)),
                 meta=ocp.args.JsonSave(meta))
    if extra is not None and _sized_leaves(extra):
      items["extra"] = ocp.args.StandardSave(_sized_leaves(extra))
    self._manager.save(step, args=ocp.args.Composite(**items))
    self._manager.wait_until_finished()

  def read_meta(self, step: int) -> dict[str, Any]:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore_latest(self, params: nnx.State, opt_state, fingerprint: dict[str, Any], extra=None):
    """Restores the newest checkpoint into the structure of `params` / `opt_state`.

    Returns:
      (step, params, opt_state, meta), or None when the folder has none;
      with `extra` (a pytree like the one saved), (step, params, opt_state,
      meta, extra).
    """
    step = self.latest_step()
    if step is None:
      return None
    meta = self.read_meta(step)
    check_fingerprint(meta.get("fingerprint", {}), fingerprint, self.folder)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(params))),
        opt_state=ocp.args.StandardRestore(_abstract(_leaves_dict(opt_state)))))
    new_params = _with_values(params, restored["params"])
    leaves = [restored["opt_state"][str(i)] for i in range(len(restored["opt_state"]))]
    new_opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), leaves)
    if extra is None:
      return step, new_params, new_opt_state, meta
    if _sized_leaves(extra):
      got = self._manager.restore(step, args=ocp.args.Composite(
          extra=ocp.args.StandardRestore(_abstract(_sized_leaves(extra)))))["extra"]
      leaves = jax.tree.leaves(extra)
      extra = jax.tree.unflatten(jax.tree.structure(extra),
                                 [got.get(str(i), x) for i, x in enumerate(leaves)])
    return step, new_params, new_opt_state, meta, extra

  def save_params(self, step: int, params: nnx.State, fingerprint: dict[str, Any]) -> None:
    """Saves parameters alone (e.g. a frozen KL reference)."""
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
        meta=ocp.args.JsonSave({"step": step, "fingerprint": fingerprint})))
    self._manager.wait_until_finished()

  def restore_params(self, params: nnx.State, fingerprint: dict[str, Any]) -> nnx.State:
    """The newest saved parameters, in the structure of `params`."""
    step = self.latest_step()
    if step is None:
      raise FileNotFoundError(f"{self.folder} holds no checkpoint")
    check_fingerprint(self.read_meta(step).get("fingerprint", {}), fingerprint, self.folder)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(params)))))
    return _with_values(params, restored["params"])

  def close(self) -> None:
    self._manager.close()


def _abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _with_values(params: nnx.State, pure: dict) -> nnx.State:
  out = jax.tree.map(lambda x: x, params)  # a copy of the structure
  nnx.replace_by_pure_dict(out, pure)
  return out


def _sized_leaves(tree) -> dict[str, Any]:
  # Orbax refuses zero-size arrays (an empty replay buffer): those are
  # rebuilt from the template on restore.
  return {k: v for k, v in _leaves_dict(tree).items() if np.size(v)}


def _leaves_dict(tree) -> dict[str, Any]:
  # The optimiser state is a nest of NamedTuples; stored as its flat leaves
  # (its structure is rebuilt from a freshly initialised state on restore).
  return {str(i): leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def shape_fingerprint(flat_config: dict[str, Any], params: nnx.State) -> dict[str, Any]:
  """The config keys and parameter shapes a checkpoint must match."""
  keys = {k: v for k, v in flat_config.items()
          if k.startswith("policy.") or k == "task.name"}
  shapes = {"/".join(map(str, path)): list(np.shape(x))
            for path, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
            for path in [[getattr(p, "key", getattr(p, "idx", p)) for p in path]]}
  return {"config": keys, "param_shapes": shapes}


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], folder: str) -> None:
  diffs = []
  for key in sorted(set(saved.get("config", {})) | set(current.get("config", {}))):
    a, b = saved.get("config", {}).get(key), current.get("config", {}).get(key)
    if a != b:
      diffs.append(f"{key}: checkpoint {a!r}, this run {b!r}")
  if not diffs and saved.get("param_shapes") != current.get("param_shapes"):
    diffs.append("parameter shapes differ")
  if diffs:
    raise CheckpointMismatchError(
        f"{folder} was written by an incompatible config ({'; '.join(diffs)}); "
        "resume with the run's own config.json or use a new run_dir")
