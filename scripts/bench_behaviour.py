"""Rollout-policy methods on the default task: GRPO, Nested-ReFT and R2PO.

  python scripts/bench_behaviour.py [--write-docs] [--seeds 0,1] [--steps 12] [--layers 2|4] [--shared]

`jaxroll compare configs/default.py`, every variant of a seed from the same
warm-started policy:

  grpo            the policy samples its own rollouts
  nested-1/2      (2 layers) behaviour.kind=nested: the first layer alone
  nested-1/2-any  (2 layers) one layer, re-drawn among both every step
  nested-3/4      (--layers 4) the first, the last and one middle layer re-drawn per step
  nested-1/2      (--layers 4) the first and last layers
  r2po            behaviour.kind=r2po, the residual rollout head
  r2po-lr1e-2     the same with behaviour.head_learning_rate=0.01

Nested-ReFT corrects with rl.off_policy=tis. With --layers 4 (Nested-ReFT
at two layer fractions) the warm start runs at learning rate 2e-3: at the
default's 5e-3 the deeper policy ends its 600 steps at held-out accuracy 0
(at 2e-3, 0.26). Each depth writes its own section of docs/benchmarks.md.

Reported: cost to Q* in rollouts, tokens and seconds (Q* halfway across
the range every GRPO seed traverses, or per seed when the warm starts lie
too far apart for one); the decode speed of each behaviour
model against the full policy, measured in this process on one fixed-length
batch, alternating, median of 5; the runs' median rollout tokens/s; the
rollout diversity R2PO claims (distinct responses per group); and the
behaviour-policy gap the update corrects (importance weights' effective
sample size and capped fraction). About 30 minutes on 2 cores at 2 layers.
Finished runs in --out-dir are reused, so a second call only measures the
decode speeds and writes the section again.
"""

import argparse
import os
import platform
import statistics
import sys
import time

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
from jaxroll import config as config_lib  # noqa: E402
from jaxroll.compare import (baseline_targets, per_seed_targets, run_all, summarise,  # noqa: E402
                             to_markdown, variant_config)
from jaxroll.metrics.logger import read_jsonl  # noqa: E402

# Nested-ReFT variants per policy depth: (label, layer fraction, keep_ends).
NESTED = {2: [("nested-1/2", 0.5, True), ("nested-1/2-any", 0.5, False)],
          4: [("nested-3/4", 0.75, True), ("nested-1/2", 0.5, True)]}
# The 4-layer policy diverges at the default warm-start rate (see above).
WARM_START = {2: [], 4: ["warm_start.learning_rate=2e-3"]}
FRACTION = 0.5
STEPS, EVAL_EVERY = 12, 4


def variants(layers: int) -> dict[str, tuple[str, float, bool]]:
  """label -> (compare variant, layer fraction of the behaviour model, rollout head)."""
  out = {"grpo": ("grpo", 1.0, False)}
  for label, f, ends in NESTED[layers]:
    out[label] = (f"grpo@behaviour.kind=nested@behaviour.layer_fraction={f}"
                  f"@behaviour.keep_ends={str(ends).lower()}@rl.off_policy=tis", f, False)
  out["r2po"] = ("grpo@behaviour.kind=r2po", 1.0, True)
  # At its default rate the head hardly moves in a dozen steps; ten times faster it acts.
  out["r2po-lr1e-2"] = ("grpo@behaviour.kind=r2po@behaviour.head_learning_rate=0.01", 1.0, True)
  return out


def decode_speed(base, entries, reps: int = 5) -> dict[str, float]:
  """Tokens/s per (name, layer fraction, with a rollout head): one
  fixed-length batch each (no stop tokens), alternating, medians."""
  import jax
  import numpy as np

  from jaxroll import preflight
  from jaxroll.behaviour.nested_reft import draw_layers, kept_layer_count
  from jaxroll.model.layer_subset import subset_config, subset_graphdef, subset_state
  from jaxroll.model.residual_head import init_residual_head
  from jaxroll.rollout import RolloutEngine
  from jaxroll.task_setup import build_policy

  task = preflight.check(base)
  mcfg, graphdef, params = build_policy(base, task.tokenizer)
  r = base.rollout
  prompts = [list(p) for p in task.train_tokens[:r.prompts_per_step]]
  new_tokens = 128
  runs = {}
  for name, (_, fraction, head) in entries.items():
    keep = kept_layer_count(mcfg.num_layers, fraction)
    layers = draw_layers(mcfg.num_layers, keep, True, 0, 0)
    engine = RolloutEngine(subset_config(mcfg, keep), subset_graphdef(mcfg, keep), num_slots=r.num_slots,
                           max_prompt_len=r.max_prompt_len, max_new_tokens=new_tokens)
    residual = (init_residual_head(jax.random.key(0), mcfg.hidden_size, mcfg.vocab_size)
                if head else None)
    runs[name] = (engine, engine.load(subset_state(params, layers), residual=residual))
  times = {name: [] for name in runs}
  tokens = len(prompts) * r.group_size * new_tokens
  for rep in range(reps + 1):  # the first round compiles
    for name, (engine, dparams) in runs.items():
      t0 = time.perf_counter()
      traj = engine.rollout(dparams, prompts, group_size=r.group_size, key=jax.random.key(rep))
      dt = time.perf_counter() - t0
      assert int(np.sum(traj.length_N)) == tokens
      if rep:
        times[name].append(dt)
  return {name: tokens / statistics.median(t) for name, t in times.items()}


