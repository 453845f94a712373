"""Ctrl-C as a request to stop at the next step boundary.

A step in progress finishes (its update, metrics and, where due, its
checkpoint), then the run saves a checkpoint of the last completed step
and stops: a resumable state instead of one lost mid-update. A second
Ctrl-C stops at once, as Python's default does. Only the main thread can
install signal handlers; elsewhere this does nothing.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class StopRequest:
  def __init__(self):
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    log.warning("stopping after the current step (Ctrl-C again to stop now)")

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
