"""How a run's steps are driven: synchronously, or with the rollout thread.

Both drivers call `sample(dparams, step, feed=None)` (the sampler's run,
jaxroll.loop.sampler) and `learn(step, sample, opt_state, t0, c0)` (the
learner's, jaxroll.loop.learner; t0 and c0 are the step's start on the wall
clock and on the compile clock), and return, per step, what the update produced plus the sampler
state as of that batch (the data stream position, the pool, queue and
predictor, the replay and transform states), which is what a checkpoint
after the step must record: with the thread running ahead, the live
sampler state already includes batches the trainer has not used, and
saving it would skip their prompts on resume. The synchronous driver
returns None: its live state is the step's, and taking a copy every step
would be wasted work.

Phase accounting (timing.jsonl): train_wait_s is the trainer's idle time
waiting for a batch; rollout_idle_s the thread's idle time waiting for
weights or for queue space; rollout_busy_s its time producing the batch.
policy_lag (metrics.jsonl) is the number of versions the batch's first
token trails the update; token_age_* counts every token.
"""

from __future__ import annotations

import time
from typing import Any

from jaxroll.metrics import compile_clock
from jaxroll.pipeline.producer import RolloutProducer
from jaxroll.pipeline.weights import WeightStore


class SyncDriver:
  def __init__(self, sample, learn, dparams):
    self.sample, self.learn, self.dparams = sample, learn, dparams

  def step(self, step: int, opt_state):
    t0, c0 = time.perf_counter(), compile_clock.read()
    sample = self.sample(self.dparams, step)
    sampled = time.perf_counter()
    self.dparams, opt_state, metrics, timing = self.learn(step, sample, opt_state, t0, c0)
    metrics["policy_lag"] = 0
    timing.update(train_wait_s=sampled - t0, rollout_idle_s=time.perf_counter() - sampled,
                  rollout_busy_s=sampled - t0)
    # Nothing is sampled ahead: the live sampler state is this step's (None).
    return self.dparams, opt_state, metrics, timing, None

  def close(self) -> None:
    pass


class _Feed:
  """Newer weights for an interruptible rollout: `changed()` when the store
  holds a version newer than the one in use, `take()` to switch to it."""

  def __init__(self, store: WeightStore, version: int):
    self.store, self.version = store, version

  def changed(self) -> bool:
    return self.store.version > self.version

  def take(self):
    params, self.version = self.store.wait_for(self.version)
    return params


class AsyncDriver:
  """The rollout thread samples ahead, at most cfg.pipeline.max_lag versions."""

  def __init__(self, cfg, sample_fn, learn, snapshot, start: int, dparams):
    self.learn, self.max_lag = learn, cfg.pipeline.max_lag
    self.store = WeightStore(dparams, start)
    interruptible = cfg.pipeline.mode == "interrupt"

    def sample(params, step: int, version: int):
      feed = _Feed(self.store, version) if interruptible else None
      return sample_fn(params, step, feed=feed)

    self.producer = RolloutProducer(sample, self.store, start=start, end=cfg.steps,
                                    max_lag=self.max_lag, snapshot_fn=snapshot)
    self.producer.start()

  def step(self, step: int, opt_state):
    t0, c0 = time.perf_counter(), compile_clock.read()
    batch = self.producer.get()
    waited = time.perf_counter() - t0
    lag = step - batch.version
    if batch.step != step or not 0 <= lag <= self.max_lag:
      raise AssertionError(f"batch for step {batch.step} from version {batch.version} reached "
                           f"update {step} (max_lag={self.max_lag})")
    dparams, opt_state, metrics, timing = self.learn(step, batch.sample, opt_state, t0, c0)
    self.store.publish(dparams, step + 1)  # the thread may start its next batch now
    metrics["policy_lag"] = lag
    timing.update(train_wait_s=waited, rollout_idle_s=batch.idle_s, rollout_busy_s=batch.busy_s)
    return dparams, opt_state, metrics, timing, batch.snapshot

  def close(self) -> None:
    self.producer.close()


def make_driver(cfg, sample, learn, snapshot, start: int, dparams) -> Any:
  """`snapshot()`: the sampler state as of the batch just produced (async only)."""
  if cfg.pipeline.mode == "sync":
    return SyncDriver(sample, learn, dparams)
  return AsyncDriver(cfg, sample, learn, snapshot, start, dparams)
