"""The paged KV cache: memory on the default workload, ragged and sparse decode speed.

  python scripts/bench_kv.py [--write-docs] [--reps 5] [--page-size 16]

1. Memory, on the default workload (configs/default.py's task and policy,
   warm-started as the main job does; one RL step's 16 prompts x 8 samples
   at up to 768 new tokens, sampled with the same keys by every engine):
   - kv_bytes_per_group_ratio: the KV a group holds with paged rows
     (shared full prompt pages once, each row's pages up to its length)
     over the dense cache's G rows of prompt + max_new_tokens positions,
     averaged over the step's groups;
   - kv_peak_bytes_ratio: the engine's measured peak KV bytes over the
     step, paged over dense (128 slots each);
   - rows_at_equal_memory_ratio: with the KV memory of a dense engine of 32
     slots, a paged engine of 128 slots holds this many times more rows at
     once (its peak; pages run out, rows are preempted and resumed), and
     the mean rows per decode step beside it. Both decode the same tokens.
2. Ragged decode: decode-step time of the default policy shape (and a
   wider 8-layer one) over 16 rows of lengths spread evenly over 64 .. 2048
   in a 2048-position cache, dense static over ragged paged.
3. Sparse decode, 25% page budget, rows of 512 .. 2048: KV pages read over
   live pages, and step time of dense static and paged dense over Quest
   and StreamingLLM selection.

4. Sparse rollout in training (`--part training`): the default config with
   evaluations every 4 steps, from one warm-started policy, three runs:
   dense rollout, and per `--sparse` setting (by default pages of 16
   positions at a 25% budget, corrected and uncorrected, and pages of 4
   corrected) Quest rollout corrected (rl.off_policy=tis plus rejection of
   rows with a log-prob gap above 2) or uncorrected (the sparse log-probs
   taken as the policy's).
   Steps to the held-out target Q* (half of the dense run's gain), and the
   mismatch and agreement statistics over training.

Medians of `--reps` alternating runs in one process. Prints the docs
sections, then one JSON line last. Memory and speed take about 15
minutes on 2 cores; training about 10 minutes per run.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

from docs_section import ROOT, emit_section

sys.path.insert(0, ROOT)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxroll import config as config_lib  # noqa: E402
from jaxroll import warm_start  # noqa: E402
from jaxroll.kernels import quest  # noqa: E402
from jaxroll.model import ModelConfig, Transformer  # noqa: E402
from jaxroll.model.paged_kv_cache import PagedSpec, group_pages, pages_for  # noqa: E402
from jaxroll.rollout import RolloutEngine, SamplingParams  # noqa: E402
from jaxroll.task_setup import build_policy, build_task  # noqa: E402


def default_policy(warm_steps: int):
  cfg = config_lib.load(os.path.join(ROOT, "configs", "default.py"))
  task = build_task(cfg)
  _, graphdef, params = build_policy(cfg, task.tokenizer)
  w = cfg.warm_start
  t0 = time.perf_counter()
  params = warm_start.train(
      graphdef, params, task.warm_start_examples or task.train, task.tokenizer, steps=warm_steps,
      batch_size=w.batch_size, learning_rate=w.learning_rate, warmup_steps=w.warmup_steps,
      error_rate=w.error_rate, seq_len=cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens,
      seed=cfg.seed + 1, solve=task.worked_solution, microbatch_tokens=w.microbatch_tokens)
  print(f"warm start: {warm_steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
  return cfg, task, nnx.merge(graphdef, params)


def memory(cfg, task, model, page_size: int) -> dict:
  r = cfg.rollout
  prompts = [task.tokenizer.encode(e.prompt) for e in task.train[:r.prompts_per_step]]
  G = r.group_size
  key = jax.random.key(0)
  kw = dict(max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
            sampling=SamplingParams(r.temperature), stop_token_ids=task.tokenizer.eos_token_ids)
  spec = PagedSpec(page_size=page_size)
  out, stats, seconds = {}, {}, {}
  engines = {
      "dense": RolloutEngine.for_model(model, num_slots=r.num_slots, **kw),
      "paged": RolloutEngine.for_model(model, num_slots=r.num_slots, paged=spec, **kw),
      "dense_32": RolloutEngine.for_model(model, num_slots=32, **kw),
  }
  rows_per_page_budget = 32 * pages_for(engines["dense_32"].cache_len, page_size)
  engines["paged_at_dense_32_memory"] = RolloutEngine.for_model(
      model, num_slots=r.num_slots, paged=PagedSpec(page_size=page_size, num_pages=rows_per_page_budget),
      **kw)
  for name, e in engines.items():
    params = e.load(model)
    e.rollout(params, prompts, group_size=G, key=key)  # compiles
    t0 = time.perf_counter()
    out[name] = e.rollout(params, prompts, group_size=G, key=key)
    seconds[name] = time.perf_counter() - t0
    stats[name] = e.last_stats
  for name in engines:
    np.testing.assert_array_equal(out[name].tokens_NxL, out["dense"].tokens_NxL)
  lengths = out["dense"].length_N.reshape(-1, G)
  S = engines["dense"].cache_len
  ratios = [group_pages(len(p), lengths[i].tolist(), page_size) * page_size / (G * S)
            for i, p in enumerate(prompts)]
  mean_rows = lambda s: s.row_forwards / max(1, s.decode_steps) if s.row_forwards else \
      s.tokens_generated / max(1, s.decode_steps)
  small, big = stats["dense_32"], stats["paged_at_dense_32_memory"]
  return {
      "kv_bytes_per_group_ratio": float(np.mean(ratios)),
      "kv_peak_bytes_ratio": stats["paged"].kv_peak_bytes / stats["dense"].kv_peak_bytes,
      "rows_at_equal_memory_ratio": big.peak_rows / small.peak_rows,
      "mean_rows_ratio": mean_rows(big) / mean_rows(small),
      "preemptions_at_equal_memory": big.preemptions,
      "rollout_s_dense_32": seconds["dense_32"], "rollout_s_paged_at_equal_memory":
          seconds["paged_at_dense_32_memory"],
      "rollout_s_dense": seconds["dense"], "rollout_s_paged": seconds["paged"],
      "len_mean": float(lengths.mean()), "len_max": int(lengths.max()),
      "max_new_tokens": r.max_new_tokens, "cache_len": S,
  }


def _step_times(model, lengths, engines: dict, reps: int, steps: int = 16) -> dict:
  """Median seconds per decode step of each engine over rows of `lengths`."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, model.cfg.vocab_size, size=int(n)).tolist() for n in lengths]
  states = {}
  for name, e in engines.items():
    params = e.load(model)
    prefix = e.prefill(params, prompts)
    keys = jax.random.split(jax.random.key(1), len(prompts))
    state = e.insert(e.init_decode_state(), prefix, list(range(len(prompts))),
                     list(range(len(prompts))), keys)
    states[name] = (params, state)
  times = {name: [] for name in engines}
  for rep in range(reps + 1):  # the first round compiles
    for name, e in engines.items():
      params, state = states[name]
      # generate donates the state: decode a copy so every rep starts alike.
      st = jax.tree.map(jnp.copy, state)
      jax.block_until_ready(st)
      t0 = time.perf_counter()
      st, n = e.generate(params, st, max_steps=steps)
      jax.block_until_ready(st.token_B)
      if rep:
        times[name].append((time.perf_counter() - t0) / int(n))
  return {name: statistics.median(t) for name, t in times.items()}


