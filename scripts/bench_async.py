"""Rollout/training overlap on the default task: synchronous vs the rollout thread.

  python scripts/bench_async.py [--write-docs] [--steps N] [--seeds 0,1] [--lags 1]

Runs synchronous GRPO, the rollout thread at each max_lag k in --lags (TIS
correction) and the interruptible mode at k=1, from the same warm-started
policy per seed (survey Section 8.7, protocol 4), 16 steps each on the
counted walk (about 25 minutes on 2 cores at the defaults). Reports per
variant: steps, wall-clock seconds and tokens to Q*, throughput, final
accuracy, and the median phase times per step (the trainer's wait for a
batch, the rollout thread's busy and idle time, the update). Then projects
the synchronous run's phases onto an 8-device layout
(jaxroll/pipeline/project.py), since two CPU cores cannot show the
overlap. Writes the pipeline section of docs/benchmarks.md.
"""

import argparse
import os
import platform
import statistics
import sys

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll import config as config_lib  # noqa: E402
from jaxroll.compare import baseline_targets, compare, summarise  # noqa: E402
from jaxroll.metrics.logger import read_jsonl  # noqa: E402
from jaxroll.pipeline.project import project_layouts  # noqa: E402

ASYNC = "grpo@pipeline.mode=async@pipeline.max_lag={k}@rl.off_policy=tis"
INTERRUPT = "grpo@pipeline.mode=interrupt@pipeline.max_lag=1@rl.off_policy=decoupled"
# Q*: halfway across the held-out accuracies every seed of synchronous GRPO
# traverses (jaxroll.compare.baseline_targets).
FRACTION = 0.5
STEPS, EVAL_EVERY = 16, 4


def _label(variant: str) -> str:
  if variant == "grpo":
    return "sync"
  opts = dict(o.split("=") for o in variant.split("@")[1:])
  return f"{opts['pipeline.mode']} k={opts['pipeline.max_lag']} ({opts['rl.off_policy']})"


def _phases(run_dir: str) -> dict:
  """Median seconds per step of each phase, steady state (first step: compilation)."""
  t = read_jsonl(os.path.join(run_dir, "timing.jsonl"))[2:]
  med = lambda k: statistics.median(x[k] for x in t)
  return {k: med(k) for k in ("train_wait_s", "rollout_busy_s", "rollout_idle_s", "update_s", "step_s")}


