"""Projects a synchronous run's measured phases onto an accelerator layout.

Two CPU cores cannot show rollout/training overlap: both sides share the
same cores, so running them at once only slows each. What overlap buys on
separate devices follows from the phases measured without contention, in
a synchronous run:

  t_decode  seconds per decode step (rollout_s / rollout_makespan_steps),
  U         seconds per update of one step's batch,
  the recorded response lengths (lengths.jsonl).

Layout of D devices, each with the run's rollout.num_slots decode slots,
serving a batch `scale` times the recorded one (consecutive recorded
steps merged, as `jaxroll simulate --steps-per-batch` does):

  R(a) = t_decode * FIFO makespan of the batch on a * slots workers
  U(b) = U * scale / b                      (data-parallel update)

  colocated sync:     R(D) + U(D)           (every device does both, in turn)
  disaggregated sync: min over a of R(a) + U(D - a)
  disaggregated async (max_lag >= 1): min over a of max(R(a), U(D - a))

Assumptions, stated because the projection rests on them: a decode step
costs the same however many of a device's slots are busy (decode is
memory-bound), updates scale linearly, and weight transfer between the
two sides is not counted.
"""

from __future__ import annotations

import json
import os
import statistics

from jaxroll.metrics.logger import read_jsonl
from jaxroll.scheduling.makespan import list_schedule


def _batches(trace: list[dict], scale: int) -> list[list[float]]:
  out = []
  for i in range(0, len(trace) - scale + 1, scale):
    out.append([x for r in trace[i:i + scale] for x in r["lengths"]])
  return out


def project_layouts(run_dir: str, devices: int = 8, scale: int | None = None) -> dict:
  """Median per-step seconds of the three layouts (see the module doc)."""
  if devices < 2:
    raise ValueError(f"devices must be >= 2 (one per side at least), got {devices}")
  scale = devices if scale is None else scale
  with open(os.path.join(run_dir, "config.json")) as f:
    slots = json.load(f)["rollout"]["num_slots"]
  metrics = {m["step"]: m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
  timing = [t for t in read_jsonl(os.path.join(run_dir, "timing.jsonl")) if "update_s" in t]
  steady = timing[1:] or timing  # the first step includes compilation
  t_decode = statistics.median(t["rollout_s"] / max(1, metrics[t["step"]]["rollout_makespan_steps"])
                               for t in steady)
  update_s = statistics.median(t["update_s"] for t in steady)
  batches = _batches(read_jsonl(os.path.join(run_dir, "lengths.jsonl"))[1:], scale)
  if not batches:
    raise ValueError(f"{run_dir}: fewer than {scale} recorded steps to merge")

  def rollout(a: int) -> float:
    return t_decode * statistics.median(list_schedule(b, a * slots).makespan for b in batches)

  def update(b: int) -> float:
    return update_s * scale / b

  splits = range(1, devices)
  sync_a = min(splits, key=lambda a: rollout(a) + update(devices - a))
  async_a = min(splits, key=lambda a: max(rollout(a), update(devices - a)))
  out = {
      "devices": devices, "scale": scale, "t_decode_s": t_decode, "update_s": update_s,
      "colocated_sync_s": rollout(devices) + update(devices),
      "disaggregated_sync_s": rollout(sync_a) + update(devices - sync_a), "sync_rollout_devices": sync_a,
      "disaggregated_async_s": max(rollout(async_a), update(devices - async_a)),
      "async_rollout_devices": async_a,
  }
  out["async_vs_colocated"] = out["colocated_sync_s"] / out["disaggregated_async_s"]
  out["async_vs_disaggregated_sync"] = out["disaggregated_sync_s"] / out["disaggregated_async_s"]
  return out
