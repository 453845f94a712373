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

from jaxroll import config as config_lib
from jaxroll import compile_cache, distributed, faults, preflight, run_folder, run_info
from jaxroll.behaviour import make_behaviour
from jaxroll.data import IndexBatches
from jaxroll.evaluation import HeldoutEvaluator
from jaxroll.loop.drivers import make_driver
from jaxroll.loop.engines import make_engines
from jaxroll.loop.learner import Learner
from jaxroll.loop.placement import Placement
from jaxroll.loop.run_checkpoints import RunCheckpoints
from jaxroll.loop.sampler import Sampler
from jaxroll.metrics import logger as logger_lib
from jaxroll.metrics.progress import Progress
from jaxroll.pipeline.producer import RolloutThreadError
from jaxroll.pipeline.stop import StopRequest
from jaxroll.rollout import SamplingParams
from jaxroll.task_setup import build_policy
from jaxroll.warm_start_phase import warm_started_params

log = logging.getLogger(__name__)


class Trainer:
  """One run: its folder, the sampler and learner sides of the loop
  (jaxroll.loop), checkpoints and evaluation; `run()` executes it."""

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
    self.task = task = task or preflight.check(cfg)
    compile_cache.enable(cfg.compile_cache)  # before the first program compiles
    if distributed.is_main():
      run_folder.prepare(cfg, self.plan)
      if self.plan.mode == "restart":
        log.info("%s: the run stopped before its first checkpoint; starting it again", cfg.run_dir)
    distributed.barrier("run_dir")
    self.model_cfg, self.graphdef, params = build_policy(cfg, task.tokenizer)
    r = cfg.rollout
    sampling = SamplingParams(r.temperature, r.top_k, r.top_p)
    self.placement = Placement(cfg)
    # What samples the training rollouts (jaxroll.behaviour); evaluation
    # always samples from the policy itself.
    self.behaviour = make_behaviour(cfg, self.model_cfg, self.graphdef, self.placement)
    self.engines = make_engines(cfg, task, sampling, self.placement.rollout_mesh, self.behaviour,
                                self.model_cfg, self.graphdef)
    self.seq_len = r.max_prompt_len + r.max_new_tokens
    self.batches = IndexBatches(len(task.train), r.prompts_per_step, cfg.seed)
    # One id per distinct prompt text (datasets may repeat a prompt in several rows).
    first_row = {}
    prompt_ids = [first_row.setdefault(e.prompt, i) for i, e in enumerate(task.train)]
    self.key = jax.random.key(cfg.seed)
    self.evaluate = HeldoutEvaluator(task, self.engines.eval, self.engines.eval_rewards,
                                     cfg.eval_samples, self.key)
    # Prompts are tokenized once (jaxroll.preflight); steps index this list.
    self.sampler = Sampler(cfg, self.engines.train, task.train_tokens, prompt_ids, self._score,
                           self.batches, self.key)
    self.learner = Learner(cfg, self.graphdef, params, sampling, self.placement, self.behaviour,
                           self.engines.train, seq_len=self.seq_len, train_prompts=task.train_tokens,
                           prompt_ids=prompt_ids, settle=self.sampler.reconcile)
    self.checkpoints = RunCheckpoints(cfg, self.learner, self.sampler, self.batches, self.behaviour,
                                      self.key)

  def _score(self, rows, indices):
    """Rewards of generated token rows against the answers of dataset rows `indices`."""
    tok, train = self.task.tokenizer, self.task.train
    return self.engines.rewards.score([tok.decode(r) for r in rows],
                                      [train[int(i)].answer for i in indices])

  def eval_params(self, dparams, version: int):
    """The policy alone, for evaluation (the sampler's own when it is the policy)."""
    if self.behaviour.kind == "policy":
      return dparams
    return self.placement.publish(self.engines.eval, self.learner.params, version)[0]

  def _evaluate_logged(self, dparams, step: int) -> dict[str, Any]:
    with Progress.note(f"evaluating step {step}: {len(self.task.heldout)} held-out prompts x "
                       f"{self.cfg.eval_samples} samples", self.cfg.progress and distributed.is_main()):
      out = self.evaluate(self.eval_params(dparams, step))
    faults.point("eval_done")
    return out

  def _write_run_files(self) -> None:
    """config.json and run_info.json at a start; a resume appends to run_info.json."""
    cfg = self.cfg
    if self.resume:
      run_folder.record_resume(cfg.run_dir, self.plan, run_info.git_commit())
      return
    run_folder.write_json_atomic(os.path.join(cfg.run_dir, "config.json"), config_lib.to_dict(cfg))
    run_folder.write_json_atomic(os.path.join(cfg.run_dir, "run_info.json"), {
        **run_info.collect(cfg.seed), "data": self.task.data_stats, "processes": jax.process_count()})

  def _warm_start(self, logger, opt_state):
    """The supervised phase, then the evaluation of step 0."""
    cfg, learner = self.cfg, self.learner
    if distributed.is_main():
      run_folder.write_state(cfg.run_dir, "warm_start", steps=cfg.steps)
    t0 = time.perf_counter()
    learner.params = warm_started_params(cfg, self.graphdef, learner.params, self.task, logger,
                                         seq_len=self.seq_len, multi=self.multi)
    warm_s = time.perf_counter() - t0
    # Placed before saving (a multi-host checkpoint holds global arrays) and
    # before the first evaluation, so that it samples from weights placed as
    # every later one's are (programs compiled for it serve them all).
    learner.params, opt_state = self.placement.place_state(learner.params, opt_state)
    t0 = time.perf_counter()
    logger.write("metrics", {"step": 0, **self._evaluate_logged(learner.publish(0)[0], 0)})
    logger.write("timing", {"step": 0, "warm_start_s": warm_s, "eval_s": time.perf_counter() - t0,
                            "cumulative_train_s": 0.0, "cumulative_steady_s": 0.0})
    return opt_state

  def run(self) -> dict[str, Any]:
    cfg, learner = self.cfg, self.learner
    main = distributed.is_main()  # writes the run files; all processes checkpoint
    if main:
      self._write_run_files()
      run_folder.write_state(cfg.run_dir, "starting" if not self.resume else "training",
                             checkpoint_step=self.plan.checkpoint_step, steps=cfg.steps)
    faults.point("run_started")
    opt_state = learner.tx.init(learner.params)
    start = 0
    if self.resume:
      start, opt_state = self.checkpoints.restore(opt_state)
    logger = logger_lib.MetricsLogger(cfg.run_dir, cfg.tensorboard,
                                      purge_step=start + 1 if self.resume else None, enabled=main)
    try:
      if not self.resume:
        opt_state = self._warm_start(logger, opt_state)
      # The KL reference is the policy RL starts from (the warm-started one).
      if cfg.rl.kl_coef > 0:
        learner.ref_params = self.checkpoints.reference_params(self.resume)
      if not self.resume:
        self.checkpoints.commit(0, logger, opt_state)
      self._steps(start, opt_state, logger)
    finally:
      logger.close()
      self.checkpoints.close()
    distributed.barrier("run_end")
    if not main:
      return {}
    if cfg.report:
      from jaxroll.metrics.report import write_report

      write_report(cfg.run_dir)
    run_folder.write_state(cfg.run_dir, "finished", checkpoint_step=cfg.steps, steps=cfg.steps)
    return summary(cfg.run_dir)

  def _steps(self, start: int, opt_state, logger) -> None:
    """Steps start+1 .. cfg.steps: sample, learn, evaluate, record, checkpoint."""
    cfg, main = self.cfg, distributed.is_main()
    dparams, _ = self.learner.publish(start)
    progress = Progress(cfg.steps, start, cfg.progress and main)
    progress.last_acc = summary(cfg.run_dir)["final_accuracy"]  # the newest evaluation so far
    done = saved = start
    last = (opt_state, None)
    checkpoint_s = None
    driver = make_driver(cfg, self.sampler.run, self.learner.learn, self.checkpoints.sampler_state,
                         start, dparams)

    def save_last_completed():
      # Between steps: the parameters are those of step `done`, intact, and its records are written.
      if done > saved:
        self.checkpoints.commit(done, logger, *last)

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
            metrics.update(self._evaluate_logged(dparams, s))  # the weights this step published
            timing["eval_s"] = time.perf_counter() - t0
          # Written before the checkpoint: records past the newest
          # checkpoint are dropped and recomputed on resume.
          logger.write("metrics", metrics)
          logger.write("lengths", self.learner.trace)
          if checkpoint_s is not None:  # the previous step's checkpoint, measured after its record
            timing["prev_checkpoint_s"], checkpoint_s = checkpoint_s, None
          logger.write("timing", timing)
          if s % cfg.checkpoint_every == 0 or s == cfg.steps:
            t0 = time.perf_counter()
            self.checkpoints.commit(s, logger, opt_state, sampler)
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