def decode_speed(model, reps: int, page_size: int) -> dict:
  S = 2048
  B = 16
  mk = lambda **kw: RolloutEngine.for_model(model, num_slots=B, max_prompt_len=S - 64,
                                            max_new_tokens=64, **kw)
  ragged = np.linspace(64, S - 64, B).astype(int)
  engines = {"dense": mk(), "paged": mk(paged=PagedSpec(page_size=page_size))}
  t_ragged = _step_times(model, ragged, engines, reps)
  long_rows = np.linspace(512, S - 64, B).astype(int)
  sparse = dict(engines)
  for kind in ("quest", "streaming"):
    sparse[kind] = mk(paged=PagedSpec(page_size=page_size, sparsity=kind, budget=0.25))
  t_sparse = _step_times(model, long_rows, sparse, reps)
  n_live = jnp.asarray((long_rows - 1) // page_size + 1)
  read = quest.page_budget(n_live, 0.25, 1, 1)
  return {
      "ragged_decode_speedup": t_ragged["dense"] / t_ragged["paged"],
      "step_ms_dense_ragged": 1e3 * t_ragged["dense"], "step_ms_paged_ragged": 1e3 * t_ragged["paged"],
      "sparse_kv_read_ratio": float(read.sum() / n_live.sum()),
      "sparse_decode_speedup": t_sparse["dense"] / t_sparse["quest"],
      "sparse_decode_speedup_over_paged": t_sparse["paged"] / t_sparse["quest"],
      "streaming_decode_speedup": t_sparse["dense"] / t_sparse["streaming"],
      **{f"step_ms_{k}_long": 1e3 * v for k, v in t_sparse.items()},
  }


def gather_probe(reps: int, megabytes: int = 256) -> dict:
  """How fast this backend reads KV pages through a page table, against the
  same bytes read in place: one query scored against every page of a pool
  (8 KV heads, head size 64, pages of 16), in place or gathered 64 pages
  at a time in shuffled order, as paged decode attention reads them, and
  the same keys scored in one pass in the dense cache's layout
  ([K, D, positions]), as dense decode attention reads them. The pool is
  larger than the last-level cache, as a decode step's KV is."""
  K, D, P, C = 8, 64, 16, 64
  N = megabytes * 2**20 // (K * D * P * 4) // C * C
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.standard_normal((N, K, D, P), np.float32))
  q = jnp.asarray(rng.standard_normal((K, D), np.float32))
  order = jnp.asarray(rng.permutation(N).reshape(-1, C), jnp.int32)
  score = lambda pages, q: jnp.einsum("nkdp,kd->nkp", pages, q)
  # Both read 64 pages per trip of the same loop, so the only difference is
  # a slice of consecutive pages against a gather of shuffled ones (one
  # einsum over the whole pool is a different computation, and it ran
  # slower than the gathered loop).
  chunk = lambda pool, i: jax.lax.dynamic_slice_in_dim(pool, i * C, C)
  fns = {"in_place": jax.jit(lambda pool, order, q: jax.lax.map(
             lambda i: score(chunk(pool, i), q), jnp.arange(order.shape[0]))),
         "gathered": jax.jit(lambda pool, order, q: jax.lax.map(lambda i: score(pool[i], q), order)),
         "one_pass": jax.jit(lambda keys, order, q: jnp.einsum("kds,kd->ks", keys, q))}
  # The dense layout is built once, outside the timing.
  dense_keys = jnp.transpose(pool, (1, 2, 0, 3)).reshape(K, D, N * P)
  times = {name: [] for name in fns}
  for rep in range(reps + 1):  # the first round compiles
    for name, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(dense_keys if name == "one_pass" else pool, order, q))
      if rep:
        times[name].append(time.perf_counter() - t0)
  return {f"kv_read_gbps_{name}": pool.nbytes / statistics.median(t) / 1e9 for name, t in times.items()}


