"""The end-of-run report: C(q) and learning curves (PNG) and a Markdown summary.

It reads only the run folder (config.json, run_info.json, metrics.jsonl,
timing.jsonl), so `python -m jaxroll.metrics.report RUN_DIR` rebuilds it.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from jaxroll.metrics.cost import COST_UNITS, SECONDS_UNITS, cost_to_quality, quality_targets, unit_costs
from jaxroll.metrics.logger import read_jsonl
from jaxroll.run_folder import RunFolderError

_UNIT_LABELS = {"cumulative_train_s": "training wall-clock (s)",
                "cumulative_steady_s": "wall-clock net of compilation (s)",
                "cumulative_tokens": "generated tokens", "cumulative_rollouts": "rollouts"}


def _cost_text(unit: str, value: float) -> str:
  """Seconds with one decimal; tokens and rollouts are counts."""
  return f"{value:,.1f}" if unit in SECONDS_UNITS else f"{int(round(value)):,}"


def _joined(run_dir: str) -> list[dict]:
  timing = {t["step"]: t for t in read_jsonl(os.path.join(run_dir, "timing.jsonl"))}
  return [{**timing.get(m["step"], {}), **m} for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]


def _plots(run_dir: str, rows: list[dict], evals: list[dict]) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")  # files only; no display on training machines
  import matplotlib.pyplot as plt
  from matplotlib.ticker import EngFormatter, MaxNLocator

  q = [e["heldout_accuracy"] for e in evals]
  targets = quality_targets(q)
  fig, axes = plt.subplots(1, len(COST_UNITS), figsize=(4.3 * len(COST_UNITS), 3.6))
  for ax, unit in zip(axes, COST_UNITS):
    c = cost_to_quality(q, unit_costs(evals, unit), targets)
    reached = [(t, x) for t, x in zip(targets, c) if x is not None]
    # Quality reached by a given cost is a step function of the cost.
    ax.plot([x for _, x in reached], [t for t, _ in reached], drawstyle="steps-post")
    ax.set_xlabel(_UNIT_LABELS[unit])
    # Counts run to hundreds of thousands: short labels ("300k"), few ticks.
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylabel("held-out accuracy q")
    ax.set_title(f"C(q) in {_UNIT_LABELS[unit].split(' (')[0]}")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(run_dir, "cost_to_quality.png"), dpi=110)
  plt.close(fig)

  steps = [r["step"] for r in rows if r["step"] > 0]
  get = lambda k: [r.get(k) for r in rows if r["step"] > 0]
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
  axes[0].plot(steps, get("reward_mean"), label="train reward", lw=1)
  axes[0].plot([e["step"] for e in evals], q, marker="o", label="held-out accuracy")
  axes[0].set_xlabel("RL step")
  axes[0].legend()
  axes[0].grid(alpha=0.3)
  axes[1].plot(steps, get("length_mean"), label="mean length", lw=1)
  axes[1].plot(steps, get("length_p90"), label="p90 length", lw=1)
  axes[1].set_xlabel("RL step")
  axes[1].set_ylabel("tokens per response")
  axes[1].legend()
  axes[1].grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(run_dir, "curves.png"), dpi=110)
  plt.close(fig)
  images = ["cost_to_quality.png", "curves.png"]
  if any(r.get("spec_drafted_tokens") for r in rows):
    # Survey protocol 3: drafts from history may be accepted less as the
    # policy moves away from the answers they were taken from.
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(steps, get("spec_acceptance_rate"), label="acceptance rate", lw=1)
    ax.set_xlabel("RL step")
    ax.set_ylabel("drafted tokens accepted")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(steps, get("spec_tokens_per_forward"), color="C1", label="tokens per target forward", lw=1)
    twin.set_ylabel("tokens per target forward")
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "speculative.png"), dpi=110)
    plt.close(fig)
    images.append("speculative.png")
  return images


def _median(rows, key):
  vals = [r[key] for r in rows if r.get(key) is not None]
  return float(np.median(vals)) if vals else float("nan")


def _lengths(step: dict) -> str:
  """One step's response-length statistics and its unanimous groups, as checklist text
  (runs written before a statistic existed leave it out)."""
  if step.get("length_mean") is None:
    return "no rows"
  parts = [f"mean {step['length_mean']:.1f}"]
  if step.get("length_median") is not None:
    parts.append(f"median {step['length_median']:.0f}")
  parts.append(f"p90 {step['length_p90']:.0f}")
  if step.get("length_p99") is not None:
    parts.append(f"p99 {step['length_p99']:.0f} ({step['length_p99'] / max(step['length_median'], 1):.1f}x the median)")
  parts.append(f"CV_L {step['length_cv']:.2f}")
  if step.get("all_wrong_fraction") is not None:
    parts.append(f"groups all wrong {step['all_wrong_fraction']:.2f}, all right {step['all_right_fraction']:.2f}")
  return ", ".join(parts)


def _lever(schedule: dict, rollout: dict) -> str:
  """The checklist's lever line, from the run's schedule and rollout sections."""
  default = {"order": "fifo", "sorted_batches": 0, "over_provision": 1.0, "budgets": "",
             "truncation": "keep"}
  changed = {k: v for k, v in schedule.items() if k in default and v != default[k]}
  if rollout.get("speculative"):
    return (f"system lever, speculative decoding (rollout.speculative={rollout['speculative']}, "
            f"exact: the sampled distribution is unchanged)"
            + ("" if not changed else "; " + _lever(schedule, {})))
  if not changed:
    return ("neither in isolation: this is the synchronous GRPO baseline that "
            "system and algorithmic techniques are compared against")
  return ("system lever, long-tail rollout: " + ", ".join(f"schedule.{k}={v}" for k, v in changed.items())
          + (" (sorted_batches changes batch membership: a curriculum)" if "sorted_batches" in changed else ""))


def write_report(run_dir: str) -> str:
  """Writes run_dir/report.md (and its PNGs) and returns the Markdown path."""
  for name in ("config.json", "run_info.json", "metrics.jsonl"):
    if not os.path.isfile(os.path.join(run_dir, name)):
      raise RunFolderError(f"{run_dir}: no {name}, so no run to report on; pass a run folder "
                           "that `jaxroll train` wrote")
  with open(os.path.join(run_dir, "config.json")) as f:
    cfg = json.load(f)
  with open(os.path.join(run_dir, "run_info.json")) as f:
    info = json.load(f)
  rows = _joined(run_dir)
  evals = [r for r in rows if "heldout_accuracy" in r]
  steps = [r for r in rows if r["step"] > 0]
  if not evals or not steps:
    raise RunFolderError(f"{run_dir}: no RL steps or evaluations to report on yet")
  images = _plots(run_dir, rows, evals)
  q = [e["heldout_accuracy"] for e in evals]
  targets = quality_targets(q, num=5)
  table = ["| target q | " + " | ".join(_UNIT_LABELS[u] for u in COST_UNITS) + " |",
           "|---|" + "---|" * len(COST_UNITS)]
  costs = {u: unit_costs(evals, u) for u in COST_UNITS}
  costs = {u: cost_to_quality(q, c, targets) if c else None for u, c in costs.items()}
  cell = lambda u, i: ("not logged" if costs[u] is None else "not reached" if costs[u][i] is None
                       else _cost_text(u, costs[u][i]))
  for i, t in enumerate(targets):
    cells = [cell(u, i) for u in COST_UNITS]
    table.append(f"| {t:.3f} | " + " | ".join(cells) + " |")
  lengths_first, lengths_last = steps[0], steps[-1]
  r = cfg["rollout"]
  devices = ", ".join(sorted(set(info["devices"])))
  checklist = [
      ("Baseline system and version",
       f"none: a single jaxroll configuration (commit {info['git_commit']}); no other system is compared"),
      ("Phase measured",
       f"end to end (rollout + reward + update + weight sync; evaluation and checkpointing excluded); "
       f"median rollout share of step time {_median(steps, 'rollout_share'):.2f}"),
      ("Throughput metric and work unit",
       f"generated tokens per second of rollout (median {_median(steps, 'tokens_per_s'):,.0f}); "
       f"each step samples {r['prompts_per_step']} prompts x {r['group_size']} completions, "
       f"at most {r['max_new_tokens']} new tokens"),
      ("Aggregation statistic", f"medians over the {len(steps)} RL steps of this one run (seed {cfg['seed']}); "
       "no spread across seeds"),
      ("Cluster and accelerator", f"{info['device_count']} x {devices} ({info['processor']}, "
       f"{info['cpu_count']} CPUs, {info['platform']}); single process, no model parallelism"),
      ("Workload characteristics",
       f"task {cfg['task']['name']}; response length at the first RL step: "
       f"{_lengths(lengths_first)}; at the last: {_lengths(lengths_last)}"),
      ("Lever measured", _lever(cfg.get("schedule", {}), cfg["rollout"])),
      ("Quality evidence",
       f"held-out accuracy on {cfg['task']['num_heldout']} prompts x {cfg['eval_samples']} samples "
       f"(temperature {r['temperature']}) every {cfg['eval_every']} steps: {q[0]:.3f} after the "
       f"warm start, {q[-1]:.3f} at step {evals[-1]['step']}; C(q) is at matched quality"),
  ]
  degenerate = _median(steps, "degenerate_fraction")
  lines = [
      f"# jaxroll run report: {os.path.basename(os.path.abspath(run_dir))}", "",
      f"Held-out accuracy {q[0]:.3f} (warm start) -> {q[-1]:.3f} (step {evals[-1]['step']}), "
      f"a change of {100 * (q[-1] - q[0]):+.1f} points, in {steps[-1].get('cumulative_train_s', 0):.1f} s "
      f"of training, {steps[-1]['cumulative_tokens']:,} generated tokens and "
      f"{steps[-1]['cumulative_rollouts']:,} rollouts.", "",
      "## Cost to reach quality, C(q)", "",
      "Cost at the first evaluation whose held-out accuracy reached q.", "", *table, "",
      f"![C(q)]({images[0]})", "", "## Learning curves", "", f"![curves]({images[1]})", "",
      f"Rollout makespan per step: median {_median(steps, 'rollout_makespan_steps'):.0f} decode steps "
      f"on {r['num_slots']} slots, mean slot idle fraction "
      f"{float(np.mean([s.get('slot_idle_fraction', np.nan) for s in steps])):.3f}; tokens used "
      f"by updates one or more policy versions after they were sampled: "
      f"{sum(s.get('carried_tokens_in_update', 0) for s in steps):,}.", "",
      *([] if len(images) < 3 else [
          "## Speculative decoding", "",
          f"Median acceptance rate {_median(steps, 'spec_acceptance_rate'):.3f}, median tokens per "
          f"target forward {_median(steps, 'spec_tokens_per_forward'):.2f}, by step:", "",
          f"![speculative]({images[2]})", ""]),
      f"Median degenerate-group fraction: {degenerate:.2f}; reward-function errors "
      f"{sum(s.get('reward_errors', 0) for s in steps)}, timeouts "
      f"{sum(s.get('reward_timeouts', 0) for s in steps)}.", "",
      "## Reporting checklist (survey Section 8.5)", "",
      *[f"{i}. **{name}**: {text}." for i, (name, text) in enumerate(checklist, start=1)], "",
  ]
  path = os.path.join(run_dir, "report.md")
  with open(path, "w") as f:
    f.write("\n".join(lines))
  return path


if __name__ == "__main__":
  print(write_report(sys.argv[1]))
