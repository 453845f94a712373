"""Speculative rollout: speed in training on the default task and on the 0.5B shape.

  python scripts/bench_spec.py [--write-docs] [--steps 24] [--seed 0] [--skip-training]

1. Training (`jaxroll compare configs/default.py`, one seed, every variant
   from the same warm-started policy): plain decoding against two drafter
   settings, rollout.speculative=history,siblings at the defaults (k = 4,
   4 answers kept per prompt) and the wide one that drafts the most tokens
   per forward, history,siblings,global with k = 8 and 8 answers kept per
   prompt. The default pool of 64 prompts is visited once every 4 steps;
   rollout seconds, tokens per target forward and acceptance are taken over
   the steps after it has been visited twice (the history drafter then has
   two answers per prompt), and C(q) in seconds over the whole run.
2. The Qwen2.5-0.5B shape (random weights, embeddings scaled so the
   greedy choice is not a near-tie; batch 8, 32-token prompts, 64 new
   tokens, greedy): plain decoding against the history drafter over a
   recurring prompt set (its drafts are the previous answers: the engine's
   upper bound), and against histories with a share of their tokens
   corrupted (a drafter that is right part of the time, so the cost of a
   verifying pass shows), and the layer-skip drafter (the first quarter of
   the layers). Median of 3 alternating runs in one process.

Prints the docs section, then one JSON line last with tokens_per_target_forward,
acceptance_rate, rollout_s_plain, rollout_s_spec, speedup, drafter (training,
the wide setting; `drafters` has both) and the 0.5B numbers. About 30
minutes on 2 cores.
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
from jaxroll import config as config_lib  # noqa: E402
from jaxroll.compare import baseline_targets, run_all, summarise, to_markdown  # noqa: E402
from jaxroll.metrics.logger import read_jsonl  # noqa: E402

# (what the docs call it, its `jaxroll compare` variant); the last is the
# JSON line's main one.
DRAFTERS = (
    ("history,siblings, k = 4", "grpo@rollout.speculative=history,siblings"),
    ("history,siblings,global, k = 8, 8 answers per prompt",
     "grpo@rollout.speculative=history,siblings,global@rollout.speculative_k=8"
     "@rollout.speculative_history=8"),
)
POOL_VISITS = 2


def training_stats(run_dir: str, after_step: int) -> dict:
  metrics = {m["step"]: m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[1:]}
  timing = {t["step"]: t for t in read_jsonl(os.path.join(run_dir, "timing.jsonl"))[1:]}
  steps = [s for s in sorted(timing) if s > after_step]
  tokens = sum(metrics[s]["tokens_generated"] for s in steps)
  forwards = sum(metrics[s]["tokens_generated"] / metrics[s]["spec_tokens_per_forward"] for s in steps)
  drafted = sum(metrics[s]["spec_drafted_tokens"] for s in steps)
  accepted = sum(metrics[s]["spec_acceptance_rate"] * metrics[s]["spec_drafted_tokens"] for s in steps)
  return {"steps": len(steps), "rollout_s": sum(timing[s]["rollout_s"] for s in steps),
          # Decode steps until the step's last row finished: the rollout's
          # critical path, set by its longest (or least draftable) row.
          "makespan_steps": sum(metrics[s]["rollout_makespan_steps"] for s in steps),
          "tokens": tokens, "tokens_per_forward": tokens / forwards,
          "acceptance_rate": accepted / drafted if drafted else 0.0,
          "curve": [(s, metrics[s]["spec_acceptance_rate"]) for s in sorted(metrics)]}


def engine_speed(reps: int, corruptions=(0.1, 0.2, 0.4)) -> dict:
  """tok/s of plain greedy decoding and of the history drafter at the 0.5B shape."""
  import jax
  import numpy as np
  from flax import nnx

  from jaxroll.model import ModelConfig, Transformer
  from jaxroll.rollout import RolloutEngine
  from jaxroll.rollout.sampling import SamplingParams
  from jaxroll.rollout.speculative import SpeculativeSpec

  cfg = ModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                    mlp_dim=4864, qkv_bias=True, tie_embeddings=True, rope_theta=1e6)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  model.embed.embedding[...] = model.embed.embedding[...] * 10.0
  B, P, N = 8, 32, 64
  kw = dict(num_slots=B, max_prompt_len=P, max_new_tokens=N, sampling=SamplingParams(temperature=0.0))
  plain = RolloutEngine.for_model(model, **kw)
  engines = {"plain": plain}
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(B, P)).tolist()
  params = plain.load(model)
  first = plain.rollout(params, prompts, key=jax.random.key(0))  # the recurring answers
  rng = np.random.default_rng(1)
  for k, c in [(4, 0.0), (2, 0.0)] + [(4, c) for c in corruptions]:
    spec = SpeculativeSpec(k=k, siblings=False, history_tokens=2 * (N + 1))
    e = RolloutEngine.for_model(model, speculative=spec, **kw)
    for p, toks in zip(prompts, first.tokens_NxL):
      bad = rng.random(N) < c
      e.history.add(p, np.where(bad, rng.integers(0, cfg.vocab_size, N), toks))
    engines[f"history, k={k}" + (f", {int(c * 100)}% of its tokens corrupted" if c else "")] = e
  # Self-speculation: the first quarter of the layers and the head draft.
  skip = SpeculativeSpec(k=4, history=False, siblings=False, layer_skip=cfg.num_layers // 4)
  engines[f"layer skip (first {skip.layer_skip} of {cfg.num_layers} layers), k=4"] = \
      RolloutEngine.for_model(model, speculative=skip, **kw)
  times = {name: [] for name in engines}
  stats = {}
  for rep in range(reps + 1):  # the first round compiles
    for name, e in engines.items():
      history = None if e.history is None else e.history.state_dict()
      t0 = time.perf_counter()
      traj = e.rollout(params, prompts, key=jax.random.key(0))
      dt = time.perf_counter() - t0
      if history is not None:  # every rep drafts from the same history
        e.history.load_state_dict(history)
      assert int(traj.length_N.sum()) == B * N
      if name != "plain":
        np.testing.assert_array_equal(traj.tokens_NxL, first.tokens_NxL)  # greedy: identical tokens
      if rep:
        times[name].append(dt)
        s = e.last_stats
        stats[name] = {"tokens_per_forward": s.tokens_per_forward, "acceptance_rate": s.acceptance_rate}
  base = B * N / statistics.median(times["plain"])
  return {name: {"tokens_per_s": B * N / statistics.median(t),
                 "speedup": (B * N / statistics.median(t)) / base, **stats.get(name, {})}
          for name, t in times.items()}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--steps", type=int, default=24)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--skip-training", action="store_true")
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "speculative"))
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  lines = ["## Speculative rollout", ""]
  result = {}
  if not a.skip_training:
    overrides = [f"steps={a.steps}", "checkpoint_every=1000", "progress=false", "tensorboard=false"]
    base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")),
                                      overrides)
    dirs = run_all(base, ["grpo"] + [v for _, v in DRAFTERS], [a.seed], a.out_dir)
    per_epoch = -(-base.task.num_train // base.rollout.prompts_per_step)
    after = POOL_VISITS * per_epoch
    plain_st = training_stats(dirs["grpo", a.seed], after)
    step_ms = lambda st: 1000 * st["rollout_s"] / max(1, st["makespan_steps"])
    table = ["| decoding | rollout seconds | tokens | tokens per target forward | acceptance rate | "
             "speed-up (plain seconds over its) |", "|---|---|---|---|---|---|",
             f"| plain | {plain_st['rollout_s']:.1f} | {plain_st['tokens']:,} | 1.00 | - | 1.00x |"]
    notes, curves, drafters = [], [], {}
    for name, variant in DRAFTERS:
      st = training_stats(dirs[variant, a.seed], after)
      speedup = plain_st["rollout_s"] / st["rollout_s"]
      drafters[variant] = {"tokens_per_target_forward": st["tokens_per_forward"],
                           "acceptance_rate": st["acceptance_rate"], "rollout_s_spec": st["rollout_s"],
                           "speedup": speedup, "makespan_steps_spec": st["makespan_steps"]}
      table.append(f"| {name} | {st['rollout_s']:.1f} | {st['tokens']:,} | {st['tokens_per_forward']:.2f} | "
                   f"{st['acceptance_rate']:.3f} | {speedup:.2f}x |")
      critical = plain_st["makespan_steps"] / max(1, st["makespan_steps"])
      cost = step_ms(st) / step_ms(plain_st)
      lagging = (": the rows that finish last gained far less than the average row"
                 if critical < 0.75 * st["tokens_per_forward"] else "")
      notes.append(f"{name}: {st['makespan_steps']:,} decode steps to plain decoding's "
                   f"{plain_st['makespan_steps']:,} ({critical:.2f}x fewer) while rows averaged "
                   f"{st['tokens_per_forward']:.2f} tokens per forward{lagging}; a decode step cost "
                   f"{step_ms(st):.2f} ms against {step_ms(plain_st):.2f} ms ({cost:.2f}x), so the "
                   f"speed-up is {critical:.2f} / {cost:.2f}.")
      curves.append(f"{name}: " + ", ".join(f"{s}: {r:.2f}" for s, r in st["curve"][::4]))
    result.update(drafter=DRAFTERS[-1][1].removeprefix("grpo@"), **drafters[DRAFTERS[-1][1]],
                  rollout_s_plain=plain_st["rollout_s"], makespan_steps_plain=plain_st["makespan_steps"],
                  drafters=drafters)
    target = baseline_targets({k: d for k, d in dirs.items() if k[0] == "grpo"}, [0.5])[0]
    summary = to_markdown(summarise(dirs, target))
    for name, variant in DRAFTERS:
      summary = summary.replace(f"| {variant} |", f"| speculative ({name}) |")
    lines += [
        f"Measured by `python scripts/bench_spec.py --write-docs` on "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs.", "",
        f"**In training** (the default task, `steps={a.steps}`, seed {a.seed}, every run from the "
        f"same warm-started policy, adaptive draft lengths): over steps {after + 1}-{a.steps}, after "
        f"the pool of {base.task.num_train} prompts had been visited {POOL_VISITS} times:", "",
        *table, "",
        "Acceptance rate by step (every 4th): " + "; ".join(curves) + ".", "",
        "Where it goes: a step's rollout lasts until its last row finishes. " + " ".join(notes), "",
        summary, ""]
  speed = engine_speed(a.reps)
  result["qwen_0.5b"] = speed
  rows = ["| drafter | tokens/s | vs plain | tokens per target forward | acceptance rate |",
          "|---|---|---|---|---|"]
  for name, r in speed.items():
    rows.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                f"{r.get('tokens_per_forward', 1.0):.2f} | "
                f"{'-' if name == 'plain' else format(r['acceptance_rate'], '.3f')} |")
  lines += [
      "**At the Qwen2.5-0.5B shape** (random weights with embeddings scaled 10x, batch 8, "
      "32-token prompts, 64 new tokens, greedy; the history drafter over a recurring prompt set, "
      "and the layer-skip drafter; median of "
      f"{a.reps} alternating runs; every speculative run's tokens equal plain greedy's):", "",
      *rows]
  emit_section("speculative", lines, a.write_docs)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