CORRECTION = "@rl.off_policy=tis@rl.mismatch_reject=2.0"


def sparse_variants(settings: str) -> dict:
  """Run names and variants: dense, then per "page:budget" corrected and
  uncorrected ("page:budget:corrected" runs only the corrected one;
  "page:budget:control=T" runs a corrected one whose budget Sparrow's
  controller moves, starting at `budget`, to keep the agreement p5 near T;
  adding ":start=S" starts it at S instead, with `budget` as its floor, and
  ":margin=M" sets the band above T in which it holds)."""
  out = {"dense": "grpo"}
  for item in settings.split(","):
    page, budget, *opts = item.split(":")
    sparse = (f"grpo@rollout.kv_cache=paged@rollout.kv_sparsity=quest@rollout.kv_budget={budget}"
              + ("" if page == "16" else f"@rollout.kv_page_size={page}"))
    control = [o.split("=", 1)[1] for o in opts if o.startswith("control=")]
    start = [o.split("=", 1)[1] for o in opts if o.startswith("start=")]
    margin = [o.split("=", 1)[1] for o in opts if o.startswith("margin=")]
    if control:
      begin = (f"from {float(start[0]):.0%} down to {float(budget):.0%}" if start
               else f"from {float(budget):.0%}")
      band = f"p5 >= {control[0]}" + (f", margin {margin[0]}" if margin else "")
      out[f"Quest {begin}, pages of {page}, controlled ({band}), corrected"] = (
          sparse + f"@rollout.kv_budget_p5={control[0]}"
          + (f"@rollout.kv_budget_start={start[0]}" if start else "")
          + (f"@rollout.kv_budget_margin={margin[0]}" if margin else "") + CORRECTION)
      continue
    out[f"Quest {float(budget):.0%}, pages of {page}, corrected"] = sparse + CORRECTION
    if opts != ["corrected"]:
      out[f"Quest {float(budget):.0%}, pages of {page}, uncorrected"] = sparse
  return out


