"""Decode over the live rows only, against every slot, on the default workload's rollout.

  python scripts/bench_live_rows.py [--write-docs] [--reps 5] [--warm-steps 600] [--max-new-tokens N]

The default policy, warm-started as the main job does, samples one RL
step's batch (the first 16 prompts of the pool x 8 samples, up to 768 new
tokens, 128 slots, temperature 1) with two engines that differ only in
`live_rows` (jaxroll/rollout/live_rows.py): the step attends over the live
rows' bucket, or over all 128 slots. Both sample with the same keys, so
they decode the same tokens (checked). Rows finish at very different steps
(the workload's long tail), so most decode steps have few rows live.

Medians of `--reps` alternating runs in one process, each a new key. Prints
the docs section, then one JSON line last. About 5 minutes on 2 cores.
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
import numpy as np  # noqa: E402

from bench_kv import default_policy  # noqa: E402
from jaxroll.rollout import RolloutEngine, SamplingParams  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warm-steps", type=int, default=600)
  ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the default config's")
  ap.add_argument("--write-docs", action="store_true")
  a = ap.parse_args()
  cfg, task, model = default_policy(a.warm_steps)
  r = cfg.rollout
  max_new = a.max_new_tokens or r.max_new_tokens
  kw = dict(num_slots=r.num_slots, max_prompt_len=r.max_prompt_len, max_new_tokens=max_new,
            sampling=SamplingParams(r.temperature, r.top_k, r.top_p),
            stop_token_ids=task.tokenizer.eos_token_ids)
  engines = {"live rows": RolloutEngine.for_model(model, **kw),
             "every slot": RolloutEngine.for_model(model, live_rows=False, **kw)}
  params = engines["live rows"].load(model)
  prompts = [task.tokenizer.encode(e.prompt) for e in task.train[:r.prompts_per_step]]
  G = r.group_size
  times = {name: [] for name in engines}
  steps, live, tokens = [], [], []
  for rep in range(a.reps + 1):  # the first round compiles
    outs = {}
    for name, e in engines.items():
      t0 = time.perf_counter()
      outs[name] = e.rollout(params, prompts, group_size=G, key=jax.random.key(rep))
      dt = time.perf_counter() - t0
      if rep:
        times[name].append(dt)
    np.testing.assert_array_equal(outs["live rows"].tokens_NxL, outs["every slot"].tokens_NxL)
    s = engines["live rows"].last_stats
    if rep:
      steps.append(s.decode_steps)
      live.append(s.slot_utilisation)
      tokens.append(s.tokens_generated)
  med = {name: statistics.median(t) for name, t in times.items()}
  result = {"speedup": med["every slot"] / med["live rows"], "rollout_s_live_rows": med["live rows"],
            "rollout_s_every_slot": med["every slot"], "decode_steps": statistics.median(steps),
            "live_fraction": statistics.median(live), "tokens": statistics.median(tokens)}
  lines = [
      "## Decode over the live rows only",
      "",
      f"Measured by `python scripts/bench_live_rows.py --write-docs` on "
      f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs: the default policy "
      f"warm-started as the main job does ({a.warm_steps} steps), one RL step's batch "
      f"({len(prompts)} prompts x {G} samples, up to {max_new} new tokens, {r.num_slots} "
      f"slots, temperature {r.temperature:g}), the same keys for both engines (identical tokens, "
      f"checked); medians of {a.reps} alternating runs in one process, a new key per run.",
      "",
      "| engine | rollout s | tokens/s |",
      "|---|---|---|",
      *(f"| {name} | {t:.2f} | {result['tokens'] / t:,.0f} |" for name, t in med.items()),
      "",
      f"Speed-up {result['speedup']:.2f}x. A rollout ran {result['decode_steps']:.0f} decode steps "
      f"(median), with {100 * result['live_fraction']:.0f}% of the slot-steps live: the longest "
      f"rows decide when the batch ends, and most steps carry few rows.",
  ]
  emit_section("live_rows", lines, a.write_docs)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
