"""The algorithmic lever on the default task: `jaxroll compare` over 3 seeds.

  python scripts/bench_compare.py [--write-docs] [--steps N] [--seeds 0,1,2]

Two settings, each from the same warm-started policy per seed:
  * the default task (configs/default.py): 20,000 training rows over about
    4,000 distinct problems, so few prompts recur within the run;
  * a multi-epoch pool (task.num_train=512): every prompt recurs every
    32 steps or so, the regime where per-prompt history (GRESO, MoPPS) can
    act, as in the papers' multi-epoch training.
Each is reported at two targets: Q* = 0.85 and, nearer the plateau where
degenerate groups dominate, Q* = 0.88. The table goes into the
algorithmic-lever section of docs/benchmarks.md. Rollouts to Q* do not
depend on the machine; seconds do (runs one after another, 2 cores).
"""

import argparse
import os
import platform
import sys

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll import config as config_lib  # noqa: E402
from jaxroll.compare import compare, summarise, to_markdown  # noqa: E402

# Techniques at their defaults and their random controls; then two variants
# that spend half the rollouts per step: uniform (group size 4) and VIGOR's
# variance-directed allocation of the same budget.
HALF_BUDGET = ("grpo@rollout.group_size=4", "vigor@algorithm.budget=64")
VARIANTS = ["grpo", "greso", "random_greso", "dapo", "random_dapo", "mopps", "random_mopps",
            "pods", "random_pods", "popo", "random_popo", "vigor", "greso,vigor",
            *HALF_BUDGET]
POOL_VARIANTS = ["grpo", "greso", "random_greso", "mopps", "random_mopps", "popo", "random_popo"]
SETTINGS = {  # name: (extra overrides, variants, output folder)
    "default task": ([], VARIANTS, "compare"),
    "multi-epoch pool (task.num_train=512)": (["task.num_train=512"], POOL_VARIANTS, "compare_pool512"),
}
TARGETS = (0.85, 0.88)


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
  line = (f"Fewest rollouts to Q* = {summary.target} among the techniques: {best}, "
          f"{_times(ratio(best), 'uniform GRPO')}" + (f" and {_times(ctrl, 'its random control')}"
                                                       if ctrl else "") + ".")
  half, uniform = t.get(HALF_BUDGET[1], {}), t.get(HALF_BUDGET[0], {})
  if half.get("cumulative_rollouts") and uniform.get("cumulative_rollouts"):
    line += (f" At half the rollouts per step, VIGOR's allocation needs "
             f"{half['cumulative_rollouts'] / uniform['cumulative_rollouts']:.2f}x the rollouts of "
             "uniform allocation at the same budget (group size 4).")
  return line


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=80)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  overrides = [f"steps={a.steps}", "eval_every=2", "checkpoint_every=1000", "progress=false",
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
  for name, (extra, variants, folder) in SETTINGS.items():
    base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")),
                                      overrides + extra)
    out = os.path.join(a.out_dir, folder)
    first = compare(base, variants, seeds, TARGETS[0], out)
    lines += ["", f"### {name}", ""]
    for target in TARGETS:
      summary = first if target == TARGETS[0] else summarise(
          {(v, s): os.path.join(out, v, f"seed{s}") for v in variants for s in seeds}, target)
      lines += [to_markdown(summary), "", _best_line(summary), ""]
    lines += [f"C(q) curves per cost unit: `bench_out/{folder}/cost_*.png`."]
  emit_section("algorithmic-lever", lines, a.write_docs)


if __name__ == "__main__":
  main()