def sparse_training(steps: int, out_dir: str, settings: str, seeds=(0,), eval_every: int = 4) -> dict:
  from jaxroll.compare import per_seed_targets, run_all

  overrides = [f"steps={steps}", f"eval_every={eval_every}", "checkpoint_every=1000",
               "progress=false", "tensorboard=false", "rl.measure_mismatch=true"]
  base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")),
                                    overrides)
  variants = sparse_variants(settings)
  dirs = run_all(base, list(variants.values()), list(seeds), out_dir)
  # Each seed has its own warm start, so its own Q*: half of its dense run's
  # gain (with one seed, the same target as baseline_targets gives).
  targets = per_seed_targets({k: d for k, d in dirs.items() if k[0] == "grpo"}, 0.5)
  out = {"targets": targets, "seeds": list(seeds), "eval_every": eval_every, "runs": list(variants)}
  for name, v in variants.items():
    runs = {seed: _run_stats(dirs[v, seed], targets[seed], v) for seed in seeds}
    reached = [r["steps_to_target"] for r in runs.values()]
    pooled = lambda k: [x for r in runs.values() for x in r[k]]
    out[name] = {
        "per_seed": runs,
        # The mean over seeds, defined only when every seed reached Q*.
        "steps_to_target": statistics.fmean(reached) if None not in reached else None,
        "final_accuracy": statistics.fmean(r["final_accuracy"] for r in runs.values()),
        "mismatch_abs_mean": statistics.fmean(pooled("mismatch_abs")),
        "agreement_p5_median": statistics.median(pooled("agreement_p5")),
        "agreement_p5_min": min(pooled("agreement_p5")),
        "rejected_rows": sum(r["rejected_rows"] for r in runs.values()),
        "rows": sum(r["rows"] for r in runs.values()),
        "rollout_s": sum(r["rollout_s"] for r in runs.values()),
        "kv_peak_bytes": max(r["kv_peak_bytes"] for r in runs.values()),
        "budget_mean": (statistics.fmean(pooled("budget_curve")) if pooled("budget_curve")
                        else _fixed_budget(v)),
    }
  return out


def _run_stats(run_dir: str, target: float, variant: str) -> dict:
  """One training run's steps to `target` and its mismatch statistics."""
  from jaxroll.metrics.logger import read_jsonl

  metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[1:]
  timing = read_jsonl(os.path.join(run_dir, "timing.jsonl"))[1:]
  evals = [m for m in metrics if "heldout_accuracy" in m]
  reached = [m["step"] for m in evals if m["heldout_accuracy"] >= target]
  col = lambda k: [m[k] for m in metrics if k in m]
  return {
      "target": target,
      "steps_to_target": reached[0] if reached else None,
      "final_accuracy": evals[-1]["heldout_accuracy"],
      "mismatch_abs": col("mismatch_abs_mean"),
      "agreement_p5": col("mismatch_agreement_p5"),
      "rejected_rows": sum(col("mismatch_rejected_rows")),
      "rows": sum(m.get("update_rows", 0) for m in metrics),
      "rollout_s": sum(t["rollout_s"] for t in timing),
      "kv_peak_bytes": max(col("kv_peak_bytes")),
      # The controlled runs log the budget each batch decoded with.
      "budget_curve": col("kv_budget"),
      "curve": [(m["step"], m["heldout_accuracy"]) for m in evals],
  }


