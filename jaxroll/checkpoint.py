"""Run checkpoints through orbax: params, optimiser state and run metadata.

A checkpoint holds everything a resumed run needs to continue exactly: the
parameters, the optimiser state, and a JSON record with the step, the data
iterator state, the PRNG seed words, the cost counters and a fingerprint of
the config that fixes array shapes. Restoring into a run whose fingerprint
differs is an error that names the differing keys, before orbax sees it.

Orbax writes each step's arrays; jaxroll commits the step by writing its
manifest last (jaxroll.checkpoint_manifest) and keeps the newest `keep`
committed steps itself, deleting an old one only after a newer one is
committed. Restore verifies the newest committed step against its manifest
and falls back to the previous one when it is damaged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxroll import faults
from jaxroll import checkpoint_manifest as manifest
from jaxroll.checkpoint_manifest import (CheckpointCorruptError, CheckpointMismatchError,  # noqa: F401
                                         check_fingerprint)

log = logging.getLogger(__name__)


class Checkpointer:
  """Saves and restores run state under `folder` (keeps the newest `keep`).

  Saves are synchronous. Whatever a run killed mid-save leaves (orbax's
  temporary folder, a step without its manifest) is set aside into
  `folder.set_aside/` when the folder is next opened; the previous
  checkpoint stays usable.

  Example:
    ckpt = Checkpointer("runs/x/checkpoints", keep=2)
    ckpt.save(10, params, opt_state, {"step": 10})
    step, params, opt_state, meta = ckpt.restore_latest(params, opt_state, fingerprint)
  """

  def __init__(self, folder: str, keep: int = 2, read_only: bool = False):
    """`read_only`: restore from a folder another run owns (warm_start.from_dir):
    nothing in it is moved, damaged steps are only skipped."""
    self.folder = os.path.abspath(folder)
    self.keep = keep
    self.read_only = read_only
    self._skipped: set[int] = set()
    self._main = jax.process_index() == 0 and not read_only
    if self._main:
      for path in manifest.set_aside_uncommitted(self.folder):
        log.warning("checkpoint %s was never committed (a save cut short); set aside to %s",
                    os.path.basename(path), path)
    _sync("checkpoint_open")
    self._manager = self._open()

  def _open(self):
    # Retention is jaxroll's (after the commit), not orbax's max_to_keep.
    return ocp.CheckpointManager(self.folder, options=ocp.CheckpointManagerOptions(
        create=not self.read_only, read_only=self.read_only, enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    steps = manifest.committed_steps(self.folder)
    return steps[-1] if steps else None

  def _save(self, step: int, items: dict, meta: dict[str, Any]) -> None:
    with faults.killed_during("checkpoint_write", self.folder):
      self._manager.save(step, args=ocp.args.Composite(**items))
      self._manager.wait_until_finished()
    faults.point("checkpoint_saved")
    if self._main:
      manifest.write_manifest(os.path.join(self.folder, str(step)), meta)
      faults.point("checkpoint_committed")
      for old in manifest.committed_steps(self.folder)[:-self.keep]:
        manifest.decommit(self.folder, old)
    _sync("checkpoint_commit")
    self._manager.reload()

  def save(self, step: int, params: nnx.State, opt_state, meta: dict[str, Any], extra=None) -> None:
    """`extra`: any other pytree of arrays to keep with the step (e.g. the replay state)."""
    items = dict(params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
                 opt_state=ocp.args.StandardSave(_leaves_dict(opt_state)))
    if extra is not None and _sized_leaves(extra):
      items["extra"] = ocp.args.StandardSave(_sized_leaves(extra))
    self._save(step, items, meta)

  def read_meta(self, step: int) -> dict[str, Any]:
    return manifest.read_meta(self.folder, step)

  def _newest_intact(self) -> int | None:
    """The newest committed step that verifies; damaged newer ones are named and set aside."""
    for step in reversed(manifest.committed_steps(self.folder)):
      if step in self._skipped:
        continue
      problem = manifest.verify(self.folder, step)
      if problem is None:
        return step
      self._reject(step, problem)
    return None

  def _reject(self, step: int, problem: str) -> None:
    self._skipped.add(step)
    if self.read_only:
      where = "skipped (the folder is read-only here)"
    elif self._main:
      where = f"set aside to {manifest.set_aside(self.folder, str(step))}"
    else:
      where = "set aside by the main process"
    older = [s for s in manifest.committed_steps(self.folder) if s < step]
    then = f"resuming from step {older[-1]}" if older else "no older checkpoint is left"
    log.warning("checkpoint step %d in %s is damaged (%s): %s; %s", step, self.folder, problem,
                where, then)
    self._manager.close()
    self._manager = self._open()

  def _restore(self, step: int, abstract: dict[str, Any]) -> dict[str, Any] | None:
    """Orbax's restore of `abstract`'s items, or None when it fails on a step
    that verified (a checkpoint damaged before its manifest was computed)."""
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          **{k: ocp.args.StandardRestore(v) for k, v in abstract.items()}))
    except Exception as e:  # orbax/TensorStore raise many types for unreadable data
      self._reject(step, f"orbax could not read it: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
      return None

  def restore_latest(self, params: nnx.State, opt_state, fingerprint: dict[str, Any], extra=None):
    """Restores the newest intact checkpoint into the structure of `params` / `opt_state`.

    Returns:
      (step, params, opt_state, meta), or None when the folder has none;
      with `extra` (a pytree like the one saved), (step, params, opt_state,
      meta, extra).

    Raises:
      CheckpointCorruptError: committed checkpoints exist but none is intact.
    """
    if self.latest_step() is None:
      return None
    abstract = {"params": _abstract(nnx.to_pure_dict(params)),
                "opt_state": _abstract(_leaves_dict(opt_state))}
    if extra is not None and _sized_leaves(extra):
      abstract["extra"] = _abstract(_sized_leaves(extra))
    while (step := self._newest_intact()) is not None:
      meta = self.read_meta(step)
      check_fingerprint(meta.get("fingerprint", {}), fingerprint, self.folder)
      restored = self._restore(step, abstract)
      if restored is not None:
        break
    else:
      raise CheckpointCorruptError(f"{self.folder}: no intact checkpoint is left (the damaged ones "
                                   f"are in {self.folder}.set_aside); start a new run_dir")
    new_params = _with_values(params, restored["params"])
    leaves = [restored["opt_state"][str(i)] for i in range(len(restored["opt_state"]))]
    new_opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), leaves)
    if extra is None:
      return step, new_params, new_opt_state, meta
    if "extra" in restored:
      got, leaves = restored["extra"], jax.tree.leaves(extra)
      extra = jax.tree.unflatten(jax.tree.structure(extra),
                                 [got.get(str(i), x) for i, x in enumerate(leaves)])
    return step, new_params, new_opt_state, meta, extra

  def save_params(self, step: int, params: nnx.State, fingerprint: dict[str, Any]) -> None:
    """Saves parameters alone (e.g. a frozen KL reference)."""
    self._save(step, dict(params=ocp.args.StandardSave(nnx.to_pure_dict(params))),
               {"step": step, "fingerprint": fingerprint})

  def restore_params(self, params: nnx.State, fingerprint: dict[str, Any]) -> nnx.State:
    """The newest intact saved parameters, in the structure of `params`."""
    abstract = {"params": _abstract(nnx.to_pure_dict(params))}
    while (step := self._newest_intact()) is not None:
      check_fingerprint(self.read_meta(step).get("fingerprint", {}), fingerprint, self.folder)
      restored = self._restore(step, abstract)
      if restored is not None:
        return _with_values(params, restored["params"])
    raise CheckpointCorruptError(f"{self.folder} holds no intact checkpoint")

  def close(self) -> None:
    self._manager.close()


def _sync(name: str) -> None:
  """All processes reach this point (a no-op in one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


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
