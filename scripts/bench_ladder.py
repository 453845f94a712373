"""The stacked ablation ladder on the default task (survey Section 8.7, protocol 2).

  python scripts/bench_ladder.py [--write-docs] [--stack lpt,partial,greso,async] [--seeds 0] [--steps 12]
      [--set KEY=VALUE ...]

`jaxroll ladder configs/default.py`: synchronous GRPO, then LPT admission
(length history), partial rollout (over-provisioning 1.25 with
carry-over), the GRESO prompt filter and one-step-off async, one at a
time, each rung from the same warm-started policy; plus the interference
pairs partial x async and greso x lpt. About ten runs of 12 steps, held-out
evaluation every 2 (about 20 minutes on 2 cores). Writes the ladder section
of docs/benchmarks.md, one table per target Q* (--fractions). The goal for
the best stack: Q* at <= 1/2 the wall-clock and <= 1/2 the generated tokens
of synchronous GRPO. Finished runs in --out-dir are reused if they ran the
same config; another --steps or --eval-every needs another --out-dir.
"""

import argparse
import json
import os
import platform
import sys

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll import compare as compare_lib  # noqa: E402
from jaxroll import config as config_lib  # noqa: E402
from jaxroll import ladder as ladder_lib  # noqa: E402
from jaxroll import run_info  # noqa: E402
from jaxroll.compare import baseline_targets, per_seed_targets, target_text  # noqa: E402

# Q*: fractions of the way across the held-out accuracies every seed of
# synchronous GRPO traverses (jaxroll.compare.baseline_targets): halfway,
# which GRPO reaches within its first pass over the prompt pool, and most of
# the way, which it reaches later, once prompts recur and the filters have
# a history to act on.
FRACTIONS = "0.5,0.9"
STEPS, EVAL_EVERY = 12, 2


