"""Measures the shape of the default workload on one run of the main job.

  python scripts/bench_workload.py [--write-docs] [--set key=value ...]

Runs `jaxroll train configs/default.py` in a fresh process into
bench_out/workload, timed from process start to exit (the main job's
wall-clock, warm start and compilation included), and reads its logs:

  len_mean, len_cv, len_p99_over_median   generated tokens per response at
                                          the first RL step (lengths.jsonl;
                                          *_pooled: the first 8 steps')
  max_new_tokens                          rollout.max_new_tokens
  pool_revisits                           mean steps in which a pool prompt
                                          was sampled (pool_revisits_min: the least)
  frac_all_wrong_first / frac_all_right_last
                                          groups whose rollouts all failed at
                                          the first RL step / all passed at the last
  heldout_gain                            held-out accuracy, last minus first
                                          evaluation, in points
  main_job_s                              the run's wall-clock
  rollout_share                           median over steps of rollout / step
                                          seconds (the report's checklist item 2)

Prints the docs section, then one JSON line with these keys; --write-docs
replaces the workload section of docs/benchmarks.md. The targets each key is
compared with are in TARGETS.
"""

import argparse
import collections
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll.metrics.logger import read_jsonl  # noqa: E402

# key: (comparison, target) from the workload's specification.
TARGETS = {
    "len_mean": (">=", 128), "len_cv": (">=", 0.6), "len_p99_over_median": (">=", 4.0),
    "max_new_tokens": (">=", 768), "pool_revisits": (">=", 4), "frac_all_wrong_first": (">=", 0.3),
    "frac_all_right_last": (">=", 0.3), "heldout_gain": (">=", 30.0), "main_job_s": ("<=", 600),
    "rollout_share": (">=", 0.5),
}


def measure(run_dir: str, wall_s: float) -> dict:
  cfg = json.load(open(os.path.join(run_dir, "config.json")))
  metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  steps = [m for m in metrics if m["step"] > 0]
  evals = [m for m in metrics if "heldout_accuracy" in m]
  timing = [t for t in read_jsonl(os.path.join(run_dir, "timing.jsonl")) if t["step"] > 0]
  traces = read_jsonl(os.path.join(run_dir, "lengths.jsonl"))
  first = np.asarray(traces[0]["lengths"], np.float64)
  # The 99th percentile of one step's 128 responses is nearly its second
  # longest: the first eight steps' responses pooled say the same more firmly.
  pooled = np.concatenate([np.asarray(t["lengths"], np.float64) for t in traces[:8]])
  visits = collections.Counter()
  for t in traces:
    visits.update(set(t["prompt_ids"]))
  pool = cfg["task"]["num_train"]
  return {
      "len_mean": float(first.mean()), "len_median": float(np.median(first)),
      "len_cv": float(first.std() / first.mean()),
      "len_p99_over_median": float(np.percentile(first, 99) / np.median(first)),
      "len_p99_over_median_pooled": float(np.percentile(pooled, 99) / np.median(pooled)),
      "len_cv_pooled": float(pooled.std() / pooled.mean()), "len_pooled_rows": int(pooled.size),
      "len_pooled_steps": min(8, len(traces)),
      "max_new_tokens": cfg["rollout"]["max_new_tokens"],
      "pool_size": pool, "pool_revisits": sum(visits.values()) / pool,
      "pool_revisits_min": min(visits[i] for i in range(pool)) if len(visits) == pool else 0,
      "frac_all_wrong_first": steps[0]["all_wrong_fraction"],
      "frac_all_right_last": steps[-1]["all_right_fraction"],
      "heldout_first": evals[0]["heldout_accuracy"], "heldout_last": evals[-1]["heldout_accuracy"],
      "heldout_gain": 100 * (evals[-1]["heldout_accuracy"] - evals[0]["heldout_accuracy"]),
      "main_job_s": wall_s, "rl_steps": len(steps),
      "rollout_share": statistics.median(t["rollout_share"] for t in timing),
      "rollout_share_total": sum(t["rollout_s"] for t in timing) / sum(t["step_s"] for t in timing),
      "phase_medians_s": {k: statistics.median(t[k] for t in timing)
                          for k in ("rollout_s", "reward_s", "update_s", "weight_sync_s", "step_s")},
  }


def meets(key: str, value: float) -> bool:
  how, target = TARGETS[key]
  return value >= target if how == ">=" else value <= target


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out"))
  ap.add_argument("--set", action="append", default=[], help="extra config overrides")
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  run_dir = os.path.join(a.out_dir, "workload")
  shutil.rmtree(run_dir, ignore_errors=True)
  t0 = time.perf_counter()
  subprocess.run([sys.executable, "-m", "jaxroll.cli", "train", "configs/default.py",
                  "--set", f"run_dir={run_dir}", "--set", "progress=false",
                  *[x for s in a.set for x in ("--set", s)]],
                 cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  m = measure(run_dir, time.perf_counter() - t0)
  ph = m["phase_medians_s"]
  lines = [
      "## The default workload: `configs/default.py`", "",
      f"Measured by `python scripts/bench_workload.py --write-docs` on one run of the main job "
      f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, float32).", "",
      "| property | measured | target | met |", "|---|---|---|---|",
  ]
  for key, (how, target) in TARGETS.items():
    v = m[key]
    shown = f"{v:,.0f}" if key in ("max_new_tokens", "main_job_s") else f"{v:.3f}"
    lines.append(f"| {key} | {shown} | {how} {target} | {'yes' if meets(key, v) else 'NO'} |")
  lines += [
      "",
      f"- First RL step: {m['len_mean']:.1f} generated tokens per response on average, median "
      f"{m['len_median']:.0f}; the pool of {m['pool_size']} prompts is sampled in "
      f"{m['pool_revisits']:.1f} steps per prompt on average (the least-seen prompt "
      f"{m['pool_revisits_min']}) over {m['rl_steps']} RL steps.",
      f"- The first {m['len_pooled_steps']} RL steps' {m['len_pooled_rows']} responses pooled: "
      f"p99 over median {m['len_p99_over_median_pooled']:.2f}, coefficient of variation "
      f"{m['len_cv_pooled']:.3f} (one step's p99 is nearly its second longest response).",
      f"- Held-out accuracy {m['heldout_first']:.3f} after the warm start, {m['heldout_last']:.3f} "
      f"at the end ({m['heldout_gain']:+.1f} points).",
      f"- Step phases (median s): rollout {ph['rollout_s']:.2f}, reward {ph['reward_s']:.2f}, "
      f"update {ph['update_s']:.2f}, weight sync {ph['weight_sync_s']:.2f}, step {ph['step_s']:.2f}; "
      f"rollout share {m['rollout_share']:.2f} (median over steps), "
      f"{m['rollout_share_total']:.2f} of all step seconds.",
  ]
  emit_section("workload", lines, a.write_docs)
  print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}))


if __name__ == "__main__":
  main()
