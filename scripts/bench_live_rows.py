"""Decode over the live part of the batch, against every slot and position, on the
default workload's rollout.

  python scripts/bench_live_rows.py [--write-docs] [--reps 5] [--warm-steps 600] [--max-new-tokens N]

The default policy, warm-started as the main job does, samples one RL
step's batch (the first 16 prompts of the pool x 8 samples, up to 768 new
tokens, 128 slots, temperature 1) with three engines that differ only in
what a decode step works over (jaxroll/rollout/live_rows.py,
live_forward.py): the live rows' bucket (the whole forward pass) attending
within the window of cache positions they have reached (the engine's
default), the live rows' bucket attending over the whole cache, or every
slot over the whole cache. All sample with the same keys; rows whose
tokens differ from the last engine's are counted (the attention agrees to
float32 rounding, so a flip needs a uniform within about 1e-7 of a token's
edge). Rows finish at very different steps (the workload's long tail), so
most decode steps have few rows live, and most rows end far short of the
cache's 776 positions.

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
  engines = {"live rows, window": RolloutEngine.for_model(model, **kw),
             "live rows, whole cache": RolloutEngine.for_model(model, cache_window=False, **kw),
             "every slot, whole cache": RolloutEngine.for_model(model, live_rows=False,
                                                                cache_window=False, **kw)}
  base = "every slot, whole cache"
  params = engines[base].load(model)
  prompts = [task.tokenizer.encode(e.prompt) for e in task.train[:r.prompts_per_step]]
  G = r.group_size
  times = {name: [] for name in engines}
  steps, live, tokens, differ = [], [], [], []
  for rep in range(a.reps + 1):  # the first round compiles
    outs = {}
    for name, e in engines.items():
      t0 = time.perf_counter()
      outs[name] = e.rollout(params, prompts, group_size=G, key=jax.random.key(rep))
      dt = time.perf_counter() - t0
      if rep:
        times[name].append(dt)
    s = engines[base].last_stats
    if rep:
      differ.append(sum(int((outs[n].tokens_NxL != outs[base].tokens_NxL).any(axis=1).sum())
                        for n in engines if n != base))
      steps.append(s.decode_steps)
      live.append(s.slot_utilisation)
      tokens.append(s.tokens_generated)
  med = {name: statistics.median(t) for name, t in times.items()}
  result = {"speedup": med[base] / med["live rows, window"],
            "speedup_rows_only": med[base] / med["live rows, whole cache"],
            "rollout_s_live_rows_window": med["live rows, window"],
            "rollout_s_live_rows": med["live rows, whole cache"], "rollout_s_every_slot": med[base],
            "decode_steps": statistics.median(steps), "live_fraction": statistics.median(live),
            "tokens": statistics.median(tokens), "rows_differing": sum(differ)}
  lines = [
      "## Decode over the live rows and the positions they have reached",
      "",
      f"Measured by `python scripts/bench_live_rows.py --write-docs` on "
      f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs: the default policy "
      f"warm-started as the main job does ({a.warm_steps} steps), one RL step's batch "
      f"({len(prompts)} prompts x {G} samples, up to {max_new} new tokens, {r.num_slots} "
      f"slots, temperature {r.temperature:g}), the same keys for every engine; medians of "
      f"{a.reps} alternating runs in one process, a new key per run. Rows whose tokens differed "
      f"from the last engine's, over all runs: {result['rows_differing']} of "
      f"{a.reps * (len(engines) - 1) * len(prompts) * G}.",
      "",
      "| engine | rollout s | tokens/s |",
      "|---|---|---|",
      *(f"| {name} | {t:.2f} | {result['tokens'] / t:,.0f} |" for name, t in med.items()),
      "",
      f"Speed-up over every slot and the whole cache: {result['speedup']:.2f}x with the window, "
      f"{result['speedup_rows_only']:.2f}x with live rows alone. A rollout ran {result['decode_steps']:.0f} decode steps "
      f"(median), with {100 * result['live_fraction']:.0f}% of the slot-steps live: the longest "
      f"rows decide when the batch ends, and most steps carry few rows, most of them far short "
      f"of the cache's end.",
  ]
  emit_section("live_rows", lines, a.write_docs)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
