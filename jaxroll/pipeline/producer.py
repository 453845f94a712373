"""The rollout thread: produces step u's batch from weights at most k versions old.

Update u (0-based) starts from policy version u (the weights after u
updates). Before it starts batch u, the producer waits until version
u - k is published, then samples with the newest version v >= u - k, so
every batch enters its update with lag u - v <= k: nothing has to be
dropped for being too old. k = 0 is the synchronous schedule run through
the thread; k = 1 is one-step off-policy (batch u + 1 is sampled while
update u runs). Batches are consumed in step order.

JAX dispatches work asynchronously and releases the GIL while XLA runs,
so the sampler's decode and the trainer's update overlap on the device(s).

A failure in the thread is handed to the trainer, which re-raises it
(the original traceback attached as the cause); `close` stops the thread
from any state, so a crash or Ctrl-C never leaves the run hanging.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

from jaxroll.pipeline.weights import Stopped, WeightStore


class RolloutThreadError(RuntimeError):
  """The rollout thread failed; the original exception is the cause."""


@dataclasses.dataclass
class Batch:
  step: int  # the update it is for
  version: int  # the policy version sampling started with
  sample: Any  # what sample_fn returned
  snapshot: Any  # sampler-side state after this batch (what a checkpoint at step + 1 saves)
  idle_s: float  # the thread's wait since its previous batch: for weights, or for queue space
  busy_s: float  # time spent producing it


_FAILED = object()


class RolloutProducer:
  """Args:
    sample_fn: (params, step, version) -> sample; runs in the thread.
    store: the WeightStore the trainer publishes to.
    start, end: the steps to produce.
    max_lag: k, the most versions a batch may trail its update.
    snapshot_fn: () -> sampler-side state, taken after each batch.
  """

  def __init__(self, sample_fn: Callable[[Any, int, int], Any], store: WeightStore, *, start: int,
               end: int, max_lag: int, snapshot_fn: Callable[[], Any] = lambda: None):
    if max_lag < 0:
      raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    self.sample_fn, self.store, self.snapshot_fn = sample_fn, store, snapshot_fn
    self.start_step, self.end, self.max_lag = start, end, max_lag
    # Batches ready ahead of the trainer: at most k (one when synchronous).
    self.queue: queue.Queue = queue.Queue(maxsize=max(1, max_lag))
    self.error: BaseException | None = None
    self.thread = threading.Thread(target=self._run, name="jaxroll-rollout", daemon=True)

  def start(self) -> "RolloutProducer":
    self.thread.start()
    return self

  def _put(self, item) -> None:
    while True:
      try:
        self.queue.put(item, timeout=0.05)
        return
      except queue.Full:
        if self.store.stop.is_set():
          raise Stopped() from None

  def _run(self) -> None:
    try:
      since = time.perf_counter()
      for u in range(self.start_step, self.end):
        params, version = self.store.wait_for(u - self.max_lag)
        t0 = time.perf_counter()
        sample = self.sample_fn(params, u, version)
        t1 = time.perf_counter()
        batch = Batch(u, version, sample, self.snapshot_fn(), idle_s=t0 - since, busy_s=t1 - t0)
        self._put(batch)
        since = t1
    except Stopped:
      return
    except BaseException as e:  # handed to the trainer, which re-raises it
      self.error = e
      try:
        self.queue.put_nowait(_FAILED)
      except queue.Full:
        pass  # `get` sees the dead thread and the recorded error

  def get(self, poll_s: float = 0.05) -> Batch:
    """The next batch, in step order; raises RolloutThreadError if the thread failed."""
    while True:
      try:
        item = self.queue.get(timeout=poll_s)
      except queue.Empty:
        if not self.thread.is_alive():
          self._raise()
        continue
      if item is _FAILED:
        self._raise()
      return item

  def _raise(self):
    if self.error is not None:
      raise RolloutThreadError(f"the rollout thread failed: {self.error!r}") from self.error
    raise RolloutThreadError("the rollout thread stopped before producing every batch")

  def close(self, timeout_s: float = 60.0) -> None:
    """Stops the thread (it finishes the batch in hand, if any) and waits for it."""
    self.store.shutdown()
    while True:  # unblock a producer waiting for queue space
      try:
        self.queue.get_nowait()
      except queue.Empty:
        break
    self.thread.join(timeout_s)
