"""The algorithmic lever on the default task: `jaxroll compare` over 2 seeds.

  python scripts/bench_compare.py [--write-docs] [--steps N] [--seeds 0,1]

The default task (configs/default.py) is the counted walk over a pool of 64
prompts that RL revisits every 4 steps, so per-prompt history (GRESO, PoPO's
replay) has something to act on, and a third of the first step's groups are
all-wrong. Every variant of a seed starts from the same warm-started policy
and runs 12 GRPO steps (about 2.5 minutes each here; the whole script about
an hour on 2 cores). Reported at two targets set from uniform GRPO's own
curve (halfway and 90% of the way across the accuracies every GRPO seed
traverses).
Rollouts and tokens to Q* do not depend on the machine; seconds do (runs
one after another, 2 cores).
"""

import argparse
import os
import platform
import statistics
import sys

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll import config as config_lib  # noqa: E402
from jaxroll.compare import baseline_targets, compare, summarise, to_markdown  # noqa: E402
from jaxroll.metrics.logger import read_jsonl  # noqa: E402

# Techniques at their defaults, each beside its matched-rate random control.
VARIANTS = ["grpo", "dapo", "random_dapo", "greso", "random_greso", "pods", "random_pods",
            "popo", "random_popo", "vigor", "random_vigor"]
# Q* halfway and 90% of the way across the held-out accuracies every seed of
# uniform GRPO traverses (jaxroll.compare.baseline_targets).
FRACTIONS = (0.5, 0.9)
STEPS, EVAL_EVERY = 12, 4


def _times(r: float, what: str) -> str:
  """A ratio of rollouts-to-Q* (reference / variant) in words."""
  return f"{r:.2f}x fewer rollouts than {what}" if r >= 1 else f"{1 / r:.2f}x more rollouts than {what}"


def _best_line(summary) -> str:
  """The technique (not a baseline, not a control) needing the fewest rollouts to Q*."""
  t = summary.table
  base = t["grpo"]
  if base["cumulative_rollouts"] is None:
    reached = [v for v in t if not v.startswith(("grpo", "random_")) and t[v]["reached"] == t[v]["seeds"]]
    return (f"Uniform GRPO reached Q* = {summary.target} on {base['reached']}/{base['seeds']} seeds; "
            f"techniques reaching it on every seed: {', '.join(reached) or 'none'}.")
  ratio = lambda v: t[v]["cumulative_rollouts_vs_grpo"]
  techniques = [v for v in t if not v.startswith(("grpo", "random_")) and ratio(v)]
  if not techniques:
    return f"No technique reached Q* = {summary.target} on every seed."
  best = max(techniques, key=ratio)
  ctrl = t[best]["cumulative_rollouts_vs_control"]
  return (f"Fewest rollouts to Q* = {summary.target} among the techniques: {best}, "
          f"{_times(ratio(best), 'uniform GRPO')}" + (f" and {_times(ctrl, 'its random control')}"
                                                      if ctrl else "") + ".")


def _update_table(out: str, seeds) -> str:
  """Median update seconds and rows per step (steps after the first two,
  which compile), per variant: an update over the kept rows only costs
  what they cost (jaxroll/loop/compaction.py)."""
  rows = ["| variant | rollouts per step | update rows per step | update s (median) | vs GRPO |",
          "|---|---|---|---|---|"]
  med = {}
  for v in VARIANTS:
    timing = [t for s in seeds for t in read_jsonl(os.path.join(out, v, f"seed{s}", "timing.jsonl"))
              if t["step"] > 2 and "update_s" in t]
    metrics = [m for s in seeds for m in read_jsonl(os.path.join(out, v, f"seed{s}", "metrics.jsonl"))
               if m["step"] > 0]
    med[v] = statistics.median(t["update_s"] for t in timing)
    rows.append(f"| {v} | {statistics.fmean(m['rollouts_generated'] for m in metrics):.0f} | "
                f"{statistics.fmean(m['update_rows'] for m in metrics):.0f} | {med[v]:.2f} | "
                f"{med[v] / med['grpo']:.2f}x |")
  return "\n".join(rows)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=STEPS)
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  overrides = [f"steps={a.steps}", f"eval_every={EVAL_EVERY}", "checkpoint_every=1000", "progress=false",
               "tensorboard=false"]
  seeds = [int(s) for s in a.seeds.split(",")]
  lines = [
      "## Algorithmic lever: techniques vs uniform GRPO and random controls", "",
      f"Measured by `python scripts/bench_compare.py --write-docs` on {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs: `jaxroll compare configs/default.py` with `{' '.join(overrides[:2])}`, "
      f"seeds {a.seeds}. Every variant of a seed starts from the same warm-started policy; techniques "
      "run with their defaults (`jaxroll/config.py`, AlgorithmConfig). A variant `X@key=value` adds "
      "a config override. Uniform GRPO spends 16 prompts x 8 rollouts = 128 rollouts per step.",
  ]
  base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")), overrides)
  out = os.path.join(a.out_dir, "compare")
  compare(base, VARIANTS, seeds, 0.0, out)  # runs (or reuses) every variant
  dirs = {(v, s): os.path.join(out, v, f"seed{s}") for v in VARIANTS for s in seeds}
  targets = baseline_targets(dirs, FRACTIONS)
  lines += ["", f"Q* = {targets[0]} and {targets[1]}: {FRACTIONS[0]:.0%} and {FRACTIONS[1]:.0%} of the way "
            "across the held-out accuracies every seed of uniform GRPO traverses (from the best warm start "
            "to the lowest of the seeds' best)."]
  for target in targets:
    summary = summarise(dirs, target)
    lines += ["", to_markdown(summary), "", _best_line(summary)]
  lines += ["", _update_table(out, seeds)]
  lines += ["", "C(q) curves per cost unit: `bench_out/compare/cost_*.png`."]
  emit_section("algorithmic-lever", lines, a.write_docs)


if __name__ == "__main__":
  main()
