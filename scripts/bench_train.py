"""Runs the main job (configs/default.py) twice in fresh processes and reports it.

  python scripts/bench_train.py [--write-docs]

Each run is `jaxroll train configs/default.py` into bench_out/train_<i>, timed
from process start to exit (imports and compilation included). The script
checks that the two metrics.jsonl files are byte-identical (same config and
seed), and with --write-docs rewrites the main-job section of
docs/benchmarks.md.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll.metrics.cost import COST_UNITS, cost_to_quality, unit_costs  # noqa: E402
from jaxroll.metrics.logger import read_jsonl  # noqa: E402


def run_once(run_dir, extra):
  shutil.rmtree(run_dir, ignore_errors=True)
  t0 = time.perf_counter()
  subprocess.run([sys.executable, "-m", "jaxroll.cli", "train", "configs/default.py",
                  "--set", f"run_dir={run_dir}", "--set", "progress=false", *extra],
                 cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  return time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--runs", type=int, default=2)
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out"))
  ap.add_argument("--set", action="append", default=[], help="extra config overrides")
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  dirs = [os.path.join(a.out_dir, f"train_{i}") for i in range(a.runs)]
  walls = [run_once(d, [x for s in a.set for x in ("--set", s)]) for d in dirs]
  texts = [open(os.path.join(d, "metrics.jsonl")).read() for d in dirs]
  identical = all(t == texts[0] for t in texts)
  metrics = read_jsonl(os.path.join(dirs[0], "metrics.jsonl"))
  timing = {t["step"]: t for t in read_jsonl(os.path.join(dirs[0], "timing.jsonl"))}
  evals = [{**timing.get(m["step"], {}), **m} for m in metrics if "heldout_accuracy" in m]
  q = [e["heldout_accuracy"] for e in evals]
  steps = [timing[m["step"]] for m in metrics if m["step"] > 0]
  warm = timing[0]["warm_start_s"]
  cfg = json.load(open(os.path.join(dirs[0], "config.json")))
  temperature = cfg["rollout"]["temperature"]
  lines = [
      "## Main job: `jaxroll train configs/default.py`", "",
      f"Measured by `python scripts/bench_train.py --write-docs` on {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs, {a.runs} runs in fresh processes (float32, CPU).", "",
      f"- Wall-clock per run, process start to exit: {', '.join(f'{w:.0f} s' for w in walls)} "
      f"(median {statistics.median(walls):.0f} s; the limit is 600 s).",
      f"- Task {cfg['task']['name']}; held-out accuracy ({cfg['task']['num_heldout']} prompts x "
      f"{cfg['eval_samples']} samples, temperature {temperature:g}): {q[0]:.3f} after the warm start, "
      f"{q[-1]:.3f} after {metrics[-1]['step']} GRPO steps: {100 * (q[-1] - q[0]):+.1f} points.",
      f"- metrics.jsonl identical across the {a.runs} runs: {'yes' if identical else 'NO'}.",
      f"- Run 1 phases: warm start {warm:.0f} s; RL steps median {statistics.median(s['step_s'] for s in steps):.3f} s, "
      f"of which rollout {statistics.median(s['rollout_share'] for s in steps):.0%}; rollout "
      f"{statistics.median(s['tokens_per_s'] for s in steps):,.0f} generated tokens/s (median over steps).",
      "", "Held-out accuracy at each evaluation of run 1 and its cumulative RL cost "
      "(C(q) reads off this table: the first row reaching q):", "",
      "| step | held-out accuracy | training s | generated tokens | rollouts |", "|---|---|---|---|---|",
  ]
  for e in evals:
    lines.append(f"| {e['step']} | {e['heldout_accuracy']:.3f} | {e.get('cumulative_train_s', 0):.1f} | "
                 f"{e.get('cumulative_tokens', 0):,} | {e.get('cumulative_rollouts', 0):,} |")
  targets = [q[0] + f * (max(q) - q[0]) for f in (0.5, 0.9)]
  c = {u: cost_to_quality(q, unit_costs(evals, u), targets) for u in COST_UNITS}
  lines += ["", "C(q) for q halfway and 90% of the way from the warm start to the best accuracy: " + "; ".join(
      f"q={t:.3f}: {c['cumulative_train_s'][i]:.1f} s, {c['cumulative_tokens'][i]:,.0f} tokens, "
      f"{c['cumulative_rollouts'][i]:,.0f} rollouts" for i, t in enumerate(targets)) + "."]
  emit_section("main-job", lines, a.write_docs)
  if not identical:
    sys.exit("metrics.jsonl differs between runs")


if __name__ == "__main__":
  main()
