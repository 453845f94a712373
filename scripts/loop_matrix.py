"""Every pipeline x schedule x algorithm combination of the loop, run and checked.

  python scripts/loop_matrix.py [--pairwise] [--steps 4] [--out-dir bench_out/loop_matrix]

Runs a tiny config (1-layer policy, 4 prompts x 4 samples) for a few steps
per combination, from one shared warm start, and checks each run folder
against jaxroll.loop.invariants (lag, token age, groups, rollouts). Every
run is also resumed from its step-2 checkpoint (as after a kill: the later
checkpoints are gone): a synchronous one's metrics.jsonl and lengths.jsonl
must equal the uninterrupted run's byte for byte; an asynchronous one must
keep the invariants (no batch lost or repeated) and its first records.
--resume sync resumes only the synchronous runs. The full product is
3 x 5 x 6 = 90 runs (about half an hour on 2 cores); --pairwise runs 30
that cover every pair of values (about 8 minutes); --each-once runs 6 that
hold every value (what tests/test_loop_matrix.py runs, 1.5 minutes).
Exits 1 if any run fails or breaks a rule.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PIPELINES = {
    "sync": [],
    "async1": ["pipeline.mode=async", "pipeline.max_lag=1", "rl.off_policy=tis"],
    "interrupt": ["pipeline.mode=interrupt", "pipeline.max_lag=1", "rl.off_policy=decoupled",
                  "pipeline.interrupt_every=2"],
}
SCHEDULES = {
    "fifo": [],
    "lpt_history": ["schedule.order=lpt"],
    "lpt_probe": ["schedule.order=lpt", "schedule.predictor=sibling_probe"],
    "over_provision": ["schedule.over_provision=1.25", "schedule.max_age=2"],
    "sorted": ["schedule.sorted_batches=2"],
}
ALGORITHMS = {"none": [], **{a: [f"algorithm.techniques={a}"]
                             for a in ("dapo", "greso", "pods", "vigor", "popo")}}
TINY = [
    "eval_samples=2", "checkpoint_every=2", "progress=false", "report=false", "tensorboard=false",
    "task.num_train=24", "task.num_heldout=8", "task.max_steps=6",
    "policy.hidden_size=32", "policy.num_layers=1", "policy.num_heads=2", "policy.num_kv_heads=1",
    "policy.mlp_dim=64", "warm_start.steps=30", "warm_start.batch_size=16",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.num_slots=8",
    "rollout.max_new_tokens=12", "rl.minibatches=2",
]


def combinations(pairwise: bool, each_once: bool = False) -> list[tuple[str, str, str]]:
  """The full product; or 30 combinations covering every pair of values:
  each schedule x algorithm once, the pipeline cycling so that it meets
  every schedule and every algorithm; or (`each_once`) 6 that hold every
  value at least once, every schedule and algorithm beside a different
  partner of the other two."""
  p, s, a = list(PIPELINES), list(SCHEDULES), list(ALGORITHMS)
  if each_once:
    return [(p[j % len(p)], s[(j + 1) % len(s)], a[j]) for j in range(len(a))]
  if not pairwise:
    return list(itertools.product(p, s, a))
  return [(p[(i + j) % len(p)], s[i], a[j]) for i in range(len(s)) for j in range(len(a))]


def overrides(combo, steps: int, run_dir: str, warm: str) -> list[str]:
  pipe, sched, alg = combo
  return [*TINY, f"steps={steps}", f"eval_every={steps}", f"run_dir={run_dir}",
          *([f"warm_start.from_dir={warm}"] if warm else []),
          *PIPELINES[pipe], *SCHEDULES[sched], *ALGORITHMS[alg]]


def _resume_problems(run_dir: str, cfg, train, exact: bool) -> list[str]:
  """Resumes a copy of a finished run from its step-2 checkpoint. `exact`
  (synchronous): names the records that differ from the uninterrupted
  run's; else (the rollout thread's timing decides which weights sample)
  the resumed run must keep the invariants and steps 1-2 as they were."""
  import dataclasses

  from jaxroll.loop.invariants import violations
  from jaxroll.metrics.logger import read_jsonl

  copy = run_dir + "-resumed"
  shutil.rmtree(copy, ignore_errors=True)
  shutil.copytree(run_dir, copy)
  for step in os.listdir(os.path.join(copy, "checkpoints")):
    if step.isdigit() and int(step) > 2:
      shutil.rmtree(os.path.join(copy, "checkpoints", step))
  train(dataclasses.replace(cfg, run_dir=copy), resume=True)
  read = lambda d, f: open(os.path.join(d, f)).read()
  if exact:
    return [f"resume: {f} differs from the uninterrupted run's" for f in ("metrics.jsonl", "lengths.jsonl")
            if read(copy, f) != read(run_dir, f)]
  out = [f"resume: {v}" for v in violations(copy)]
  kept = lambda d: [m for m in read_jsonl(os.path.join(d, "metrics.jsonl")) if m["step"] <= 2]
  if kept(copy) != kept(run_dir):
    out.append("resume: the records up to the checkpoint changed")
  return out


def run_matrix(combos, steps: int, out_dir: str, log=print, resume: str = "all") -> dict[tuple, list[str]]:
  """Trains every combination and resumes it ("all"), the synchronous ones
  only ("sync") or none ("none"); returns each one's problems (empty: it held)."""
  from jaxroll import config as config_lib
  from jaxroll.loop.invariants import violations
  from jaxroll.train import train

  results, warm = {}, ""
  for combo in combos:
    run_dir = os.path.join(out_dir, "-".join(combo))
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
      cfg = config_lib.apply_overrides(config_lib.ExperimentConfig(), overrides(combo, steps, run_dir, warm))
      train(cfg)
      results[combo] = violations(run_dir)
      if resume == "all" or (resume == "sync" and combo[0] == "sync"):
        results[combo] += _resume_problems(run_dir, cfg, train, exact=combo[0] == "sync")
    except Exception as e:  # a combination that fails is a result, not the end of the matrix
      results[combo] = [f"{type(e).__name__}: {e}"]
    if not warm and not results[combo]:
      warm = os.path.join(run_dir, "warm_start")
      # Later runs read the warm start from a folder the matrix keeps.
      shutil.copytree(warm, os.path.join(out_dir, "warm_start"), dirs_exist_ok=True)
      warm = os.path.join(out_dir, "warm_start")
    log(f"{' x '.join(combo)}: {'ok' if not results[combo] else '; '.join(results[combo])}")
  return results


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--pairwise", action="store_true")
  ap.add_argument("--each-once", action="store_true")
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--resume", choices=("all", "sync", "none"), default="all")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "loop_matrix"))
  a = ap.parse_args()
  results = run_matrix(combinations(a.pairwise, a.each_once), a.steps, a.out_dir, resume=a.resume)
  bad = [c for c, v in results.items() if v]
  print(f"{len(results) - len(bad)}/{len(results)} combinations ran and kept every invariant")
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