def _fixed_budget(variant: str):
  """The page budget a variant fixes (None: dense)."""
  for part in variant.split("@"):
    if part.startswith("rollout.kv_budget="):
      return float(part.split("=", 1)[1])
  return None


TITLES = {
    "training": "Sparse rollout in training: Quest page selection, with and without correction",
    "budget": "Sparse rollout in training: the page budget, fixed or moved by Sparrow's controller",
}


def training_lines(t: dict, steps: int, part: str = "training", sparse: str = "") -> list[str]:
  seeds, every = t["seeds"], t["eval_every"]
  dense = t["dense"]["steps_to_target"]
  command = (f"python scripts/bench_kv.py --part {part}"
             + (f" --budget-sweep {sparse}" if part == "budget" else "")
             + (f" --seeds {','.join(map(str, seeds))}" if seeds != [0] else "")
             + (f" --eval-every {every}" if every != 4 else ""))
  seed_text = (f"seed {seeds[0]}" if len(seeds) == 1 else
               "seeds " + ", ".join(map(str, seeds)) + " (each seed's runs from its own warm start)")
  targets = ", ".join(f"{t['targets'][s]:.3f}" for s in seeds)
  lines = [
      f"## {TITLES[part]}", "",
      f"Measured by `{command} --write-docs` ({platform.machine()}, "
      f"{os.cpu_count()} CPUs): configs/default.py for {steps} steps, held-out evaluation every "
      f"{every} steps, {seed_text}, every run of a seed from one warm-started policy. The sparse "
      "runs attend over the "
      "given share of a row's pages (at least the first and the latest). Corrected: "
      "rl.off_policy=tis and rows with a token whose sampler-trainer log-prob gap exceeds 2 "
      "dropped from the loss. Uncorrected: the sparse sampler's log-probs are taken as the "
      "policy's. Controlled: corrected, and the budget rises by 0.125 after a step whose agreement "
      "p5 is below the threshold and falls (not under the floor) above the threshold + the margin (0.05 unless named) "
      "(rollout.kv_budget_p5, jaxroll/loop/kv_budget.py); it starts at the floor, or where "
      f"the name says (rollout.kv_budget_start). Q* = {targets} "
      f"({'per seed, ' if len(seeds) > 1 else ''}half of the dense run's gain). Steps to Q*: "
      + ("per seed, then their mean (defined when every seed reaches Q*); " if len(seeds) > 1 else "")
      + "vs dense is the ratio of those steps. The statistics pool every step of every seed; rows "
      "and seconds are summed over seeds. Rollout seconds are each run's own wall-clock: "
      "comparable only between runs that had the machine alike.", "",
      "| rollout | page budget, mean over steps | steps to Q* | vs dense | final acc. | mean abs log-prob "
      "gap | agreement p5, median (min) over steps | rows rejected | rollout s | peak KV MB |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for name in t["runs"]:
    r = t[name]
    n = r["steps_to_target"]
    vs = f"{n / dense:.2f}x" if n and dense else "n/a"
    budget = "1 (dense)" if r.get("budget_mean") is None else f"{r['budget_mean']:.2f}"
    each = [r["per_seed"][s]["steps_to_target"] for s in seeds]
    shown = ", ".join(str(x) if x else "not reached" for x in each)
    if len(seeds) > 1:
      shown += f"; mean {n:.1f}" if n else "; mean n/a"
    lines.append(
        f"| {name} | {budget} | {shown} | {vs} | {r['final_accuracy']:.3f} | "
        f"{r['mismatch_abs_mean']:.4f} | {r['agreement_p5_median']:.3f} ({r['agreement_p5_min']:.3f}) | "
        f"{r['rejected_rows']:.0f} of {r['rows']} | {r['rollout_s']:.0f} | {r['kv_peak_bytes'] / 1e6:.1f} |")
  label = lambda name, s: name + (f", seed {s}" if len(seeds) > 1 else "")
  for name in t["runs"]:
    for s in seeds:
      if t[name]["per_seed"][s]["budget_curve"]:
        lines += ["", f"Page budget by step, {label(name, s)}: " + ", ".join(
            f"{b:.3g}" for b in t[name]["per_seed"][s]["budget_curve"])]
  lines += ["", "Held-out accuracy by step: " + "; ".join(
      f"{label(name, s)}: " + ", ".join(f"{k}: {a:.2f}" for k, a in t[name]["per_seed"][s]["curve"])
      for name in t["runs"] for s in seeds)]
  return lines


def wide_model():
  """8 layers, width 512, 8 KV heads: KV reads dominate a long-context step."""
  cfg = ModelConfig(vocab_size=1024, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                    mlp_dim=1408, max_position=4096)
  return Transformer(cfg, rngs=nnx.Rngs(0))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--part", default="memory,speed",
                  help="comma-separated: memory, speed, training, budget (training runs of --budget-sweep)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--warm-steps", type=int, default=600)
  ap.add_argument("--steps", type=int, default=40, help="RL steps of each training run")
  ap.add_argument("--sparse", default="16:0.25,4:0.25:corrected",
                  help="training: comma-separated page_size:budget[:corrected|:control=T] settings of "
                  "the sparse runs (a control= run also takes :start=S, where its budget starts, and :margin=M)")
  ap.add_argument("--budget-sweep", default="16:0.5:corrected,16:0.75:corrected,16:0.25:control=0.86",
                  help="budget: the sparse runs of the budget section (same syntax as --sparse)")
  ap.add_argument("--seeds", default="0", help="training, budget: comma-separated seeds of every run")
  ap.add_argument("--eval-every", type=int, default=4, help="training, budget: steps between evaluations")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "kv"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  parts = set(a.part.split(","))
  seeds = [int(x) for x in a.seeds.split(",")]
  result = {}
  if parts & {"memory", "speed"}:
    cfg, task, policy = default_policy(a.warm_steps)
    mem = memory(cfg, task, policy, a.page_size)
    print(json.dumps(mem), flush=True)
    speed = {"default_policy": decode_speed(policy, a.reps, a.page_size),
             "wide_8_layer": decode_speed(wide_model(), a.reps, a.page_size),
             "probe": gather_probe(a.reps)}
    print(json.dumps(speed), flush=True)
    emit_section("paged_kv", memory_speed_lines(cfg, mem, speed, a), a.write_docs)
    w = speed["wide_8_layer"]
    result.update({k: mem[k] for k in ("kv_bytes_per_group_ratio", "rows_at_equal_memory_ratio",
                                       "kv_peak_bytes_ratio", "mean_rows_ratio")})
    result.update(ragged_decode_speedup=w["ragged_decode_speedup"],
                  sparse_kv_read_ratio=w["sparse_kv_read_ratio"],
                  sparse_decode_speedup=w["sparse_decode_speedup"], **speed)
  if "training" in parts:
    t = sparse_training(a.steps, a.out_dir, a.sparse, seeds, a.eval_every)
    emit_section("sparse_training", training_lines(t, a.steps), a.write_docs)
    result["training"] = t
  if "budget" in parts:
    t = sparse_training(a.steps, a.out_dir, a.budget_sweep, seeds, a.eval_every)
    emit_section("sparse_budget", training_lines(t, a.steps, "budget", a.budget_sweep), a.write_docs)
    result["budget"] = t
  print(json.dumps(result))


