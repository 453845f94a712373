"""The `jaxroll` command: `jaxroll train CONFIG [--set key=value ...] [--resume]`.

One error path: a JaxrollError (a problem in the user's input) prints as
one line `jaxroll: <problem and fix>` with exit code 2; `--debug` or
JAXROLL_DEBUG=1 shows its traceback instead. Everything `train` can check
from the config and the files (the run folder, the task data, the
checkpoint files) is checked before JAX is imported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from jaxroll import config as config_lib
from jaxroll.errors import JaxrollError


def _seeds(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise config_lib.ConfigError(f"--seeds={text!r}: expected comma-separated integers") from None


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  debug = "--debug" in argv or os.environ.get("JAXROLL_DEBUG", "") not in ("", "0")
  argv = [a for a in argv if a != "--debug"]
  try:
    return _main(argv)
  except JaxrollError as e:
    if debug:
      raise
    print("jaxroll: " + " ".join(str(e).split()), file=sys.stderr)
    return 2


def _main(argv) -> int:
  ap = argparse.ArgumentParser(prog="jaxroll", description="Rollout-efficient RL for reasoning LLMs.",
                               epilog="--debug (or JAXROLL_DEBUG=1) shows tracebacks of input errors.")
  sub = ap.add_subparsers(dest="command", required=True)
  tr = sub.add_parser("train", help="run (or resume) an experiment")
  tr.add_argument("config", help="configs/*.py (with get_config()) or a run's config.json")
  tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="override a config field, e.g. --set rl.learning_rate=3e-4 (repeatable)")
  tr.add_argument("--resume", action="store_true",
                  help="continue the run in run_dir from its newest checkpoint")
  rep = sub.add_parser("report", help="rebuild a run folder's report")
  rep.add_argument("run_dir")
  sim = sub.add_parser("simulate", help="project a run's rollout makespan onto M workers")
  sim.add_argument("run_dir")
  sim.add_argument("--workers", type=int, action="append", required=True,
                   help="workers (decode slots or engines); repeatable")
  sim.add_argument("--window", type=int, default=4, help="history predictor: lengths kept per prompt")
  sim.add_argument("--steps-per-batch", type=int, default=1,
                   help="merge this many recorded steps into one batch (a larger cluster's batch)")
  sim.add_argument("--over-provision", type=float, default=1.25,
                   help="partial rollout: groups launched per group an update takes")
  sim.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
  cmp = sub.add_parser("compare", help="techniques vs uniform GRPO and their random controls, over seeds")
  cmp.add_argument("config", help="the base config")
  cmp.add_argument("--variants", required=True,
                   help="comma-separated algorithm.techniques values; 'grpo' is uniform GRPO, "
                        "'+' chains and '@KEY=VALUE' adds an override, e.g. "
                        "grpo,greso,random_greso,greso+vigor,vigor@algorithm.budget=64")
  cmp.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
  cmp.add_argument("--target", type=float, required=True, help="Q*, the held-out accuracy to reach")
  cmp.add_argument("--out", required=True, help="output folder (finished runs of the same config in it are reused)")
  cmp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the base config (repeatable)")
  lad = sub.add_parser("ladder", help="the stacked ablation: GRPO plus one component per rung, over seeds")
  lad.add_argument("config", help="the base config")
  lad.add_argument("--stack", required=True,
                   help="comma-separated components added in order: async, interrupt, lpt, probe, "
                        "partial, sorted, or a technique (greso, dapo, vigor, ...)")
  lad.add_argument("--pairs", default="partial:async,greso:lpt",
                   help="interference pairs A:B, comma-separated ('' for none)")
  lad.add_argument("--seeds", default="0", help="comma-separated seeds")
  lad.add_argument("--target", type=float, required=True, help="Q*, the held-out accuracy to reach")
  lad.add_argument("--out", required=True, help="output folder (finished runs of the same config in it are reused)")
  lad.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the base config (repeatable)")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax", "orbax", "orbax.checkpoint"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  if args.command == "simulate":
    from jaxroll.scheduling.simulate import simulate_run, to_markdown

    for m in args.workers:
      result = simulate_run(args.run_dir, m, args.window, steps_per_batch=args.steps_per_batch,
                            over_provision=args.over_provision)
      print(json.dumps(result) if args.json else to_markdown(result) + "\n")
    return 0
  if args.command == "compare":
    from jaxroll.compare import compare, to_markdown, variant_config

    base = config_lib.apply_overrides(config_lib.load(args.config), args.set)
    variants = [v.strip().replace("+", ",") for v in args.variants.split(",") if v.strip()]
    for v in variants:  # every variant is checked before any run starts
      variant_config(base, v)
    print(to_markdown(compare(base, variants, _seeds(args.seeds), args.target, args.out)))
    return 0
  if args.command == "ladder":
    from jaxroll import ladder as ladder_lib

    base = config_lib.apply_overrides(config_lib.load(args.config), args.set)
    stack = [c.strip() for c in args.stack.split(",") if c.strip()]
    pairs = ladder_lib.parse_pairs(args.pairs)
    seeds = _seeds(args.seeds)
    print(ladder_lib.to_markdown(ladder_lib.ladder(base, stack, seeds, args.target, args.out, pairs)))
    return 0
  if args.command == "report":
    from jaxroll.metrics.report import write_report

    print(write_report(args.run_dir))
    return 0
  from jaxroll import preflight, run_folder

  cfg = config_lib.apply_overrides(config_lib.load(args.config), args.set)
  plan = run_folder.plan_start(cfg, args.resume)
  task = preflight.check(cfg)
  from jaxroll import distributed

  distributed.initialize()  # joins a multi-host job when JAXROLL_* variables say so; else nothing
  from jaxroll.train import train  # heavy imports once the inputs are known to be valid

  try:
    result = train(cfg, resume=args.resume, plan=plan, task=task)
  except KeyboardInterrupt:
    print("jaxroll: interrupted; the same command with --resume continues from the last checkpoint "
          "(a run stopped before its first checkpoint starts again)", file=sys.stderr)
    return 130
  print(json.dumps(result, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
