"""`jaxroll compare`: techniques against uniform GRPO and their random controls.

Runs one config per variant and seed, to the same number of steps, and reports the cost
to first reach a held-out accuracy Q* in rollouts, generated tokens and
training seconds: mean and spread over seeds, the ratio to uniform GRPO,
and for each technique X with a `random_X` variant the ratio to its
matched-rate random control (survey Section 8.7, protocol 1).

A variant is a value of `algorithm.techniques` ("grpo" is the empty
chain), optionally followed by config overrides after "@":
"vigor@algorithm.budget=64" or "grpo@rollout.group_size=4". The control of
"X@opts" is "random_X@opts".

Runs of one seed share a warm-started policy (the first run's
run_dir/warm_start), so they differ only in the RL phase. A finished run in
the output folder is reused, so an interrupted comparison resumes; one that
ran another config is refused by name before anything trains.

  out/<variant>/seed<k>/   each run's folder
  out/compare.json         per-run costs and the summary
  out/compare.md           the table
  out/cost_<unit>.png      C(q) per variant (mean over seeds), one plot per cost unit
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from typing import Any, Sequence

from jaxroll import config as config_lib
from jaxroll import run_folder
from jaxroll.metrics.cost import COST_UNITS, cost_to_quality, unit_costs
from jaxroll.metrics.logger import read_jsonl

BASELINE = "grpo"
_LABELS = {"cumulative_rollouts": "rollouts", "cumulative_tokens": "generated tokens",
           "cumulative_train_s": "training seconds",
           "cumulative_steady_s": "training seconds net of compilation"}


def variant_config(base: config_lib.ExperimentConfig, variant: str, **fields) -> config_lib.ExperimentConfig:
  """The config of one variant: its techniques and overrides on `base`, then
  `fields` (flat keys with "." written as "__"). Raises ConfigError."""
  techniques, *opts = variant.split("@")
  for o in opts:
    if "=" not in o:
      raise config_lib.ConfigError(f"variant {variant!r}: override {o!r} is not KEY=VALUE")
  flat = {"algorithm.techniques": "" if techniques == BASELINE else techniques}
  flat.update({k.replace("__", "."): v for k, v in fields.items()})
  return config_lib.apply_overrides(config_lib.from_flat_dict(flat, base), opts)


def _control(variant: str) -> str:
  techniques, sep, opts = variant.partition("@")
  return "random_" + techniques + sep + opts


def _finished(run_dir: str, steps: int) -> bool:
  metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  return bool(metrics) and metrics[-1]["step"] == steps


# Keys that change where and how a run reports, not what it measures.
_NOT_MEASURED = {"run_dir", "progress", "tensorboard", "checkpoint_every", "report"}


def _check_reusable(run_dir: str, cfg: config_lib.ExperimentConfig) -> None:
  """A finished run is reused only if it ran `cfg`: one run at another
  setting (say eval_every) would put unlike costs in one table."""
  saved = config_lib.to_flat_dict(config_lib.load(os.path.join(run_dir, "config.json")))
  wanted = config_lib.to_flat_dict(cfg)
  for flat in (saved, wanted):
    if flat.get("warm_start.from_dir"):
      flat["warm_start.from_dir"] = os.path.abspath(flat["warm_start.from_dir"])
  diffs = config_lib.flat_differences(saved, wanted, "that run", "asked for", ignore=_NOT_MEASURED)
  if diffs:
    raise config_lib.ConfigError(f"{run_dir} holds a finished run of another config ({'; '.join(diffs)}); "
                                 "remove that folder or pass another output folder")


def _costs(run_dir: str) -> tuple[list[float], dict[str, list[float]]]:
  """Held-out accuracy at each evaluation and the cumulative costs there."""
  metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  timing = {t["step"]: t for t in read_jsonl(os.path.join(run_dir, "timing.jsonl"))}
  evals = [{**timing.get(m["step"], {}), **m} for m in metrics if "heldout_accuracy" in m]
  q = [e["heldout_accuracy"] for e in evals]
  cost = {u: unit_costs(evals, u) for u in COST_UNITS}
  return q, cost


def run_all(base: config_lib.ExperimentConfig, variants: Sequence[str], seeds: Sequence[int],
            out_dir: str, train_fn=None) -> dict[tuple[str, int], str]:
  """Trains every (variant, seed) not already finished; returns their run folders."""
  if train_fn is None:
    from jaxroll.train import train as train_fn
  if BASELINE not in variants:
    raise config_lib.ConfigError(f"--variants must include the uniform baseline {BASELINE!r}")
  dirs, cfgs = {}, []
  for seed in seeds:
    # The caller's warm-started policy, when the base config names one, is
    # every run's; else the baseline's first run warm-starts, and the rest load it.
    warm = base.warm_start.from_dir
    for variant in [BASELINE] + [v for v in variants if v != BASELINE]:
      run_dir = os.path.join(out_dir, variant, f"seed{seed}")
      dirs[variant, seed] = run_dir
      fields = {"seed": seed, "run_dir": run_dir, "report": False}
      if warm:
        fields["warm_start__from_dir"] = warm
      cfgs.append(variant_config(base, variant, **fields))
      if base.warm_start.steps and not warm:
        warm = os.path.join(run_dir, "warm_start")
  # Every finished run is checked before anything trains.
  finished = [_finished(cfg.run_dir, cfg.steps) for cfg in cfgs]
  for cfg, done in zip(cfgs, finished):
    if done:
      _check_reusable(cfg.run_dir, cfg)
  for cfg in [c for c, done in zip(cfgs, finished) if not done]:  # the baseline's warm start first
    train_fn(cfg, resume=run_folder.state(cfg.run_dir) == "resumable")
  return dirs


@dataclasses.dataclass
class Summary:
  target: float
  per_run: dict[str, dict[str, Any]]
  table: dict[str, dict[str, Any]]


def summarise(dirs: dict[tuple[str, int], str], target: float | dict[int, float]) -> Summary:
  """`target`: one Q* for every run, or one per seed (`per_seed_targets`)."""
  per_run, by_variant = {}, {}
  for (variant, seed), run_dir in dirs.items():
    q, cost = _costs(run_dir)
    q_star = target[seed] if isinstance(target, dict) else target
    to_target = {u: cost_to_quality(q, cost[u], [q_star])[0] for u in COST_UNITS}
    per_run[f"{variant}/seed{seed}"] = {"final_accuracy": q[-1], "best_accuracy": max(q), **to_target}
    by_variant.setdefault(variant, []).append(per_run[f"{variant}/seed{seed}"])
  table = {}
  for variant, runs in by_variant.items():
    row = {"seeds": len(runs), "reached": sum(r["cumulative_rollouts"] is not None for r in runs),
           "final_accuracy": statistics.fmean(r["final_accuracy"] for r in runs)}
    for u in COST_UNITS:
      vals = [r[u] for r in runs if r[u] is not None]
      # A mean over seeds only when every seed reached Q*.
      row[u] = statistics.fmean(vals) if len(vals) == len(runs) else None
      row[u + "_sd"] = statistics.stdev(vals) if len(vals) == len(runs) and len(vals) > 1 else None
    table[variant] = row
  base = table.get(BASELINE, {})
  for variant, row in table.items():
    control = table.get(_control(variant))
    for u in COST_UNITS:
      ratio = lambda ref: (ref[u] / row[u]) if ref and ref.get(u) and row[u] else None
      row[u + "_vs_grpo"] = ratio(base)  # > 1: fewer needed than uniform GRPO
      row[u + "_vs_control"] = ratio(control)
  return Summary(target, per_run, table)


def baseline_targets(dirs: dict[tuple[str, int], str], fractions: Sequence[float]) -> list[float]:
  """Held-out accuracies a fraction of the way across the range every seed of
  uniform GRPO traverses: from the best warm start to the lowest of the
  seeds' best accuracies, rounded to 3 decimals. Every GRPO seed starts
  below such a target and reaches it, and it is set before any technique
  is looked at."""
  curves = [_costs(d)[0] for (v, _), d in dirs.items() if v == BASELINE]
  if not curves:
    raise ValueError(f"no {BASELINE!r} runs to set targets from")
  lo, hi = max(q[0] for q in curves), min(max(q) for q in curves)
  if hi <= lo:
    raise ValueError(f"uniform GRPO does not improve on its warm start on every seed "
                     f"(best warm start {lo:.3f}, lowest best {hi:.3f}): no target to set")
  return [round(lo + f * (hi - lo), 3) for f in fractions]


def per_seed_targets(dirs: dict[tuple[str, int], str], fraction: float) -> dict[int, float]:
  """Per seed, the held-out accuracy `fraction` of the way from that seed's
  uniform-GRPO warm start to its best, rounded to 3 decimals: for seeds
  whose warm starts differ so much that no one target lies in every GRPO
  seed's range (baseline_targets). Each seed's variants are then measured
  against its own GRPO run, which they share a warm start with."""
  out = {}
  for (v, seed), d in dirs.items():
    if v != BASELINE:
      continue
    q = _costs(d)[0]
    if max(q) <= q[0]:
      raise ValueError(f"uniform GRPO seed {seed} does not improve on its warm start "
                       f"({q[0]:.3f}): no target to set")
    out[seed] = round(q[0] + fraction * (max(q) - q[0]), 3)
  if not out:
    raise ValueError(f"no {BASELINE!r} runs to set targets from")
  return out


def target_text(target: float | dict[int, float]) -> str:
  if isinstance(target, dict):
    return "per seed (" + ", ".join(f"seed {s}: {t:.3f}" for s, t in sorted(target.items())) + ")"
  return f"{target:.3f}"


def to_markdown(s: Summary) -> str:
  fmt = lambda x, f="{:,.0f}": "not reached" if x is None else f.format(x)
  ratio = lambda x: "n/a" if x is None else f"{x:.2f}x"
  lines = [f"Cost to first reach held-out accuracy Q* = {target_text(s.target)} (mean over seeds, ± sd); "
           "ratios > 1 mean fewer needed than the reference.", "",
           "| variant | seeds reaching Q* | final acc. | rollouts to Q* | tokens to Q* | seconds to Q* | "
           "seconds net of compilation | rollouts vs GRPO | rollouts vs random control |",
           "|---|---|---|---|---|---|---|---|---|"]
  for variant, r in s.table.items():
    sd = lambda u: "" if r[u + "_sd"] is None else f" ± {r[u + '_sd']:,.0f}"
    lines.append(
        f"| {variant} | {r['reached']}/{r['seeds']} | {r['final_accuracy']:.3f} | "
        f"{fmt(r['cumulative_rollouts'])}{sd('cumulative_rollouts')} | "
        f"{fmt(r['cumulative_tokens'])}{sd('cumulative_tokens')} | "
        f"{fmt(r['cumulative_train_s'], '{:,.1f}')} | {fmt(r['cumulative_steady_s'], '{:,.1f}')} | "
        f"{ratio(r['cumulative_rollouts_vs_grpo'])} | "
        f"{ratio(r['cumulative_rollouts_vs_control'])} |")
  return "\n".join(lines)


def plot(dirs: dict[tuple[str, int], str], out_dir: str, num: int = 12) -> list[str]:
  """C(q) per variant, mean over the seeds that reached each q; one figure per cost unit."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  curves = {key: _costs(d) for key, d in dirs.items()}
  lo = max(q[0] for q, _ in curves.values())
  hi = min(max(q) for q, _ in curves.values())
  targets = np.linspace(lo, hi, num) if hi > lo else np.array([hi])
  paths = []
  for u in COST_UNITS:
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in sorted({v for v, _ in dirs}):
      per_seed = [cost_to_quality(q, c[u], targets) for (v, _), (q, c) in curves.items() if v == variant]
      mean = [statistics.fmean(col) if all(x is not None for x in col) else None for col in zip(*per_seed)]
      xs = [m for m in mean if m is not None]
      ax.plot(xs, targets[:len(xs)], marker="o", ms=3, label=variant,
              linestyle="--" if variant.startswith("random_") else "-")
    ax.set_xlabel(_LABELS[u])
    ax.set_ylabel("held-out accuracy q")
    ax.set_title(f"C(q) in {_LABELS[u]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"cost_{_LABELS[u].replace(' ', '_')}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def compare(base: config_lib.ExperimentConfig, variants: Sequence[str], seeds: Sequence[int],
            target: float, out_dir: str, train_fn=None) -> Summary:
  os.makedirs(out_dir, exist_ok=True)
  dirs = run_all(base, variants, seeds, out_dir, train_fn)
  s = summarise(dirs, target)
  with open(os.path.join(out_dir, "compare.json"), "w") as f:
    json.dump({"target": target, "per_run": s.per_run, "table": s.table}, f, indent=2)
  with open(os.path.join(out_dir, "compare.md"), "w") as f:
    f.write(to_markdown(s) + "\n")
  plot(dirs, out_dir)
  return s