def _run_stats(run_dir: str) -> dict[str, float]:
  metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[1:]
  timing = read_jsonl(os.path.join(run_dir, "timing.jsonl"))[1:]
  mean = lambda k: statistics.fmean(m[k] for m in metrics if m.get(k) is not None)
  return {"tokens_per_s": statistics.median(t["tokens_per_s"] for t in timing),
          "distinct": mean("distinct_responses_mean"), "ess": mean("is_ess"),
          "distinct_N": [m["distinct_responses_mean"] for m in metrics],
          "capped": mean("is_capped_fraction"), "length": mean("length_mean"),
          "reward": mean("reward_mean"),
          "head_kl": mean("r2po_head_kl") if "r2po_head_kl" in metrics[0] else None}


def findings(table, table_of, speed, stats) -> list[str]:
  """What matched the papers' claims and what did not, from the numbers above."""
  mean = lambda name, k: statistics.fmean(x[k] for x in stats[name])
  grpo = table["grpo"]
  out = []
  for name, (v, f, head) in table_of.items():
    if name == "grpo":
      continue
    row = table[v]
    acc = (f"final held-out accuracy {row['final_accuracy']:.3f} vs GRPO's {grpo['final_accuracy']:.3f}; "
           f"Q* reached on {row['reached']}/{row['seeds']} seeds")
    sec = row["cumulative_train_s_vs_grpo"]
    cost = "" if sec is None else f", GRPO's seconds to Q* / its seconds = {sec:.2f}x"
    if not head:
      reward = mean(name, "reward")
      if reward < 0.25 * mean("grpo", "reward"):
        cost += (f"; its rollouts earn mean reward {reward:.3f} against the full policy's "
                 f"{mean('grpo', 'reward'):.3f}: the layer subset of a policy trained with every "
                 "layer rarely answers right, so its groups carry almost no signal to correct")
      out.append(f"- {name}: decodes {speed[name] / speed['grpo']:.2f}x the full policy's tokens/s "
                 f"(Nested-ReFT claims higher tokens/s: {'matched' if speed[name] > speed['grpo'] else 'not matched'}); "
                 f"{acc}{cost} (the paper claims accuracy matching the baseline with its bias mitigations).")
    else:
      # Paired over (seed, step): the same warm start and prompts, so the
      # per-step difference in distinct responses isolates the head.
      diff = [a - b for x, y in zip(stats[name], stats["grpo"]) for a, b in zip(x["distinct_N"], y["distinct_N"])]
      m, se = statistics.fmean(diff), statistics.stdev(diff) / len(diff) ** 0.5
      verdict = "matched" if m > 2 * se else "not shown (within two standard errors)"
      if mean(name, "head_kl") < 1e-3:
        verdict += (f", but the head stayed within KL {mean(name, 'head_kl'):.0e} nats per token of the "
                    "policy, so the difference is the runs drifting apart (token flips at near-ties), "
                    "not the head steering")
      out.append(f"- {name}: distinct responses per group {mean(name, 'distinct'):.2f} vs GRPO's "
                 f"{mean('grpo', 'distinct'):.2f}, paired difference {m:+.2f} ± {se:.2f} per step (R2PO "
                 f"claims more diverse rollouts: {verdict}); {acc}{cost} (the paper claims higher "
                 f"accuracy); decoding with the head runs at {speed[name] / speed['grpo']:.2f}x the "
                 "policy's tokens/s.")
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--steps", type=int, default=STEPS)
  ap.add_argument("--layers", type=int, default=2, choices=sorted(NESTED),
                  help="policy depth (2: the default's; 4 gives Nested-ReFT two fractions)")
  ap.add_argument("--only", default="", help="comma-separated variant labels to run (grpo is always run)")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "behaviour"))
  ap.add_argument("--write-docs", action="store_true")
  ap.add_argument("--shared", action="store_true",
                  help="say in the docs that other work shared the machine during the runs")
  a = ap.parse_args()
  overrides = [f"steps={a.steps}", f"eval_every={EVAL_EVERY}", f"policy.num_layers={a.layers}",
               *WARM_START[a.layers], "checkpoint_every=1000", "progress=false", "tensorboard=false"]
  shown = overrides[:3 + len(WARM_START[a.layers])]
  base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")), overrides)
  seeds = [int(s) for s in a.seeds.split(",")]
  table_of = variants(a.layers)
  if a.only:
    keep = {"grpo", *a.only.split(",")}
    unknown = keep - set(table_of)
    if unknown:
      sys.exit(f"bench_behaviour: --only names unknown variants {sorted(unknown)}; "
               f"known: {', '.join(table_of)}")
    table_of = {k: v for k, v in table_of.items() if k in keep}
  for v, _, _ in table_of.values():  # every variant is checked before any run starts
    variant_config(base, v)
  dirs = run_all(base, [v for v, _, _ in table_of.values()], seeds, a.out_dir)
  grpo = {k: d for k, d in dirs.items() if k[0] == "grpo"}
  try:
    target = baseline_targets(grpo, [FRACTION])[0]
    how = f"Q* = {target} (halfway across the range every GRPO seed traverses)"
  except ValueError as e:  # warm starts too far apart for one target
    target = per_seed_targets(grpo, FRACTION)
    how = (f"No one target lies in every GRPO seed's range ({e}), so each seed has its own Q*, "
           "halfway from its GRPO warm start to its GRPO run's best: "
           + ", ".join(f"seed {k}: {v}" for k, v in sorted(target.items())))
  summary = summarise(dirs, target)
  speed = decode_speed(base, table_of)
  rows = ["| variant | decode tok/s (fixed batch) | vs full policy | run rollout tok/s (median) | "
          "distinct responses / group (of 8) | mean response length | rollout reward | importance ESS | "
          "tokens above is_cap | head KL(rollout, policy) |", "|---|---|---|---|---|---|---|---|---|---|"]
  for name, (v, _, _) in table_of.items():
    st = [_run_stats(dirs[v, s]) for s in seeds]
    avg = lambda k: statistics.fmean(x[k] for x in st)
    kl = "-" if st[0]["head_kl"] is None else f"{avg('head_kl'):.1e}"
    rows.append(f"| {name} | {speed[name]:,.0f} | {speed[name] / speed['grpo']:.2f}x | "
                f"{avg('tokens_per_s'):,.0f} | {avg('distinct'):.2f} | {avg('length'):.1f} | {avg('reward'):.3f} | "
                f"{avg('ess'):.3f} | {avg('capped'):.3f} | {kl} |")
  lines_found = findings(summary.table, table_of, speed,
                         {name: [_run_stats(dirs[v, s]) for s in seeds] for name, (v, _, _) in table_of.items()})
  table = to_markdown(summary)
  for name, (v, _, _) in table_of.items():
    table = table.replace(f"| {v} |", f"| {name} |")
  lines = [
      "## Rollout-policy methods: Nested-ReFT and R2PO"
      + ("" if a.layers == 2 else f", a {a.layers}-layer policy (two layer fractions)"), "",
      f"Measured by `python scripts/bench_behaviour.py --write-docs --layers {a.layers}"
      + (f" --only {a.only}" if a.only else "") + "` on "
      f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs: the default task with "
      f"`{' '.join(shown)}`, seeds {a.seeds}, every variant of a seed from the same "
      f"warm-started policy. {how}. "
      + ("Nested-ReFT corrects with rl.off_policy=tis (`-any`: the kept layer is re-drawn among "
         "all layers every step instead of keeping the first); R2PO at its defaults." if a.layers == 2
         else "Nested-ReFT corrects with rl.off_policy=tis; nested-3/4 keeps the first and last "
         "layers and one middle layer re-drawn every step, nested-1/2 the first and last; R2PO at "
         "its defaults."), "",
      *(["Other work shared the machine during the training runs: their seconds and run tokens/s "
         "are perturbed (rollouts and tokens are not; the fixed-batch decode speeds were measured "
         "afterwards, alone).", ""] if a.shared else []),
      table, "",
      "Decode speed of the behaviour model (a fixed batch of the default's 16 x 8 rows, 128 new "
      "tokens each, no stop tokens, median of 5 alternating runs in one process) and what the "
      "runs saw (means over steps and seeds; the importance effective sample size (sum w)^2 / "
      "(n sum w^2) and the fraction of tokens whose weight pi / mu exceeds rl.is_cap say how far "
      "the behaviour model is from the policy the update corrects to):", "",
      *rows, "",
      "Against the papers' claims:", "", *lines_found,
  ]
  emit_section("behaviour" if a.layers == 2 else f"behaviour_{a.layers}_layers", lines, a.write_docs)


if __name__ == "__main__":
  main()
