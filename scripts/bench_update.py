"""The RL update over length chunks vs one padded array, on long-tailed batches.

  python scripts/bench_update.py [--steps 8] [--write-docs]

Two runs of the counted-walk task at 768 new tokens (configs/default.py
with the COUNT_WALK overrides), in fresh processes: the first with the
chunked update (rl.microbatch_tokens=8192, the default) and its own warm
start, the second with rl.microbatch_tokens=0 (the batch as one array at its
longest row's width) from the first run's warm-started policy. Both
start from the same policy and sample the same first batch, so step 1's
update statistics must agree (a check that the two updates are the same
update); the table gives median update and step seconds over the steps
after the first two (which compile new shapes).
"""

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll.metrics.logger import read_jsonl  # noqa: E402

# The default's counted walk with a short warm start. reward=final scores
# every response the chain reward scores and more, so step 1 is more likely
# to have groups with a signal and a gradient to compare (main() refuses a
# step 1 without one).
COUNT_WALK = ["task.reward=final", "task.num_train=100", "task.num_heldout=64", "warm_start.steps=100",
              "eval_samples=2", "report=false", "tensorboard=false", "progress=false"]
COMPARED = ("loss", "clip_fraction", "ratio_mean", "grad_norm")


def run(run_dir, sets):
  shutil.rmtree(run_dir, ignore_errors=True)
  subprocess.run([sys.executable, "-m", "jaxroll.cli", "train", "configs/default.py",
                  *[x for s in [*COUNT_WALK, f"run_dir={run_dir}", *sets] for x in ("--set", s)]],
                 cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  return read_jsonl(os.path.join(run_dir, "metrics.jsonl")), read_jsonl(os.path.join(run_dir, "timing.jsonl"))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  common = [f"steps={a.steps}", f"eval_every={a.steps}"]
  chunked_dir = os.path.join(a.out_dir, "update_chunked")
  results = {"chunked (8192 tokens)": run(chunked_dir, common)}
  results["one array"] = run(os.path.join(a.out_dir, "update_whole"),
                             [*common, "rl.microbatch_tokens=0",
                              f"warm_start.from_dir={os.path.join(chunked_dir, 'warm_start')}"])
  first = {name: next(m for m in metrics if m["step"] == 1) for name, (metrics, _) in results.items()}
  a_first, b_first = first.values()
  gaps = {k: abs(a_first[k] - b_first[k]) / max(abs(b_first[k]), 1e-6) for k in COMPARED}
  if not b_first["grad_norm"]:
    sys.exit("step 1 had no gradient (every group degenerate): nothing to compare")
  lines = [
      "## RL update: length chunks vs one padded array", "",
      f"Measured by `python scripts/bench_update.py --write-docs` ({platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs, float32): the counted-walk task (final-answer reward) at 768 new tokens, 16 prompts x 8 samples, "
      f"{a.steps} RL steps per run; medians over steps 3-{a.steps}.", "",
      "| update | update s | step s | rollout share |", "|---|---|---|---|",
  ]
  medians = {}
  for name, (metrics, timing) in results.items():
    later = [t for t in timing if t["step"] > 2]
    medians[name] = statistics.median(t["update_s"] for t in later)
    lines.append(f"| {name} | {medians[name]:.2f} | {statistics.median(t['step_s'] for t in later):.2f} | "
                 f"{statistics.median(t['rollout_share'] for t in later):.2f} |")
  names = list(results)
  lines += ["", f"The chunked update is {medians[names[1]] / medians[names[0]]:.1f}x faster. "
            "Step 1 (the same policy and batch in both runs): largest relative difference of "
            + ", ".join(f"{k} {gaps[k]:.1e}" for k in COMPARED)
            + f" ({b_first['degenerate_groups']} of 16 groups degenerate, grad norm {b_first['grad_norm']:.3g})."]
  emit_section("update-chunks", lines, a.write_docs)
  if max(gaps.values()) > 1e-3:
    sys.exit("step 1's update statistics differ between the two updates")


if __name__ == "__main__":
  main()
