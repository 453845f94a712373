"""The learner side of a step: the policy's parameters, its optimiser and
RL update, and the publication of each new version to the sampler.

`Learner.learn` is one update, in this order: the sampled batch crosses
the host boundary (jaxroll.loop.update_batch), the behaviour updates its
own state (R2PO's head) before the policy's update donates the weights
that sampled, the policy updates, the replicated replay state of the next
version is settled (jaxroll.loop.shared_state, several processes), that
version is published, and the step's record is made
(jaxroll.loop.step_metrics).
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np

from jaxroll.loop.kv_budget import KVBudgetController
from jaxroll.loop.sampler import SampledBatch
from jaxroll.loop.step_metrics import step_metrics
from jaxroll.loop.update_batch import update_batch
from jaxroll.metrics import compile_clock
from jaxroll.replay import registry
from jaxroll.rl.chunked_update import make_chunked_update
from jaxroll.rl.optim import adamw_warmup_cosine
from jaxroll.rl.train_step import make_update


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
                               skip_zero_advantage=rl.skip_zero_advantage,
                               row_multiple=placement.row_multiple, place=placement.place_batch)
  return make_update(graphdef, tx, **args)


def fresh_counters() -> dict:
  """A run's cost counters before its first step (what a checkpoint saves)."""
  return {"cumulative_tokens": 0, "cumulative_rollouts": 0, "cumulative_train_s": 0.0,
          "cumulative_compile_s": 0.0}


class Learner:
  """Owns the policy's parameters (`params`), its KL reference
  (`ref_params`), the run's cost counters and the sparse KV budget
  (`kv_budget`, jaxroll.loop.kv_budget), which each publication carries;
  the optimiser state is the caller's, passed through each step.

  `settle(step, sample)`: what must happen between the update and the
  publication of version step + 1 (the sampler's reconcile).
  """

  def __init__(self, cfg, graphdef, params, sampling, placement, behaviour, engine, *,
               seq_len: int, train_prompts, prompt_ids, settle: Callable[[int, SampledBatch], None]):
    self.cfg, self.placement, self.behaviour, self.engine = cfg, placement, behaviour, engine
    self.seq_len, self.train_prompts, self.prompt_ids, self.settle = seq_len, train_prompts, prompt_ids, settle
    self.multi = jax.process_count() > 1
    rl = cfg.rl
    self.tx, self.lr_schedule = adamw_warmup_cosine(
        learning_rate=rl.learning_rate, total_steps=cfg.steps * rl.minibatches,
        warmup_steps=rl.warmup_steps, end_lr_ratio=rl.end_lr_ratio,
        weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm, b1=rl.b1, b2=rl.b2)
    # The logged learning rate, from one small program (called eagerly, the
    # schedule's every array op compiled on its own at the first step).
    self._lr_at = jax.jit(self.lr_schedule)
    placement.set_state(params, self.tx)
    # Every host's rows must share one global shape: chunks are per process.
    self.chunked = bool(rl.microbatch_tokens) and not self.multi
    self.update = make_rl_update(cfg, graphdef, self.tx, sampling, placement, seq_len=seq_len,
                                 chunked=self.chunked)
    self.params, self.ref_params = params, None
    self.kv_budget = KVBudgetController(cfg.rollout)
    self.counters = fresh_counters()
    self.trace = None  # the last step's length trace (lengths.jsonl)

  def publish(self, version: int):
    """The sampler's weights of `version` (the behaviour's view of the
    policy); returns (decode params, bytes moved between meshes)."""
    state, load_kw = self.behaviour.decode_args(self.params, version)
    return self.placement.publish(self.engine, state, version, **load_kw,
                                  **self.kv_budget.publish_kw(version))

  def learn(self, step: int, sample: SampledBatch, opt_state, t0: float, c0: compile_clock.Reading):
    """Update `step` on a sampled batch, then publication of version
    step + 1; the step began at t0 on the wall clock and c0 on the compile
    clock (a compile_clock.Reading). Returns (decode params, opt_state, metrics, timing)."""
    t2, c2 = time.perf_counter(), compile_clock.read()
    prompts = [self.train_prompts[i] for i in sample.indices]
    ub = update_batch(self.cfg, sample, prompts, step, seq_len=self.seq_len, all_rows=self.multi)
    behaviour_stats = self.behaviour.learn(self.params, ub, sample)
    if self.chunked:
      self.params, opt_state, stats = self.update(self.params, opt_state, ub.packed, self.ref_params,
                                                  ub.lengths_N)
    else:
      self.params, opt_state, stats = self.update(self.params, opt_state,
                                                  self.placement.place_batch(ub.packed), self.ref_params)
      # Scalars, replicated over the mesh: any one device's copy is the value.
      stats = {k: np.asarray(v.addressable_data(0)) for k, v in stats.items()}
    t3, c3 = time.perf_counter(), compile_clock.read()
    self.kv_budget.observe(stats)
    self.settle(step, sample)
    dparams, sync_bytes = self.publish(step + 1)
    dparams = jax.block_until_ready(dparams)
    t4 = time.perf_counter()
    metrics, self.trace = step_metrics(
        step, sample, ub, {**stats, **behaviour_stats}, self.prompt_ids, self.counters,
        learning_rate=float(self._lr_at((step + 1) * self.cfg.rl.minibatches - 1)),
        weight_sync_bytes=sync_bytes, **self.behaviour.metrics(sample.version),
        **self.kv_budget.metrics(sample.version))
    step_s = t4 - t0
    # Preparing programs (tracing, lowering, compiling) is a one-time cost
    # that a short run pays in full and a long one amortises: C(q) in
    # seconds is reported with and without it. The clock is process-wide,
    # so in async mode it also counts what the rollout thread prepared
    # while the learner worked (hence the cap).
    c4 = compile_clock.read()
    step_compile_s = min(c4.prepare_s - c0.prepare_s, step_s)
    self.counters["cumulative_train_s"] += step_s
    self.counters["cumulative_compile_s"] += step_compile_s
    timing = {
        "step": step + 1, "rollout_s": sample.rollout_s, "reward_s": sample.reward_s, "update_s": t3 - t2,
        "update_compile_s": c3.prepare_s - c2.prepare_s,
        "weight_sync_s": t4 - t3, "step_s": step_s, "rollout_share": sample.rollout_s / step_s,
        "tokens_per_s": metrics["tokens_generated"] / sample.rollout_s,
        "step_compile_s": step_compile_s,
        "step_xla_compile_s": min(c4.xla_compile_s - c0.xla_compile_s, step_compile_s),
        "cumulative_train_s": self.counters["cumulative_train_s"],
        "cumulative_compile_s": self.counters["cumulative_compile_s"],
        "cumulative_steady_s": self.counters["cumulative_train_s"] - self.counters["cumulative_compile_s"],
    }
    return dparams, opt_state, metrics, timing
