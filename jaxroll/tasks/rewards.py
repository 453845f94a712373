"""Runs plain reward functions under a timeout; failures score 0 and are counted."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import time
from typing import Sequence

from jaxroll.tasks.base import RewardFn

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RewardReport:
  rewards: list[float]
  num_errors: int  # the reward function raised (or returned a non-number)
  num_timeouts: int  # it ran past the timeout


class RewardRunner:
  """Scores completions with `fn(completion, answer)`, never letting it kill a run.

  Each call runs in a worker thread and is waited on for `timeout_s`. A call
  that raises, returns something that is not a finite number, or runs past
  the deadline scores 0.0 for that trajectory and is counted in the report.
  A Python thread cannot be killed, so a timed-out call is abandoned: the
  pool is replaced and the stuck thread is left to finish on its own.

  Example:
    runner = RewardRunner(mod_walk.reward, timeout_s=1.0)
    report = runner.score(["8 11 14"], ["8 11 14"])  # report.rewards == [1.0]
  """

  def __init__(self, fn: RewardFn, timeout_s: float = 5.0, num_workers: int = 4):
    if timeout_s <= 0:
      raise ValueError(f"reward timeout must be positive, got {timeout_s}")
    self.fn = fn
    self.timeout_s = timeout_s
    self.num_workers = num_workers
    self._pool = self._new_pool()

  def _new_pool(self):
    return cf.ThreadPoolExecutor(self.num_workers, thread_name_prefix="jaxroll-reward")

  def score(self, completions: Sequence[str], answers: Sequence[str]) -> RewardReport:
    if len(completions) != len(answers):
      raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    started: dict[int, float] = {}

    def call(i):
      started[i] = time.monotonic()
      return self.fn(completions[i], answers[i])

    pending = {i: self._pool.submit(call, i) for i in range(len(completions))}
    rewards = [0.0] * len(completions)
    errors = timeouts = 0
    while pending:
      cf.wait(list(pending.values()), timeout=min(0.05, self.timeout_s),
              return_when=cf.FIRST_COMPLETED)
      now = time.monotonic()
      for i, fut in list(pending.items()):
        if fut.done():
          del pending[i]
          try:
            value = float(fut.result())
            if not math.isfinite(value):
              raise ValueError(f"reward returned {value}")
            rewards[i] = value
          except Exception as e:  # noqa: BLE001 - any reward failure scores 0 and is counted
            errors += 1
            if errors == 1:
              log.warning("reward function raised on trajectory %d: %r (scored 0)", i, e)
        elif i in started and now - started[i] > self.timeout_s:
          del pending[i]
          timeouts += 1
      if timeouts and any(i not in started for i in pending):
        # Stuck workers would starve the queue: move calls that have not
        # started to a fresh pool and abandon the old one.
        old, self._pool = self._pool, self._new_pool()
        for i in [i for i in pending if i not in started]:
          if pending[i].cancel():
            pending[i] = self._pool.submit(call, i)
        old.shutdown(wait=False)
    if timeouts:
      self._pool.shutdown(wait=False)
      self._pool = self._new_pool()
    return RewardReport(rewards, errors, timeouts)
