"""The run's warm-start phase: reuse a saved warm-started policy, or train one and save it.

A run reads the policy from `warm_start.from_dir` (another run's folder,
only read) or from its own run_dir/warm_start when a restart finds it
committed (run_folder.prepare kept it only if its config matches);
otherwise it trains it (jaxroll.warm_start) and, in a single process,
saves it there for runs that start from the same policy and for its own
restart before the first checkpoint. Either way the saved policy carries a
fingerprint of the settings that shaped it, checked on load.
"""

from __future__ import annotations

import logging

from jaxroll import checkpoint as ckpt_lib
from jaxroll import checkpoint_manifest, distributed, faults, run_folder, warm_start
from jaxroll.metrics.progress import Progress

log = logging.getLogger(__name__)


def warm_started_params(cfg, graphdef, params, task, logger, *, seq_len: int, multi: bool):
  """The policy RL starts from (params unchanged when warm_start.steps is 0)."""
  w = cfg.warm_start
  if not w.steps:
    return params
  fingerprint = ckpt_lib.shape_fingerprint({}, params)
  fingerprint["config"] = run_folder.warm_start_fingerprint(cfg)
  own = run_folder.warm_start_dir(cfg.run_dir)
  source = w.from_dir or (own if checkpoint_manifest.committed_steps(own) else "")
  if source:
    log.info("warm start: loading the warm-started policy from %s", source)
    # Another run's folder (from_dir) is only read; this run's own is repaired.
    saved = ckpt_lib.Checkpointer(source, keep=1, read_only=bool(w.from_dir))
    try:
      return saved.restore_params(params, fingerprint)
    finally:
      saved.close()
  show = Progress(w.steps, 0, cfg.progress and distributed.is_main(), label="warm start")

  def on_step(s, loss):
    if loss is not None:
      logger.write("warm_start", {"step": s, "loss": loss})
      show.last_loss = loss
    show.update(s + 1)
    faults.point("warm_start_step")

  params = warm_start.train(
      graphdef, params, task.warm_start_examples or task.train, task.tokenizer,
      steps=w.steps, batch_size=w.batch_size, learning_rate=w.learning_rate, warmup_steps=w.warmup_steps,
      error_rate=w.error_rate, seq_len=seq_len, seed=cfg.seed + 1,
      solve=task.worked_solution, microbatch_tokens=w.microbatch_tokens, log_fn=on_step)
  show.close()
  if not multi:
    logger.sync()  # warm_start.jsonl is complete before the policy commits
    saved = ckpt_lib.Checkpointer(own, keep=1)
    try:
      saved.save_params(0, params, fingerprint)
    finally:
      saved.close()
    faults.point("warm_start_saved")
  return params
