"""Per-step metric records to JSONL files and TensorBoard.

Two streams, so that a run's learning record is reproducible byte for byte:
`metrics.jsonl` holds what depends only on the config and seed (rewards,
lengths, tokens, losses); `timing.jsonl` holds what the machine decides
(phase seconds, throughput). Both carry the step, and the report joins them.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any


def _clean(record: dict[str, Any]) -> dict[str, Any]:
  out = {}
  for k, v in record.items():
    if hasattr(v, "item"):
      v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
      v = None  # JSON has no NaN/inf; None marks it
    out[k] = v
  return out


def read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_after(path: str, step: int) -> int:
  """Drops records with step > `step` (a resumed run recomputes them),
  and a last line cut short by a kill mid-write. The lines kept are kept
  byte for byte.

  Returns the number of records dropped.
  """
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  keep = []
  for i, line in enumerate(lines):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if i == len(lines) - 1:  # the record a kill interrupted
        break
      raise
    if record["step"] <= step:
      keep.append(line if line.endswith("\n") else line + "\n")
  with open(path + ".tmp", "w") as f:
    f.writelines(keep)
  os.replace(path + ".tmp", path)
  return len(lines) - len(keep)


class MetricsLogger:
  """Appends records to `<run>/<stream>.jsonl` and mirrors scalars to TensorBoard.

  Args:
    run_dir: the run folder.
    tensorboard: write event files under `<run>/tb` (tensorboardX).
    purge_step: on resume, the first step being recomputed; TensorBoard
      then hides the earlier events at and after it.
    enabled: False makes every write a no-op (processes other than the
      first in a multi-host run).
  """

  def __init__(self, run_dir: str, tensorboard: bool = True, purge_step: int | None = None,
               enabled: bool = True):
    self.run_dir = run_dir
    self.enabled = enabled
    self._files = {}
    self._tb = None
    if tensorboard and enabled:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=purge_step)

  def write(self, stream: str, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    record = _clean(record)
    if stream not in self._files:
      self._files[stream] = open(os.path.join(self.run_dir, f"{stream}.jsonl"), "a")
    f = self._files[stream]
    f.write(json.dumps(record) + "\n")
    # Flushed per record: a killed run keeps every step it completed.
    f.flush()
    if self._tb is not None:
      step = record.get("step", 0)
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(f"{stream}/{k}", v, step)

  def sync(self) -> None:
    """Makes every record written so far durable (before a checkpoint commits)."""
    for f in self._files.values():
      f.flush()
      os.fsync(f.fileno())
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    for f in self._files.values():
      f.close()
    if self._tb is not None:
      self._tb.close()