def _steps_to(run_dir: str, target: float):
  for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
    if m.get("heldout_accuracy", -1) >= target:
      return m["step"]
  return None


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=STEPS)
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--lags", default="1", help="comma-separated pipeline.max_lag values")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "pipeline"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  variants = ["grpo"] + [ASYNC.format(k=int(k)) for k in a.lags.split(",")] + [INTERRUPT]
  overrides = [f"steps={a.steps}", f"eval_every={EVAL_EVERY}", "checkpoint_every=1000", "progress=false",
               "tensorboard=false"]
  seeds = [int(s) for s in a.seeds.split(",")]
  base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")), overrides)
  compare(base, variants, seeds, 0.0, a.out_dir)  # runs (or reuses) every variant
  run = lambda v, s: os.path.join(a.out_dir, v, f"seed{s}")
  dirs = {(v, s): run(v, s) for v in variants for s in seeds}
  target = baseline_targets(dirs, [FRACTION])[0]
  summary = summarise(dirs, target)
  rows = ["| variant | seeds reaching Q* | final acc. | steps to Q* | wall-clock s to Q* | tokens/s "
          "| trainer waits | rollout busy | rollout idle | update | step |", "|---" * 11 + "|"]
  sync_s = summary.table["grpo"]["cumulative_train_s"]
  for v in variants:
    r = summary.table[v]
    steps = [_steps_to(run(v, s), target) for s in seeds]
    ph = [_phases(run(v, s)) for s in seeds]
    metrics = [read_jsonl(os.path.join(run(v, s), "metrics.jsonl"))[-1] for s in seeds]
    timing = [read_jsonl(os.path.join(run(v, s), "timing.jsonl"))[-1] for s in seeds]
    tput = statistics.fmean(m["cumulative_tokens"] / t["cumulative_train_s"] for m, t in zip(metrics, timing))
    mean = lambda k: statistics.fmean(p[k] for p in ph)
    reach = f"{statistics.fmean(steps):.1f}" if None not in steps else "not reached"
    secs = r["cumulative_train_s"]
    secs_txt = "not reached" if secs is None else (
        f"{secs:.1f}" + (f" ({sync_s / secs:.2f}x sync)" if sync_s and v != "grpo" else ""))
    rows.append(f"| {_label(v)} | {r['reached']}/{r['seeds']} | {r['final_accuracy']:.3f} | {reach} | "
                f"{secs_txt} | {tput:,.0f} | " + " | ".join(f"{mean(k):.3f}" for k in (
                    "train_wait_s", "rollout_busy_s", "rollout_idle_s", "update_s", "step_s")) + " |")
  inter = INTERRUPT
  interrupts = sum(m.get("rollout_interrupts", 0) for s in seeds
                   for m in read_jsonl(os.path.join(run(inter, s), "metrics.jsonl")))
  proj = [project_layouts(run("grpo", s)) for s in seeds]
  mean_phases = lambda v: {k: statistics.fmean(_phases(run(v, s))[k] for s in seeds)
                           for k in ("train_wait_s", "rollout_busy_s", "update_s", "step_s")}
  sync_all = mean_phases("grpo")
  lag1 = mean_phases(variants[1])
  pm = lambda k: statistics.fmean(p[k] for p in proj)
  lines = [
      "## Rollout/training overlap: synchronous vs the rollout thread (staleness sweep)", "",
      f"Measured by `python scripts/bench_async.py --write-docs` on {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs: `jaxroll compare configs/default.py` with `{' '.join(overrides[:2])}`, seeds "
      f"{a.seeds}, Q* = {target} (halfway across the range every seed of synchronous GRPO "
      f"traverses); variants `{variants[1]}` and so on (k = pipeline.max_lag). Phase "
      "columns are medians of seconds per step over the run, averaged over seeds: the trainer's wait for a "
      "batch, the rollout thread's time producing it and its idle time (waiting for weights or queue "
      "space), the update, and the whole step.", "",
      *rows, "",
      f"The interruptible mode stopped a batch for new weights {interrupts} times over its runs: a batch "
      "is decoded before the concurrent update publishes the next version.", "",
      "Rollout idle is, for the thread, its wait since its previous batch, which includes the "
      f"trainer's held-out evaluations (every {overrides[1].split('=')[1]} steps here); synchronously, the "
      "update. On two CPU cores both sides share the cores, so each runs slower while the other runs: "
      f"with {_label(variants[1])} the trainer waits {lag1['train_wait_s']:.2f} s per step (synchronously "
      f"{sync_all['train_wait_s']:.2f} s) and the median step takes {lag1['step_s']:.2f} s against "
      f"{sync_all['step_s']:.2f} s ({sync_all['step_s'] / lag1['step_s']:.2f}x). What separate devices would give follows from the "
      "synchronous runs' phases, projected onto 8 devices (batch x8, `jaxroll/pipeline/project.py`): "
      f"decode step {pm('t_decode_s') * 1e3:.2f} ms, update {pm('update_s') * 1e3:.1f} ms per recorded "
      f"step. Synchronously, the sampler's busy time is {sync_all['rollout_busy_s']:.2f} s and the update "
      f"{sync_all['update_s']:.2f} s of a {sync_all['step_s']:.2f} s step, so a perfect overlap of the two "
      f"would shorten the step at most {sync_all['step_s'] / max(sync_all['rollout_busy_s'], sync_all['update_s']):.2f}x.", "",
      "| layout (8 devices) | seconds per step | rollout devices |", "|---|---|---|",
      f"| colocated, synchronous | {pm('colocated_sync_s'):.3f} | 8 (time-sliced) |",
      f"| disaggregated, synchronous | {pm('disaggregated_sync_s'):.3f} | "
      f"{statistics.fmean(p['sync_rollout_devices'] for p in proj):.1f} |",
      f"| disaggregated, max_lag >= 1 | {pm('disaggregated_async_s'):.3f} | "
      f"{statistics.fmean(p['async_rollout_devices'] for p in proj):.1f} |", "",
      f"Projected gain of the overlapped layout: {pm('async_vs_colocated'):.2f}x over colocated synchronous, "
      f"{pm('async_vs_disaggregated_sync'):.2f}x over disaggregated synchronous.", "",
      "C(q) curves per cost unit: `bench_out/pipeline/cost_*.png`.",
  ]
  emit_section("pipeline", lines, a.write_docs)


if __name__ == "__main__":
  main()
