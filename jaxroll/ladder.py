"""`jaxroll ladder`: the stacked ablation (survey Section 8.7, protocol 2).

Starting from synchronous GRPO, each rung adds one component to the one
below it; every rung runs over the same seeds from the same warm-started
policy (jaxroll.compare.run_all) to the same number of steps, and reports
the cost to first reach held-out accuracy Q* in training seconds (with
and without preparing programs: tracing, lowering, XLA compilation),
generated tokens and rollouts, against the rung below and against GRPO.

Interference pairs (a, b) run GRPO + a, GRPO + b and GRPO + a + b. With
c_x the cost of x relative to GRPO's (< 1: cheaper), the pair's
interaction is c_ab / (c_a * c_b): 1 when the two gains multiply, > 1 when
they interfere (together they save less than the product), < 1 when they
reinforce. Two pairs the survey predicts to interfere: partial rollout x
async (both fill idle time) and a prompt filter x LPT (filtering changes
the length mix the scheduler sees). Speculation x LPT is a third worth
asking for (`--pairs spec:lpt`): LPT changes which rows decode together,
speculation each row's speed.

  out/<variant>/seed<k>/      each run (finished runs of the same config are reused)
  out/ladder.json, ladder.md  rungs, pairs, costs and ratios
  out/cost_<unit>.png         C(q) per rung and pair run
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from jaxroll import compare as compare_lib
from jaxroll import config as config_lib
from jaxroll.metrics.cost import COST_UNITS
from jaxroll.replay.registry import NAMES as TECHNIQUES

# Components that are config overrides; any technique of jaxroll.replay
# (and its random_ control) is a component too, added to the chain.
OVERRIDES = {
    "async": ["pipeline.mode=async", "pipeline.max_lag=1", "rl.off_policy=tis"],
    "interrupt": ["pipeline.mode=interrupt", "pipeline.max_lag=1", "rl.off_policy=decoupled"],
    "lpt": ["schedule.order=lpt"],
    "probe": ["schedule.order=lpt", "schedule.predictor=sibling_probe"],
    "partial": ["schedule.over_provision=1.25"],
    "sorted": ["schedule.sorted_batches=2"],
    # Exact speculative decoding: drafts from the prompt's earlier answers and the group's rows.
    "spec": ["rollout.speculative=history,siblings"],
    # The paged KV cache: the same tokens as the dense one, in less KV memory.
    "paged": ["rollout.kv_cache=paged"],
    # Quest page selection from a quarter of the pages, its budget moved by
    # Sparrow's controller, the gap corrected (truncated IS) and anomalous rows rejected.
    "sparse": ["rollout.kv_cache=paged", "rollout.kv_sparsity=quest", "rollout.kv_budget_p5=0.86",
               "rl.off_policy=tis", "rl.mismatch_reject=2.0"],
}
DEFAULT_PAIRS = (("partial", "async"), ("greso", "lpt"))
_UNITS = {"cumulative_train_s": "seconds", "cumulative_steady_s": "seconds net of compilation",
          "cumulative_tokens": "tokens", "cumulative_rollouts": "rollouts"}


def _is_technique(name: str) -> bool:
  return name.removeprefix("random_") in TECHNIQUES


def check_component(name: str) -> None:
  if name not in OVERRIDES and not _is_technique(name):
    raise config_lib.ConfigError(
        f"ladder component {name!r} is unknown (known: {', '.join(OVERRIDES)}, "
        f"and the techniques {', '.join(TECHNIQUES)}, each also as random_<name>)")


def variant(components: Sequence[str]) -> str:
  """The `jaxroll compare` variant of GRPO plus `components`, in their order."""
  for c in components:
    check_component(c)
  techniques = [c for c in components if _is_technique(c)]
  opts = [o for c in components if c in OVERRIDES for o in OVERRIDES[c]]
  return "@".join([",".join(techniques) or compare_lib.BASELINE, *opts])


def rungs(stack: Sequence[str]) -> list[tuple[str, str]]:
  """(label, variant) per rung: GRPO, then one more component each."""
  out = [("grpo", compare_lib.BASELINE)]
  for i in range(1, len(stack) + 1):
    out.append(("+" + stack[i - 1], variant(stack[:i])))
  return out


def pair_variants(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
  out = []
  for a, b in pairs:
    out += [(a, variant([a])), (b, variant([b])), (f"{a}+{b}", variant([a, b]))]
  return out


def _ratio(ref, x):
  return ref / x if ref and x else None  # > 1: fewer needed than the reference


def ladder(base: config_lib.ExperimentConfig, stack: Sequence[str], seeds: Sequence[int],
           target: float | dict[int, float],
           out_dir: str, pairs: Sequence[tuple[str, str]] = DEFAULT_PAIRS, train_fn=None) -> dict:
  """Runs the ladder and the pairs; returns (and writes) their costs and ratios."""
  dirs = run(base, stack, seeds, out_dir, pairs, train_fn)
  result = summarise(dirs, stack, seeds, target, pairs)
  with open(os.path.join(out_dir, "ladder.json"), "w") as f:
    json.dump(result, f, indent=2)
  with open(os.path.join(out_dir, "ladder.md"), "w") as f:
    f.write(to_markdown(result) + "\n")
  compare_lib.plot(dirs, out_dir)
  return result


def run(base: config_lib.ExperimentConfig, stack: Sequence[str], seeds: Sequence[int], out_dir: str,
        pairs: Sequence[tuple[str, str]] = DEFAULT_PAIRS, train_fn=None) -> dict[tuple[str, int], str]:
  """Trains every rung and pair run not already finished; returns their run folders."""
  ladder_runs, pair_runs = rungs(stack), pair_variants(pairs)
  variants = list(dict.fromkeys(v for _, v in ladder_runs + pair_runs))
  for v in variants:  # every variant is checked before any run starts
    compare_lib.variant_config(base, v)
  os.makedirs(out_dir, exist_ok=True)
  return compare_lib.run_all(base, variants, seeds, out_dir, train_fn)


def summarise(dirs: dict[tuple[str, int], str], stack: Sequence[str], seeds: Sequence[int],
              target: float | dict[int, float], pairs: Sequence[tuple[str, str]] = DEFAULT_PAIRS) -> dict:
  """The rungs' and pairs' costs to `target` (one Q*, or one per seed:
  compare.per_seed_targets) and their ratios, from finished runs."""
  ladder_runs = rungs(stack)
  table = compare_lib.summarise(dirs, target).table
  result = {"target": target, "seeds": list(seeds), "rungs": [], "pairs": []}
  prev = None
  for label, v in ladder_runs:
    row = table[v]
    entry = {"rung": label, "variant": v, "reached": row["reached"], "seeds_run": row["seeds"],
             "final_accuracy": row["final_accuracy"]}
    for u in COST_UNITS:
      entry[u] = row[u]
      entry[u + "_vs_previous"] = _ratio(prev[u], entry[u]) if prev else None
      entry[u + "_vs_grpo"] = _ratio(table[compare_lib.BASELINE][u], entry[u])
    result["rungs"].append(entry)
    prev = row
  base_row = table[compare_lib.BASELINE]
  for a, b in pairs:
    entry = {"pair": f"{a} x {b}"}
    for u in COST_UNITS:
      c0 = base_row[u]
      cost = {k: table[variant(parts)][u] for k, parts in (("a", [a]), ("b", [b]), ("ab", [a, b]))}
      rel = {k: c / c0 if c0 and c else None for k, c in cost.items()}
      entry[u] = rel
      entry[u + "_interaction"] = (rel["ab"] / (rel["a"] * rel["b"])
                                   if None not in rel.values() else None)
    result["pairs"].append(entry)
  return result


def to_markdown(result: dict) -> str:
  num = lambda x, f: "not reached" if x is None else f.format(x)
  ratio = lambda x: "n/a" if x is None else f"{x:.2f}x"
  lines = [f"Cost to first reach held-out accuracy Q* = {compare_lib.target_text(result['target'])} (mean over seeds "
           f"{','.join(map(str, result['seeds']))}); ratios > 1 mean cheaper than the reference.", "",
           "| rung | seeds reaching Q* | final acc. | seconds | seconds net of compilation | tokens | "
           "rollouts | seconds vs previous | tokens vs previous | seconds vs GRPO | "
           "net seconds vs GRPO | tokens vs GRPO | rollouts vs GRPO |",
           "|---" * 13 + "|"]
  for r in result["rungs"]:
    # Every seed reached Q* (counted in rollouts) yet no net seconds: a run
    # logged before jaxroll kept the compile clock.
    unlogged = r["cumulative_steady_s"] is None and r["reached"] == r["seeds_run"]
    lines.append(
        f"| {r['rung']} | {r['reached']}/{r['seeds_run']} | {r['final_accuracy']:.3f} | "
        f"{num(r['cumulative_train_s'], '{:,.1f}')} | "
        f"{'not logged' if unlogged else num(r['cumulative_steady_s'], '{:,.1f}')} | "
        f"{num(r['cumulative_tokens'], '{:,.0f}')} | "
        f"{num(r['cumulative_rollouts'], '{:,.0f}')} | {ratio(r['cumulative_train_s_vs_previous'])} | "
        f"{ratio(r['cumulative_tokens_vs_previous'])} | {ratio(r['cumulative_train_s_vs_grpo'])} | "
        f"{ratio(r['cumulative_steady_s_vs_grpo'])} | "
        f"{ratio(r['cumulative_tokens_vs_grpo'])} | {ratio(r['cumulative_rollouts_vs_grpo'])} |")
  if result["pairs"]:
    lines += ["", "Interference pairs: cost relative to GRPO of a, b and a + b, and the interaction "
              "c_ab / (c_a c_b) (1: the gains multiply; > 1: they interfere; < 1: they reinforce).", "",
              "| pair | unit | a | b | a + b | interaction |", "|---|---|---|---|---|---|"]
    rel = lambda x: "n/a" if x is None else f"{x:.2f}"
    for p in result["pairs"]:
      for u, name in _UNITS.items():
        c = p[u]
        lines.append(f"| {p['pair']} | {name} | {rel(c['a'])} | {rel(c['b'])} | {rel(c['ab'])} | "
                     f"{rel(p[u + '_interaction'])} |")
  return "\n".join(lines)


def parse_pairs(text: str) -> list[tuple[str, str]]:
  out = []
  for item in (t.strip() for t in text.split(",") if t.strip()):
    a, sep, b = item.partition(":")
    if not sep or not a or not b:
      raise config_lib.ConfigError(f"--pairs item {item!r}: expected A:B (e.g. partial:async)")
    check_component(a)
    check_component(b)
    out.append((a, b))
  return out
