"""What a run's checkpoint holds, and how a resume reads it back.

A checkpoint is the learner's state (parameters, optimiser state, cost
counters) plus what the sampling side has consumed: the data stream's
position and the sampler's state (pool, queue, predictor, carried rows,
the replay and transform states of the checkpoint's own version), and the
behaviour's own state (R2PO's head) when it has one. With several
processes, each samples at its own pace, so their sampler states are kept
side by side and each resumes its own.

A step's records are synced before its checkpoint commits, and a resume
drops the records past the checkpoint it restores, so a run killed at any
instant resumes to the same records as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from jaxroll import checkpoint as ckpt_lib
from jaxroll import config as config_lib
from jaxroll import distributed, faults, run_folder
from jaxroll.loop.learner import fresh_counters
from jaxroll.metrics import logger as logger_lib

log = logging.getLogger(__name__)

LOG_STREAMS = ("metrics", "timing", "lengths")


class RunCheckpoints:
  def __init__(self, cfg, learner, sampler, batches, behaviour, key):
    self.cfg, self.learner, self.sampler, self.batches = cfg, learner, sampler, batches
    self.behaviour, self.key = behaviour, key
    self.multi = jax.process_count() > 1
    self.checkpointer = ckpt_lib.Checkpointer(os.path.join(cfg.run_dir, "checkpoints"),
                                              cfg.keep_checkpoints)
    self.fingerprint = ckpt_lib.shape_fingerprint(config_lib.to_flat_dict(cfg), learner.params)

  def sampler_state(self) -> dict[str, Any]:
    """What the sampling side has consumed: the data stream's position and
    the sampler's state (fresh copies: the sampler moves on)."""
    return {"data_iterator": self.batches.get_state(), **self.sampler.state()}

  def extra(self, sampler_arrays):
    """The arrays a checkpoint keeps beside the parameters."""
    behaviour = self.behaviour.state()
    return sampler_arrays if behaviour is None else {"sampler": sampler_arrays, "behaviour": behaviour}

  def _meta(self, step: int, sampler: dict[str, Any]) -> dict[str, Any]:
    per_process = distributed.gather_json if self.multi else (lambda x: x)
    return {"step": step, "data_iterator": per_process(sampler["data_iterator"]),
            "sampler": per_process(sampler["json"]),
            "prng_key": np.asarray(jax.random.key_data(self.key)).tolist(),
            "counters": dict(self.learner.counters), "kv_budget_level": self.learner.kv_budget.state(),
            "fingerprint": self.fingerprint}

  def commit(self, step: int, logger, opt_state, sampler=None) -> None:
    """Syncs the step's records, then commits its checkpoint (in that order:
    a checkpoint never runs ahead of the logs it resumes). `sampler`: the
    sampler state as of the step's batch (None: the live one)."""
    logger.sync()
    faults.point("logged")
    sampler = sampler or self.sampler_state()
    self.checkpointer.save(step, self.learner.params, opt_state, self._meta(step, sampler),
                           self.extra(self.sampler.checkpoint_arrays(step, sampler["arrays"])))
    if distributed.is_main():
      run_folder.write_state(self.cfg.run_dir, "training", checkpoint_step=step, steps=self.cfg.steps)

  def restore(self, opt_state):
    """The newest intact checkpoint's step and optimiser state; the learner,
    sampler and data stream take the rest, and the records past it are dropped."""
    learner = self.learner
    # Restored straight into the mesh layout (orbax reads each shard where it goes).
    params, opt_state = learner.placement.place_state(learner.params, opt_state)
    restored = self.checkpointer.restore_latest(params, opt_state, self.fingerprint,
                                                extra=self.extra(self.sampler.state()["arrays"]))
    start, learner.params, opt_state, meta = restored[:4]
    extra = restored[4] if len(restored) > 4 else None
    if self.behaviour.state() is not None:
      self.behaviour.load_state(extra["behaviour"])
      extra = extra["sampler"]
    mine = lambda x: x[jax.process_index()] if isinstance(x, list) else x
    self.sampler.load_state(mine(meta["sampler"]), extra, version=start)
    self.batches.set_state(mine(meta["data_iterator"]))
    # A checkpoint from before the compile clock was counted resumes from 0 s of it.
    learner.counters = {**fresh_counters(), **meta["counters"]}
    learner.kv_budget.load_state(meta.get("kv_budget_level"))
    for stream in LOG_STREAMS:
      path = os.path.join(self.cfg.run_dir, f"{stream}.jsonl")
      if distributed.is_main() and os.path.exists(path):
        dropped = logger_lib.truncate_after(path, start)
        if dropped:
          log.info("resume: recomputing %d %s records after step %d", dropped, stream, start)
    return start, opt_state

  def reference_params(self, resume: bool):
    """The KL reference (the warm-started policy), saved once beside the
    checkpoints, before checkpoint 0 commits, for resumed runs."""
    ref = ckpt_lib.Checkpointer(os.path.join(self.cfg.run_dir, "reference"), keep=1)
    try:
      if resume:
        return ref.restore_params(self.learner.params, self.fingerprint)
      ref.save_params(0, self.learner.params, self.fingerprint)
      return jax.tree.map(lambda x: x.copy(), self.learner.params)
    finally:
      ref.close()

  def close(self) -> None:
    self.checkpointer.close()
