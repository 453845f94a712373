"""Projects a recorded run's rollout onto other worker counts and schedules.

Reads run_dir/lengths.jsonl (per RL step: each trajectory's prompt id and
response length, in admission order) and, for each step, simulates the
step's requests on `workers` workers under each admission order. The
history predictor for `lpt_predicted` only sees earlier steps.
"""

from __future__ import annotations

import os
import statistics

import numpy as np

from jaxroll.metrics.logger import read_jsonl
from jaxroll.scheduling.length_predictor import HistoryLengthPredictor, prediction_error
from jaxroll.scheduling.makespan import ORDERS, list_schedule, order_for


def simulate_run(run_dir: str, workers: int, window: int = 4, seed: int = 0) -> dict:
  trace = read_jsonl(os.path.join(run_dir, "lengths.jsonl"))
  if not trace:
    raise FileNotFoundError(f"{run_dir}/lengths.jsonl: no length trace (a run writes it per step)")
  predictor = HistoryLengthPredictor(window)
  per_order = {o: {"makespan": [], "idle": []} for o in ORDERS}
  errors = []
  all_lengths = []
  for rec in trace:
    lengths, ids = rec["lengths"], rec["prompt_ids"]
    predicted = predictor.predict(ids)
    if rec["step"] > trace[0]["step"]:  # the first step has no history to judge
      errors.append(prediction_error(predicted, lengths))
    for o in ORDERS:
      s = list_schedule(lengths, workers, order_for(o, lengths, predicted, seed + rec["step"]))
      per_order[o]["makespan"].append(s.makespan)
      per_order[o]["idle"].append(s.idle_fraction)
    predictor.observe(ids, lengths)
    all_lengths.extend(lengths)
  lengths = np.asarray(all_lengths, float)
  mean_or_none = lambda xs: statistics.fmean(xs) if xs else None
  rank_corr = [e["spearman"] for e in errors if e["spearman"] == e["spearman"]]  # skip NaN
  fifo_total = sum(per_order["fifo"]["makespan"])
  return {
      "workers": workers, "steps": len(trace),
      "length_mean": float(lengths.mean()), "length_p90": float(np.percentile(lengths, 90)),
      "length_cv": float(lengths.std() / lengths.mean()),
      "predictor_mae": mean_or_none([e["mae"] for e in errors]),
      "predictor_spearman": mean_or_none(rank_corr),
      "orders": {o: {"total_makespan": sum(v["makespan"]),
                     "median_step_makespan": statistics.median(v["makespan"]),
                     "mean_idle_fraction": statistics.fmean(v["idle"]),
                     "speedup_vs_fifo": fifo_total / sum(v["makespan"])}
                 for o, v in per_order.items()},
  }


def to_markdown(result: dict) -> str:
  fmt = lambda x: "n/a" if x is None else f"{x:.2f}"
  lines = [f"{result['steps']} steps on {result['workers']} workers; response length mean "
           f"{result['length_mean']:.1f}, p90 {result['length_p90']:.0f}, CV_L {result['length_cv']:.2f}; "
           f"history predictor MAE {fmt(result['predictor_mae'])} tokens, Spearman "
           f"{fmt(result['predictor_spearman'])}.", "",
           "| order | total makespan (tokens) | median step makespan | mean idle fraction | speed-up vs FIFO |",
           "|---|---|---|---|---|"]
  for o, v in result["orders"].items():
    lines.append(f"| {o} | {v['total_makespan']:,.0f} | {v['median_step_makespan']:.0f} | "
                 f"{v['mean_idle_fraction']:.3f} | {v['speedup_vs_fifo']:.2f}x |")
  return "\n".join(lines)
