"""The algorithmic lever on the default task: `jaxroll compare` over 3 seeds.

  python scripts/bench_compare.py [--write-docs] [--steps N] [--target Q]

Runs uniform GRPO, each technique and the random controls from the same
warm-started policy per seed (configs/default.py, shorter RL phase and
denser evaluation so C(q) is resolved), then writes the comparison table
into the algorithmic-lever section of docs/benchmarks.md. Rollouts to Q* do
not depend on the machine; seconds do (runs one after another, 2 cores).
"""

import argparse
import os
import platform
import sys

from docs_section import ROOT, write_section

sys.path.insert(0, ROOT)
from jaxroll import config as config_lib  # noqa: E402
from jaxroll.compare import compare, to_markdown  # noqa: E402

VARIANTS = ["grpo", "greso", "random_greso", "dapo", "random_dapo", "mopps", "random_mopps",
            "pods", "random_pods", "vigor", "greso,vigor"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=80)
  ap.add_argument("--target", type=float, default=0.85)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "compare"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  overrides = [f"steps={a.steps}", "eval_every=5", "checkpoint_every=1000", "progress=false",
               "tensorboard=false"]
  base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")), overrides)
  seeds = [int(s) for s in a.seeds.split(",")]
  summary = compare(base, VARIANTS, seeds, a.target, a.out_dir)
  t = summary.table
  best = max((v for v in t if v != "grpo" and t[v]["cumulative_rollouts_vs_grpo"]),
             key=lambda v: t[v]["cumulative_rollouts_vs_grpo"], default=None)
  lines = [
      "## Algorithmic lever: techniques vs uniform GRPO and random controls", "",
      f"Measured by `python scripts/bench_compare.py --write-docs` on {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs: `jaxroll compare configs/default.py` with `{' '.join(overrides[:2])}`, "
      f"seeds {a.seeds}, Q* = {a.target}. Every variant of a seed starts from the same warm-started "
      "policy; techniques run with their defaults (`jaxroll/config.py`, AlgorithmConfig).", "",
      to_markdown(summary), "",
      "C(q) curves per cost unit: `bench_out/compare/cost_*.png`.",
  ]
  if best:
    lines += ["", f"Fewest rollouts to Q*: {best}, {t[best]['cumulative_rollouts_vs_grpo']:.2f}x fewer "
              "than uniform GRPO."]
  section = "\n".join(lines)
  print(section)
  if a.write_docs:
    write_section("algorithmic-lever", section)


if __name__ == "__main__":
  main()
