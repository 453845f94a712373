"""The synchronous GRPO training loop: warm start, then rollout -> reward -> update.

`train(cfg, resume=...)` runs one experiment into `cfg.run_dir`:

  run_dir/config.json      resolved config (jaxroll train run_dir/config.json repeats the run)
  run_dir/run_info.json    git commit, package versions, seed, hardware; each resume and
                           the config keys it changed
  run_dir/run_state.json   what the run was last doing (jaxroll.run_folder)
  run_dir/metrics.jsonl    per-step learning metrics (reproducible byte for byte)
  run_dir/timing.jsonl     per-step phase times and throughput (machine dependent)
  run_dir/warm_start.jsonl supervised-phase losses
  run_dir/warm_start/      the warm-started policy (warm_start.from_dir reuses it)
  run_dir/lengths.jsonl    per step, each trajectory's prompt id and length (`jaxroll simulate`)
  run_dir/tb/              TensorBoard event files
  run_dir/checkpoints/     orbax checkpoints (step 0 is the warm-started policy), each
                           committed by its manifest (jaxroll.checkpoint_manifest)
  run_dir/report.md        C(q) curves, learning curves and the reporting checklist

A step's records are written (and synced) before its checkpoint commits,
and a resume drops the records past the checkpoint it restores: a run
killed at any instant resumes to the same metrics.jsonl and lengths.jsonl
as an uninterrupted one (jaxroll.faults injects kills at each boundary).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import numpy as np

from jaxroll import checkpoint as ckpt_lib
from jaxroll import config as config_lib
from jaxroll import distributed, faults, preflight, run_folder, run_info
from jaxroll.behaviour import make_behaviour
from jaxroll.data import IndexBatches
from jaxroll.metrics import logger as logger_lib
from jaxroll.metrics.progress import Progress
from jaxroll.loop.drivers import make_driver
from jaxroll.loop.learner import make_rl_update, step_metrics, update_batch
from jaxroll.evaluation import HeldoutEvaluator
from jaxroll.loop.placement import Placement
from jaxroll.warm_start_phase import warm_started_params
from jaxroll.loop.sampler import SampledBatch, Sampler
from jaxroll.pipeline.producer import RolloutThreadError
from jaxroll.pipeline.stop import StopRequest
from jaxroll.rl.optim import adamw_warmup_cosine
from jaxroll.rollout import RolloutEngine, SamplingParams
from jaxroll.model.paged_kv_cache import paged_from_config
from jaxroll.rollout.speculative import spec_from_config
from jaxroll.task_setup import build_policy
from jaxroll.tasks.rewards import RewardRunner

log = logging.getLogger(__name__)


class Trainer:
  """Holds one run's components; `run()` executes it."""

  def __init__(self, cfg: config_lib.ExperimentConfig, resume: bool = False,
               plan: run_folder.StartPlan | None = None, task=None):
    """`plan` and `task`: what jaxroll.run_folder.plan_start and
    jaxroll.preflight.check returned (the CLI runs both before JAX starts)."""
    # With several processes (hosts), each samples its share of the prompts
    # on its own devices; the update runs on the global training mesh.
    self.multi = jax.process_count() > 1
    self.cfg = cfg
    self.plan = plan or run_folder.plan_start(cfg, resume)
    self.resume = self.plan.mode == "resume"
    self.task = task or preflight.check(cfg)
    if distributed.is_main():
      run_folder.prepare(cfg, self.plan)
      if self.plan.mode == "restart":
        log.info("%s: the run stopped before its first checkpoint; starting it again", cfg.run_dir)
    distributed.barrier("run_dir")
    self.tok = self.task.tokenizer
    # Prompts are tokenized once (jaxroll.preflight); steps index this list.
    self.train_prompts = self.task.train_tokens
    self.model_cfg, self.graphdef, self.params = build_policy(cfg, self.tok)
    r = cfg.rollout
    self.sampling = SamplingParams(r.temperature, r.top_k, r.top_p)
    self.placement = Placement(cfg)
    # What samples the training rollouts (jaxroll.behaviour); evaluation
    # always samples from the policy itself.
    self.behaviour = make_behaviour(cfg, self.model_cfg, self.graphdef, self.placement)
    self.engine = self._make_engine(self.behaviour.model_cfg, self.behaviour.graphdef)
    self.seq_len = r.max_prompt_len + r.max_new_tokens
    self.rewards = RewardRunner(self.task.reward_fn, cfg.task.reward_timeout_s)
    self.eval_engine, self.eval_rewards = self.engine, self.rewards
    if self.behaviour.model_cfg != self.model_cfg or r.speculative or r.kv_cache != "dense":
      # Evaluation decodes plainly: held-out prompts stay out of the drafts,
      # and accuracy is the policy's own, not a sparse cache's approximation.
      self.eval_engine = self._make_engine(self.model_cfg, self.graphdef, for_training=False)
    if cfg.pipeline.mode != "sync":
      # Evaluation runs while the rollout thread samples: its own engine and
      # reward workers, so the two never share per-call state.
      self.eval_engine = self._make_engine(self.model_cfg, self.graphdef, for_training=False)
      self.eval_rewards = RewardRunner(self.task.reward_fn, cfg.task.reward_timeout_s)
    rl = cfg.rl
    self.tx, self.lr_schedule = adamw_warmup_cosine(
        learning_rate=rl.learning_rate, total_steps=cfg.steps * rl.minibatches,
        warmup_steps=rl.warmup_steps, end_lr_ratio=rl.end_lr_ratio,
        weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm, b1=rl.b1, b2=rl.b2)
    self.placement.set_state(self.params, self.tx)
    # Every host's rows must share one global shape: chunks are per process.
    self.chunked = bool(rl.microbatch_tokens) and not self.multi
    self.update = make_rl_update(cfg, self.graphdef, self.tx, self.sampling, self.placement,
                                 seq_len=self.seq_len, chunked=self.chunked)
    self.batches = IndexBatches(len(self.task.train), r.prompts_per_step, cfg.seed)
    # One id per distinct prompt text (datasets may repeat a prompt in several rows).
    first_row = {}
    self.prompt_ids = [first_row.setdefault(e.prompt, i) for i, e in enumerate(self.task.train)]
    self.key = jax.random.key(cfg.seed)
    self.evaluate = HeldoutEvaluator(self.task, self.eval_engine, self.eval_rewards, cfg.eval_samples,
                                     self.key)
    self.sampler = Sampler(cfg, self.engine, self.train_prompts, self.prompt_ids, self._score,
                           self.batches, self.key)
    self.checkpointer = ckpt_lib.Checkpointer(os.path.join(cfg.run_dir, "checkpoints"),
                                              cfg.keep_checkpoints)
    self.flat_cfg = config_lib.to_flat_dict(cfg)
    self.fingerprint = ckpt_lib.shape_fingerprint(self.flat_cfg, self.params)
    self.counters = {"cumulative_tokens": 0, "cumulative_rollouts": 0, "cumulative_train_s": 0.0}

  def _make_engine(self, model_cfg, graphdef, for_training: bool = True) -> RolloutEngine:
    """The training sampler's engine, or (for_training=False) a plain dense one for evaluation."""
    r = self.cfg.rollout
    if for_training and r.kv_cache == "paged" and self.placement.rollout_mesh is not None:
      raise config_lib.ConfigError("rollout.kv_cache=paged is not yet sharded over a device mesh "
                                   "(a multi-process run samples on one): use rollout.kv_cache=dense")
    return RolloutEngine(model_cfg, graphdef, num_slots=r.num_slots, max_prompt_len=r.max_prompt_len,
                         max_new_tokens=r.max_new_tokens, sampling=self.sampling,
                         stop_token_ids=self.tok.eos_token_ids, mesh=self.placement.rollout_mesh,
                         speculative=spec_from_config(r) if for_training else None, history_per_prompt=r.speculative_history,
                         paged=paged_from_config(r) if for_training else None)

  def publish(self, version: int):
    """The sampler's weights of `version` (the behaviour's view of the
    policy); returns (decode params, bytes moved between meshes)."""
    state, load_kw = self.behaviour.decode_args(self.params, version)
    return self.placement.publish(self.engine, state, version, **load_kw)

  def _eval_params(self, dparams, version: int):
    """The policy alone, for evaluation (the sampler's own when it is the policy)."""
    if self.behaviour.kind == "policy":
      return dparams
    return self.placement.publish(self.eval_engine, self.params, version)[0]

  def _extra(self, sampler_arrays):
    """The arrays a checkpoint keeps beside the parameters."""
    behaviour = self.behaviour.state()
    return sampler_arrays if behaviour is None else {"sampler": sampler_arrays, "behaviour": behaviour}

  # -- phases ------------------------------------------------------------------

  def sampler_state(self) -> dict[str, Any]:
    """What the sampling side has consumed: the data stream's position and
    the sampler's state (fresh copies: the sampler moves on)."""
    return {"data_iterator": self.batches.get_state(), **self.sampler.state()}

  def _meta(self, step: int, sampler: dict[str, Any]) -> dict[str, Any]:
    # Each process samples at its own pace: with several, their states are kept side by side.
    per_process = distributed.gather_json if self.multi else (lambda x: x)
    return {"step": step, "data_iterator": per_process(sampler["data_iterator"]),
            "sampler": per_process(sampler["json"]),
            "prng_key": np.asarray(jax.random.key_data(self.key)).tolist(),
            "counters": dict(self.counters), "fingerprint": self.fingerprint}

  def sample(self, dparams, step: int, feed=None) -> SampledBatch:
    """The step's groups, scored (jaxroll.loop.sampler). `feed`: newer
    weights for an interruptible rollout (jaxroll.loop.drivers)."""
    return self.sampler.run(dparams, step, feed=feed)

  def _score(self, rows, indices):
    """Rewards of generated token rows against the answers of dataset rows `indices`."""
    return self.rewards.score([self.tok.decode(r) for r in rows],
                              [self.task.train[int(i)].answer for i in indices])

  def learn(self, step: int, sample: SampledBatch, opt_state, t0: float):
    """The update of step `step` on a sampled batch, then publication of
    version step + 1. Returns (decode params, opt_state, metrics, timing)."""
    t2 = time.perf_counter()
    prompts = [self.train_prompts[i] for i in sample.indices]
    ub = update_batch(self.cfg, sample, prompts, step, seq_len=self.seq_len, all_rows=self.multi)
    # Before the policy's update, which donates the weights that sampled.
    behaviour_stats = self.behaviour.learn(self.params, ub, sample)
    if self.chunked:
      self.params, opt_state, stats = self.update(self.params, opt_state, ub.packed, self.ref_params,
                                                  ub.lengths_N)
    else:
      self.params, opt_state, stats = self.update(self.params, opt_state,
                                                  self.placement.place_batch(ub.packed), self.ref_params)
      # Scalars, replicated over the mesh: any one device's copy is the value.
      stats = {k: np.asarray(v.addressable_data(0)) for k, v in stats.items()}
    t3 = time.perf_counter()
    # Across processes, the replicated replay state of version step + 1 (before its weights appear).
    self.sampler.reconcile(step, sample)
    dparams, sync_bytes = self.publish(step + 1)
    dparams = jax.block_until_ready(dparams)
    t4 = time.perf_counter()
    metrics, self._trace = step_metrics(
        step, sample, ub, {**stats, **behaviour_stats}, self.prompt_ids, self.counters,
        learning_rate=float(self.lr_schedule((step + 1) * self.cfg.rl.minibatches - 1)),
        weight_sync_bytes=sync_bytes, **self.behaviour.metrics(sample.version))
    step_s = t4 - t0
    self.counters["cumulative_train_s"] += step_s
    timing = {
        "step": step + 1, "rollout_s": sample.rollout_s, "reward_s": sample.reward_s, "update_s": t3 - t2,
        "weight_sync_s": t4 - t3, "step_s": step_s, "rollout_share": sample.rollout_s / step_s,
        "tokens_per_s": metrics["tokens_generated"] / sample.rollout_s,
        "cumulative_train_s": self.counters["cumulative_train_s"],
    }
    return dparams, opt_state, metrics, timing

  # -- the run -----------------------------------------------------------------

  def _write_run_files(self) -> None:
    """config.json and run_info.json at a start; a resume appends to run_info.json."""
    cfg = self.cfg
    if self.resume:
      run_folder.record_resume(cfg.run_dir, self.plan, run_info.git_commit())
      return
    run_folder.write_json_atomic(os.path.join(cfg.run_dir, "config.json"), config_lib.to_dict(cfg))
    run_folder.write_json_atomic(os.path.join(cfg.run_dir, "run_info.json"), {
        **run_info.collect(cfg.seed), "data": self.task.data_stats, "processes": jax.process_count()})

  def _restore(self, opt_state):
    """The newest intact checkpoint's step, state and counters; the logs past it are dropped."""
    cfg = self.cfg
    # Restored straight into the mesh layout (orbax reads each shard where it goes).
    self.params, opt_state = self.placement.place_state(self.params, opt_state)
    restored = self.checkpointer.restore_latest(self.params, opt_state, self.fingerprint,
                                                extra=self._extra(self.sampler.state()["arrays"]))
    start, self.params, opt_state, meta = restored[:4]
    extra = restored[4] if len(restored) > 4 else None
    if self.behaviour.state() is not None:
      self.behaviour.load_state(extra["behaviour"])
      extra = extra["sampler"]
    mine = lambda x: x[jax.process_index()] if isinstance(x, list) else x
    self.sampler.load_state(mine(meta["sampler"]), extra, version=start)
    self.batches.set_state(mine(meta["data_iterator"]))
    self.counters = meta["counters"]
    for stream in ("metrics", "timing", "lengths"):
      path = os.path.join(cfg.run_dir, f"{stream}.jsonl")
      if distributed.is_main() and os.path.exists(path):
        dropped = logger_lib.truncate_after(path, start)
        if dropped:
          log.info("resume: recomputing %d %s records after step %d", dropped, stream, start)
    return start, opt_state

  def _commit(self, step: int, logger, opt_state, sampler=None) -> None:
    """Syncs the step's records, then commits its checkpoint (in that order:
    a checkpoint never runs ahead of the logs it resumes)."""
    logger.sync()
    faults.point("logged")
    sampler = sampler or self.sampler_state()
    self.checkpointer.save(step, self.params, opt_state, self._meta(step, sampler),
                           self._extra(self.sampler.checkpoint_arrays(step, sampler["arrays"])))
    if distributed.is_main():
      run_folder.write_state(self.cfg.run_dir, "training", checkpoint_step=step, steps=self.cfg.steps)

  def _evaluate_logged(self, dparams, step: int) -> dict[str, Any]:
    with Progress.note(f"evaluating step {step}: {len(self.task.heldout)} held-out prompts x "
                       f"{self.cfg.eval_samples} samples", self.cfg.progress and distributed.is_main()):
      out = self.evaluate(dparams)
    faults.point("eval_done")
    return out

  def run(self) -> dict[str, Any]:
    cfg = self.cfg
    main = distributed.is_main()  # writes the run files; all processes checkpoint
    if main:
      self._write_run_files()
      run_folder.write_state(cfg.run_dir, "starting" if not self.resume else "training",
                             checkpoint_step=self.plan.checkpoint_step, steps=cfg.steps)
    faults.point("run_started")
    opt_state = self.tx.init(self.params)
    start = 0
    if self.resume:
      start, opt_state = self._restore(opt_state)
    logger = logger_lib.MetricsLogger(cfg.run_dir, cfg.tensorboard,
                                      purge_step=start + 1 if self.resume else None, enabled=main)
    try:
      if not self.resume:
        if main:
          run_folder.write_state(cfg.run_dir, "warm_start", steps=cfg.steps)
        t0 = time.perf_counter()
        self.params = warm_started_params(self.cfg, self.graphdef, self.params, self.task, logger,
                                          seq_len=self.seq_len, multi=self.multi)
        warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logger.write("metrics", {"step": 0, **self._evaluate_logged(
            self._eval_params(self.publish(0)[0], 0), 0)})
        logger.write("timing", {"step": 0, "warm_start_s": warm_s,
                                "eval_s": time.perf_counter() - t0, "cumulative_train_s": 0.0})
        # Placed before saving: a multi-host checkpoint holds global arrays.
        self.params, opt_state = self.placement.place_state(self.params, opt_state)
      # The KL reference is the policy RL starts from (the warm-started one),
      # saved once under run_dir/reference, before checkpoint 0 commits, for
      # resumed runs.
      self.ref_params = None
      if cfg.rl.kl_coef > 0:
        self.ref_params = self._reference_params()
      if not self.resume:
        self._commit(0, logger, opt_state)
      dparams, _ = self.publish(start)
      progress = Progress(cfg.steps, start, cfg.progress and main)
      progress.last_acc = summary(cfg.run_dir)["final_accuracy"]  # the newest evaluation so far
      done = saved = start
      checkpoint_s = None
      driver = make_driver(self, start, dparams)

      def save_last_completed():
        # Between steps: the parameters are those of step `done`, intact,
        # and its records are written.
        if done > saved:
          self._commit(done, logger, last[0], last[1])

      with StopRequest() as stop:
        try:
          for step in range(start, cfg.steps):
            if stop.requested:
              break
            dparams, opt_state, metrics, timing, sampler = driver.step(step, opt_state)
            faults.point("step_done")
            s = step + 1
            if s % cfg.eval_every == 0 or s == cfg.steps:
              t0 = time.perf_counter()
              # The weights this step published.
              metrics.update(self._evaluate_logged(self._eval_params(dparams, s), s))
              timing["eval_s"] = time.perf_counter() - t0
            # Written before the checkpoint: records past the newest
            # checkpoint are dropped and recomputed on resume.
            logger.write("metrics", metrics)
            logger.write("lengths", self._trace)
            if checkpoint_s is not None:  # the previous step's checkpoint, measured after its record
              timing["prev_checkpoint_s"], checkpoint_s = checkpoint_s, None
            logger.write("timing", timing)
            if s % cfg.checkpoint_every == 0 or s == cfg.steps:
              t0 = time.perf_counter()
              self._commit(s, logger, opt_state, sampler)
              checkpoint_s, saved = time.perf_counter() - t0, s
            progress.update(s, metrics["reward_mean"], timing["tokens_per_s"],
                            metrics.get("heldout_accuracy"))
            done, last = s, (opt_state, sampler)
        except RolloutThreadError:
          save_last_completed()
          raise
        finally:
          driver.close()
        if stop.requested and done < cfg.steps:
          save_last_completed()
          if main:
            run_folder.write_state(cfg.run_dir, "stopped", checkpoint_step=done, steps=cfg.steps)
          log.warning("interrupted after step %d; the checkpoint there resumes the run (--resume)", done)
          raise KeyboardInterrupt
      progress.close()
    finally:
      logger.close()
      self.checkpointer.close()
    distributed.barrier("run_end")
    if not main:
      return {}
    if cfg.report:
      from jaxroll.metrics.report import write_report

      write_report(cfg.run_dir)
    run_folder.write_state(cfg.run_dir, "finished", checkpoint_step=cfg.steps, steps=cfg.steps)
    return summary(cfg.run_dir)

  def _reference_params(self):
    """The warm-started policy, saved once beside the checkpoints for resumes."""
    ref = ckpt_lib.Checkpointer(os.path.join(self.cfg.run_dir, "reference"), keep=1)
    try:
      if self.resume:
        return ref.restore_params(self.params, self.fingerprint)
      ref.save_params(0, self.params, self.fingerprint)
      return jax.tree.map(lambda x: x.copy(), self.params)
    finally:
      ref.close()


def summary(run_dir: str) -> dict[str, Any]:
  """First and last held-out accuracy and the run's cost, from its metrics files."""
  metrics = logger_lib.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  evals = [m for m in metrics if "heldout_accuracy" in m]
  timing = logger_lib.read_jsonl(os.path.join(run_dir, "timing.jsonl"))
  return {"warm_start_accuracy": evals[0]["heldout_accuracy"] if evals else None,
          "final_accuracy": evals[-1]["heldout_accuracy"] if evals else None,
          "steps": metrics[-1]["step"] if metrics else 0,
          "cumulative_tokens": metrics[-1].get("cumulative_tokens", 0) if metrics else 0,
          "cumulative_train_s": timing[-1].get("cumulative_train_s", 0.0) if timing else 0.0}


def train(cfg: config_lib.ExperimentConfig, resume: bool = False,
          plan: run_folder.StartPlan | None = None, task=None) -> dict[str, Any]:
  """Runs (or resumes) the experiment `cfg` into cfg.run_dir; returns its summary."""
  return Trainer(cfg, resume, plan, task).run()
