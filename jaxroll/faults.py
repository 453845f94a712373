"""Fault injection: SIGKILL the process at a named point of the loop.

`JAXROLL_FAULT=<point>[:<n>]` kills the process the n-th time (default
the first) it reaches `<point>`, so that the narrow windows of the run
folder's lifecycle (a checkpoint half written, logs written but not yet
checkpointed) are tested by construction instead of by lucky timing.
Unset, every hook is a dictionary lookup. The points:

  run_started          config.json and run_info.json written
  warm_start_step      after each supervised warm-start step
  warm_start_saved     the warm-started policy committed to run_dir/warm_start
  eval_done            after an evaluation, before its metrics are logged
  step_done            after an RL step's update, before evaluation and logs
  logged               a step's records written, before its checkpoint
  checkpoint_write     while orbax writes a checkpoint (a watcher thread
                       kills once the step's files start to appear)
  checkpoint_saved     orbax finished, the manifest not yet written
  checkpoint_committed the manifest written, old checkpoints not yet deleted
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

ENV = "JAXROLL_FAULT"
_counts: dict[str, int] = {}


def _armed(name: str) -> bool:
  """True when this arrival at `name` is the one JAXROLL_FAULT names."""
  spec = os.environ.get(ENV)
  if not spec:
    return False
  point, _, n = spec.partition(":")
  if point != name:
    return False
  _counts[name] = _counts.get(name, 0) + 1
  return _counts[name] == int(n or 1)


def _kill() -> None:
  os.kill(os.getpid(), signal.SIGKILL)


def point(name: str) -> None:
  """Kills the process here when JAXROLL_FAULT names this arrival."""
  if _armed(name):
    _kill()


@contextlib.contextmanager
def killed_during(name: str, folder: str):
  """Around a write into `folder`: when armed, a watcher kills the process
  as soon as a new file appears under `folder` (mid-write), or at the end
  of the block if the write finished first."""
  if not _armed(name):
    yield
    return
  before = {os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs}
  done = threading.Event()

  def watch():
    while not done.is_set():
      for r, _, fs in os.walk(folder):
        if any(os.path.join(r, f) not in before for f in fs):
          _kill()
      time.sleep(0.001)

  threading.Thread(target=watch, daemon=True).start()
  try:
    yield
  finally:
    done.set()
  _kill()