def _goal(res: dict) -> str:
  best = min((r for r in res["rungs"] if r["cumulative_train_s"] is not None),
             key=lambda r: r["cumulative_train_s"], default=None)
  if best is None or best["cumulative_train_s_vs_grpo"] is None:
    return "Synchronous GRPO or every rung missed Q*: no ratio to report."
  ratios = best["cumulative_train_s_vs_grpo"], best["cumulative_tokens_vs_grpo"]
  text = (f"Fastest rung to Q*: {best['rung']}, with GRPO's wall-clock to Q* / this rung's = "
          f"{ratios[0]:.2f}x and GRPO's generated tokens to Q* / this rung's = {ratios[1]:.2f}x (the "
          f"goal is >= 2x on both: {'met' if min(ratios) >= 2 else 'not met'}).")
  net = max((r for r in res["rungs"] if r["cumulative_steady_s_vs_grpo"] is not None),
            key=lambda r: r["cumulative_steady_s_vs_grpo"], default=None)
  if net is not None:
    text += (f" Net of compilation, the fastest is {net['rung']}: GRPO's seconds / its seconds = "
             f"{net['cumulative_steady_s_vs_grpo']:.2f}x (tokens: {net['cumulative_tokens_vs_grpo']:.2f}x).")
  return text


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--stack", default="lpt,partial,greso,async")
  ap.add_argument("--pairs", default="partial:async,greso:lpt")
  ap.add_argument("--steps", type=int, default=STEPS)
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--eval-every", type=int, default=EVAL_EVERY)
  ap.add_argument("--fractions", default=FRACTIONS,
                  help="comma-separated fractions of GRPO's accuracy range: one Q* (and table) each")
  ap.add_argument("--section", default="ladder",
                  help="the docs section to write: 'ladder' (the whole ladder), or another name for a "
                  "partial run (e.g. one interference pair) that must not replace it")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "ladder"))
  ap.add_argument("--write-docs", action="store_true")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="an override of every run's config (repeatable), e.g. algorithm.budget=64 "
                  "for the rollouts per step a vip or vigor rung allocates")
  ap.add_argument("--shared", action="store_true",
                  help="say in the docs that other work shared the machine (seconds are perturbed)")
  a = ap.parse_args()
  overrides = [f"steps={a.steps}", f"eval_every={a.eval_every}", "checkpoint_every=1000", "progress=false",
               "tensorboard=false", *a.set]
  base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")), overrides)
  stack, seeds, pairs = a.stack.split(","), [int(s) for s in a.seeds.split(",")], ladder_lib.parse_pairs(a.pairs)
  dirs = ladder_lib.run(base, stack, seeds, a.out_dir, pairs)  # trains (or reuses) every run
  grpo = {k: d for k, d in dirs.items() if k[0] == "grpo"}
  fractions = [float(f) for f in a.fractions.split(",")]
  results, tables = [], []
  try:
    targets, across = baseline_targets(grpo, fractions), "the held-out accuracies every seed of GRPO traverses"
  except ValueError as e:  # warm starts too far apart for one Q* inside every seed's range
    print(f"{e}; one Q* per seed instead", file=sys.stderr)
    targets = [per_seed_targets(grpo, f) for f in fractions]
    across = ("each seed's own GRPO run, from its warm start to its best (the seeds' warm starts are "
              "too far apart for one Q* inside every seed's range)")
  for fraction, target in zip(fractions, targets):
    res = ladder_lib.summarise(dirs, stack, seeds, target, pairs)
    results.append({"fraction": fraction, **res})
    tables += [f"### Q* = {target_text(target)} ({fraction:g} of the way across GRPO's range)", "",
               ladder_lib.to_markdown(res), "", _goal(res), ""]
  with open(os.path.join(a.out_dir, "ladder.json"), "w") as f:
    json.dump(results, f, indent=2)
  compare_lib.plot(dirs, a.out_dir)
  title = ("Stacked ablation ladder: one component per rung" if a.section == "ladder" else
           f"Ladder runs: --stack {a.stack}, --pairs {a.pairs}")
  out_dir = os.path.relpath(a.out_dir, ROOT)
  flags = "".join(f" --{k} {v}" for k, v in (("stack", a.stack), ("pairs", a.pairs), ("steps", a.steps),
                                              ("eval-every", a.eval_every), ("seeds", a.seeds),
                                              ("fractions", a.fractions), ("section", a.section),
                                              *(("set", kv) for kv in a.set),
                                              ("out-dir", out_dir))
                  if str(v) != str(ap.get_default(k.replace("-", "_")))
                  and (k != "out-dir" or a.out_dir != ap.get_default("out_dir")))
  cpu = run_info.cpu()
  where = f"{cpu['model']} ({', '.join(cpu['isa'])})" if cpu else platform.processor() or platform.machine()
  lines = [
      f"## {title}", "",
      f"Measured by `python scripts/bench_ladder.py{flags} --write-docs` on {where}, "
      f"{os.cpu_count()} CPUs: `jaxroll ladder configs/default.py --stack {a.stack} --pairs {a.pairs}` "
      f"with `{' '.join(overrides[:2] + a.set)}`, seeds {a.seeds}; each Q* is a fraction of the way across "
      f"{across}. Every run of a seed starts from that "
      "seed's warm-started policy; a rung adds its component to the rung above it. Net seconds leave "
      "out the preparation of programs inside the steps (tracing, lowering and XLA compilation: "
      "timing.jsonl's step_compile_s): a run this short prepares every program, which a long run "
      "amortises. Seconds are this machine's (2 cores, so async cannot overlap here: see the "
      "pipeline section); tokens and "
      "rollouts do not depend on its speed, but they do on its CPU's vector extensions, whose "
      "rounding changes the warm start (run_info.json records them).", "",
      *(["Other work shared the machine during these runs: their seconds are perturbed "
         "(tokens and rollouts are not).", ""] if a.shared else []),
      *tables,
      f"C(q) curves per cost unit: `{out_dir}/cost_*.png`.",
  ]
  emit_section(a.section, lines, a.write_docs)


if __name__ == "__main__":
  main()
