"""Projects a recorded run's rollout onto other worker counts and schedules.

Reads run_dir/lengths.jsonl (per RL step: each trajectory's prompt id and
response length, group by group) and simulates each step's requests on
`workers` workers under each admission order; the history predictor for
`lpt_predicted` only sees earlier steps. `steps_per_batch` merges that many
consecutive steps into one batch, to project a cluster running a batch that
many times larger; `over_provision` > 1 adds APRIL-style partial rollout
with carry-over (longest remaining first) on the same stream of groups.
"""

from __future__ import annotations

import json
import os
import statistics

import numpy as np

from jaxroll.metrics.logger import read_jsonl
from jaxroll.run_folder import RunFolderError
from jaxroll.scheduling.length_predictor import HistoryLengthPredictor, prediction_error
from jaxroll.scheduling.makespan import ORDERS, list_schedule, order_for, partial_rollout_steps


def _group_size(run_dir: str, group_size: int | None) -> int:
  if group_size:
    return group_size
  path = os.path.join(run_dir, "config.json")
  if not os.path.isfile(path):
    raise RunFolderError(f"{path}: missing; it gives the run's group size (or pass group_size)")
  with open(path) as f:
    return int(json.load(f)["rollout"]["group_size"])


def _merge(trace: list[dict], k: int) -> list[dict]:
  if k < 1:
    raise ValueError(f"steps_per_batch must be >= 1, got {k}")
  out = []
  for i in range(0, len(trace) - k + 1, k):
    part = trace[i:i + k]
    out.append({"step": part[0]["step"], "prompt_ids": sum((r["prompt_ids"] for r in part), []),
                "lengths": sum((r["lengths"] for r in part), [])})
  return out


def simulate_run(run_dir: str, workers: int, window: int = 4, seed: int = 0,
                 steps_per_batch: int = 1, over_provision: float = 1.25,
                 group_size: int | None = None) -> dict:
  trace = read_jsonl(os.path.join(run_dir, "lengths.jsonl"))
  if not trace:
    raise RunFolderError(f"{run_dir}/lengths.jsonl: no length trace; pass a run folder that "
                         "`jaxroll train` wrote (it records one per step)")
  G = _group_size(run_dir, group_size)
  batches = _merge(trace, steps_per_batch)
  if not batches:
    raise RunFolderError(f"the trace has {len(trace)} steps, fewer than "
                         f"--steps-per-batch={steps_per_batch}")
  predictor = HistoryLengthPredictor(window)
  per_order = {o: {"makespan": [], "idle": []} for o in ORDERS}
  errors = []
  for i, rec in enumerate(batches):
    lengths, ids = rec["lengths"], rec["prompt_ids"]
    predicted = predictor.predict(ids)
    if i:  # the first batch has no history to judge
      errors.append(prediction_error(predicted, lengths))
    for o in ORDERS:
      s = list_schedule(lengths, workers, order_for(o, lengths, predicted, seed + rec["step"]))
      per_order[o]["makespan"].append(s.makespan)
      per_order[o]["idle"].append(s.idle_fraction)
    predictor.observe(ids, lengths)
  per_step = len(batches[0]["lengths"]) // G
  stream = [rec["lengths"][j:j + G] for rec in batches for j in range(0, len(rec["lengths"]), G)]
  partial = partial_rollout_steps(stream, per_step, workers, over_provision, lpt=True)
  per_order["partial_lpt"] = {"makespan": [s.makespan for s in partial],
                              "idle": [s.idle_fraction for s in partial]}
  lengths = np.asarray([x for rec in trace for x in rec["lengths"]], float)
  mean_or_none = lambda xs: statistics.fmean(xs) if xs else None
  rank_corr = [e["spearman"] for e in errors if e["spearman"] == e["spearman"]]  # skip NaN
  fifo_mean = statistics.fmean(per_order["fifo"]["makespan"])
  return {
      "workers": workers, "steps": len(trace), "steps_per_batch": steps_per_batch,
      "requests_per_batch": len(batches[0]["lengths"]), "over_provision": over_provision,
      "length_mean": float(lengths.mean()), "length_p90": float(np.percentile(lengths, 90)),
      "length_cv": float(lengths.std() / lengths.mean()),
      "predictor_mae": mean_or_none([e["mae"] for e in errors]),
      "predictor_spearman": mean_or_none(rank_corr),
      "orders": {o: {"batches": len(v["makespan"]), "mean_makespan": statistics.fmean(v["makespan"]),
                     "median_makespan": statistics.median(v["makespan"]),
                     "mean_idle_fraction": statistics.fmean(v["idle"]),
                     "speedup_vs_fifo": fifo_mean / statistics.fmean(v["makespan"])}
                 for o, v in per_order.items() if v["makespan"]},
  }


def to_markdown(result: dict) -> str:
  fmt = lambda x: "n/a" if x is None else f"{x:.2f}"
  r = result
  lines = [f"{r['steps']} steps, batches of {r['requests_per_batch']} requests "
           f"({r['steps_per_batch']} step(s) each) on {r['workers']} workers; response length mean "
           f"{r['length_mean']:.1f}, p90 {r['length_p90']:.0f}, CV_L {r['length_cv']:.2f}; "
           f"history predictor MAE {fmt(r['predictor_mae'])} tokens, Spearman "
           f"{fmt(r['predictor_spearman'])}; partial rollout over-provisions x{r['over_provision']:g}.", "",
           "| schedule | batches | mean makespan (tokens) | median | mean idle fraction | speed-up vs FIFO |",
           "|---|---|---|---|---|---|"]
  for o, v in r["orders"].items():
    lines.append(f"| {o} | {v['batches']} | {v['mean_makespan']:.1f} | {v['median_makespan']:.0f} | "
                 f"{v['mean_idle_fraction']:.3f} | {v['speedup_vs_fifo']:.2f}x |")
  return "\n".join(lines)
