"""Weight publication between the trainer and the rollout thread.

The trainer publishes each new policy version once its update is done; the
sampler reads the newest, or waits for a version it is not allowed to run
behind. Versions only increase. A `stop` event wakes every waiter, so a
shutdown never leaves a thread blocked here.
"""

from __future__ import annotations

import threading
from typing import Any


class Stopped(Exception):
  """Raised in a waiting thread when the pipeline is shutting down."""


class WeightStore:
  def __init__(self, params: Any, version: int):
    self._cond = threading.Condition()
    self._params, self._version = params, version
    self.stop = threading.Event()

  def publish(self, params: Any, version: int) -> None:
    with self._cond:
      if version <= self._version:
        raise ValueError(f"published version {version} is not newer than {self._version}")
      self._params, self._version = params, version
      self._cond.notify_all()

  @property
  def version(self) -> int:
    with self._cond:
      return self._version

  def wait_for(self, min_version: int, poll_s: float = 0.05) -> tuple[Any, int]:
    """The newest (params, version) once version >= min_version."""
    with self._cond:
      while self._version < min_version:
        if self.stop.is_set():
          raise Stopped()
        self._cond.wait(poll_s)
      return self._params, self._version

  def shutdown(self) -> None:
    self.stop.set()
    with self._cond:
      self._cond.notify_all()
