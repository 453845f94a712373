"""The RL update over length chunks vs one padded array, on long-tailed batches.

  python scripts/bench_update.py [--steps 12] [--write-docs]

Three runs of the counted-walk task at 768 new tokens (configs/default.py
with the COUNT_WALK overrides), in fresh processes: the first with the
default update (chunks of rl.microbatch_tokens=512 slots, no gradient over rows
of advantage 0) and its own warm start, then from its warm-started policy
the chunked update over every row (rl.skip_zero_advantage=false) and one
array at the longest row's width (rl.microbatch_tokens=0). All start from
the same policy and sample the same first batch, so step 1's loss and
gradient norm must agree (a check that the updates are the same update;
the chunked update over every row also its clip fraction and ratio); the
table gives median update and step seconds over the steps after the
first two, the update's without the compilations inside it (each
new chunk shape compiles once), and the compile seconds of every update
of the run.
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
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  common = [f"steps={a.steps}", f"eval_every={a.steps}"]
  first_dir = os.path.join(a.out_dir, "update_chunked")
  warm = f"warm_start.from_dir={os.path.join(first_dir, 'warm_start')}"
  results = {"chunked, zero-advantage rows skipped (default)": run(first_dir, common)}
  results["chunked, every row"] = run(os.path.join(a.out_dir, "update_chunked_all"),
                                      [*common, "rl.skip_zero_advantage=false", warm])
  results["one array"] = run(os.path.join(a.out_dir, "update_whole"),
                             [*common, "rl.microbatch_tokens=0", warm])
  first = {name: next(m for m in metrics if m["step"] == 1) for name, (metrics, _) in results.items()}
  names = list(results)
  whole = first[names[2]]
  if not whole["grad_norm"]:
    sys.exit("step 1 had no gradient (every group degenerate): nothing to compare")
  # The skipping update's token means cover the rows it runs: only its loss
  # and gradient are the whole batch's.
  gaps = {name: {k: abs(first[name][k] - whole[k]) / max(abs(whole[k]), 1e-6)
                 for k in (COMPARED if name == names[1] else ("loss", "grad_norm"))}
          for name in names[:2]}
  lines = [
      "## RL update: length chunks vs one padded array", "",
      f"Measured by `python scripts/bench_update.py --write-docs` ({platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs, float32): the counted-walk task (final-answer reward) at 768 new tokens, 16 prompts x 8 samples, "
      f"{a.steps} RL steps per run, all from one warm-started policy; medians over steps 3-{a.steps}, "
      "the ratios below from the update seconds less the compile seconds inside them (`update_compile_s`). "
      "Rows run: those the gradient was taken over (`gradient_rows`; without it, every row of the update batch).", "",
      "| update | update s | update s, compiles excluded | update compiles, whole run (s) | step s | rollout share | rows run |",
      "|---|---|---|---|---|---|---|",
  ]
  medians = {}
  for name, (metrics, timing) in results.items():
    later = [t for t in timing if t["step"] > 2]
    rows = [m.get("gradient_rows", m["update_rows"]) for m in metrics if "update_rows" in m and m["step"] > 2]
    raw = statistics.median(t["update_s"] for t in later)
    # Short runs meet new chunk shapes often: compare what the updates cost.
    medians[name] = statistics.median(t["update_s"] - t["update_compile_s"] for t in later)
    compiles = sum(t["update_compile_s"] for t in timing if "update_compile_s" in t)
    lines.append(f"| {name} | {raw:.2f} | {medians[name]:.2f} | {compiles:.1f} | {statistics.median(t['step_s'] for t in later):.2f} | "
                 f"{statistics.median(t['rollout_share'] for t in later):.2f} | {statistics.median(rows):.0f} |")
  lines += ["", f"The chunked update is {medians[names[2]] / medians[names[1]]:.1f}x faster than one array; "
            f"skipping the rows of advantage 0 makes it {medians[names[1]] / medians[names[0]]:.2f}x faster again "
            f"({medians[names[2]] / medians[names[0]]:.1f}x over one array). "
            "Step 1 (the same policy and batch in every run), largest relative difference to one array: "
            + "; ".join(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps[name].items()) for name in names[:2])
            + f" ({whole['degenerate_groups']} of 16 groups degenerate, grad norm {whole['grad_norm']:.3g})."]
  emit_section("update-chunks", lines, a.write_docs)
  if max(max(g.values()) for g in gaps.values()) > 1e-3:
    sys.exit("step 1's update statistics differ between the updates")


if __name__ == "__main__":
  main()