def memory_speed_lines(cfg, mem, speed, a) -> list[str]:
  d, w = speed["default_policy"], speed["wide_8_layer"]
  lines = [
      "## Paged KV cache: memory, ragged decode, sparse decode", "",
      f"Measured by `python scripts/bench_kv.py --write-docs` ({platform.machine()}, "
      f"{os.cpu_count()} CPUs, pages of {a.page_size} positions, medians of {a.reps} alternating "
      "runs in one process).", "",
      f"**Memory on the default workload** (one RL step: {cfg.rollout.prompts_per_step} prompts x "
      f"{cfg.rollout.group_size} samples from the warm-started default policy, up to "
      f"{mem['max_new_tokens']} new tokens; responses {mem['len_mean']:.0f} tokens on average, "
      f"longest {mem['len_max']}; every engine decoded the same tokens):", "",
      "| quantity | value |", "|---|---|",
      f"| KV bytes per group, paged (shared prompt pages) over dense | {mem['kv_bytes_per_group_ratio']:.3f} |",
      f"| peak KV bytes of the step, paged over dense (128 slots each) | {mem['kv_peak_bytes_ratio']:.3f} |",
      f"| rows held at once at a 32-slot dense engine's KV memory, paged over dense | "
      f"{mem['rows_at_equal_memory_ratio']:.2f}x |",
      f"| mean rows per decode step at that memory, paged over dense | {mem['mean_rows_ratio']:.2f}x |",
      f"| preemptions (rows resumed by prefill) at that memory | {mem['preemptions_at_equal_memory']} |",
      f"| rollout seconds at that memory: dense 32 slots / paged | {mem['rollout_s_dense_32']:.1f} / "
      f"{mem['rollout_s_paged_at_equal_memory']:.1f} |",
      f"| rollout seconds, 128 slots: dense / paged | {mem['rollout_s_dense']:.1f} / {mem['rollout_s_paged']:.1f} |",
      "",
      "**Decode step time** (16 rows, 2048-position cache; ragged: lengths spread evenly over 64 .. 1984; "
      "long: 512 .. 1984 with a 25% page budget, 1 sink and 1 recent page):", "",
      "| model | dense static (ragged) | paged (ragged) | ragged speedup | dense (long) | paged (long) | "
      "Quest 25% | StreamingLLM 25% | Quest speedup over dense / paged |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, s in (("default policy (2 layers, width 128)", d), ("8 layers, width 512", w)):
    lines.append(
        f"| {name} | {s['step_ms_dense_ragged']:.2f} ms | {s['step_ms_paged_ragged']:.2f} ms | "
        f"{s['ragged_decode_speedup']:.2f}x | {s['step_ms_dense_long']:.2f} ms | "
        f"{s['step_ms_paged_long']:.2f} ms | {s['step_ms_quest_long']:.2f} ms | "
        f"{s['step_ms_streaming_long']:.2f} ms | {s['sparse_decode_speedup']:.2f}x / "
        f"{s['sparse_decode_speedup_over_paged']:.2f}x |")
  lines += ["", f"Sparse KV read at a 25% budget: {d['sparse_kv_read_ratio']:.3f} of the live pages."]
  g = speed["probe"]
  gathered, in_place, one = (g[f"kv_read_gbps_{k}"] for k in ("gathered", "in_place", "one_pass"))
  lines += ["", f"Why paged rows lose on this CPU: scoring a query against KV pages in loop trips of 64 "
            f"pages runs at {gathered:.1f} GB/s through the page table and {in_place:.1f} GB/s for "
            f"consecutive pages read in place, against {one:.1f} GB/s for one pass over the same keys "
            "in the dense cache's layout (`gather_probe`: a 256 MB pool, beyond the last-level cache). "
            + ("The page table's indirection is not what costs: "
               if gathered >= 0.8 * in_place else "The page table's indirection costs too, and ")
            + f"reading in page-sized pieces runs at {gathered / one:.2f} of the one-pass rate, so "
            f"a paged step beats the dense cache only where its rows read less than about "
            f"{gathered / one:.2f} of the dense positions; the ragged rows above read about half. "
            "The GPU and TPU kernels read pages in place."]
  return lines


if __name__ == "__main__":
  main()
