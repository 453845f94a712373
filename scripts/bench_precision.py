"""The sampler's weight precision in training: float32 against bfloat16 rollout weights.

  python scripts/bench_precision.py [--steps 12] [--out-dir bench_out/precision] [--write-docs]

Trains configs/default.py twice from one warm-started policy, seed 0, with
the sampler's copy of the weights in float32 (the trainer's own numerics)
and in bfloat16 (`rollout.param_dtype=bfloat16`), both with
`rl.measure_mismatch=true`: each step the trainer re-scores the sampled
tokens in float32 and logs their distance to the behaviour log-probs the
sampler recorded. Reports per run the mismatch statistics over steps, the
rollout tokens/s (median over steps after the first) and held-out accuracy.
The engine's own speed in bfloat16 at fixed shapes is in the rollout
throughput section (scripts/compare_rollout.py). Prints one JSON line last.
"""

import argparse
import json
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from docs_section import emit_section  # noqa: E402

from jaxroll import config as config_lib  # noqa: E402

VARIANTS = {"float32": "grpo", "bfloat16": "grpo@rollout.param_dtype=bfloat16"}


def run(steps: int, out_dir: str) -> dict:
  from jaxroll.compare import run_all
  from jaxroll.metrics.logger import read_jsonl

  overrides = [f"steps={steps}", "eval_every=4", "checkpoint_every=1000", "progress=false",
               "tensorboard=false", "rl.measure_mismatch=true"]
  base = config_lib.apply_overrides(config_lib.load(os.path.join(ROOT, "configs", "default.py")),
                                    overrides)
  dirs = run_all(base, list(VARIANTS.values()), [0], out_dir)
  out = {}
  for name, variant in VARIANTS.items():
    run_dir = dirs[variant, 0]
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[1:]
    timing = read_jsonl(os.path.join(run_dir, "timing.jsonl"))[1:]
    col = lambda k: [m[k] for m in metrics if k in m]
    evals = [m for m in metrics if "heldout_accuracy" in m]
    out[name] = {
        "mismatch_abs_mean": statistics.fmean(col("mismatch_abs_mean")),
        "mismatch_max": max(col("mismatch_max")),
        "mismatch_kl": statistics.fmean(col("mismatch_kl")),
        "agreement_p5_median": statistics.median(col("mismatch_agreement_p5")),
        "rollout_tok_s": statistics.median(t["tokens_per_s"] for t in timing[1:]),
        "final_accuracy": evals[-1]["heldout_accuracy"],
        "curve": [(m["step"], m["heldout_accuracy"]) for m in evals],
    }
  return out


def lines(r: dict, steps: int, shared: bool = False) -> list[str]:
  out = [
      "## Sampler precision in training: float32 against bfloat16 rollout weights", "",
      f"Measured by `python scripts/bench_precision.py --steps {steps} --write-docs` "
      f"({platform.machine()}, {os.cpu_count()} CPUs): configs/default.py for {steps} steps, "
      "seed 0, both runs from one warm-started policy, `rl.measure_mismatch=true` (the float32 "
      "trainer re-scores every sampled token). The mismatch is per token: |log pi_train - "
      "log mu_sampler| and its mean, maximum and KL over each step's tokens; the agreement p5 "
      "is the 5th percentile of exp(-|gap|). bfloat16 runs the sampler with rounded weights, "
      "so its recorded behaviour log-probs are the bfloat16 policy's (exact for the policy that "
      "sampled) and the gap is what an off-policy correction sees."
      + (" Other work shared the machine during these runs: their tokens/s are perturbed (the "
         "mismatch statistics are not)." if shared else ""), "",
      "| sampler weights | mean abs log-prob gap | max gap | KL (mean over steps) | agreement p5 "
      "(median over steps) | rollout tok/s (median) | final held-out acc. |",
      "|---|---|---|---|---|---|---|"]
  for name in VARIANTS:
    x = r[name]
    out.append(f"| {name} | {x['mismatch_abs_mean']:.2e} | {x['mismatch_max']:.2e} | "
               f"{x['mismatch_kl']:.2e} | {x['agreement_p5_median']:.4f} | {x['rollout_tok_s']:.0f} | "
               f"{x['final_accuracy']:.3f} |")
  ratio = r["bfloat16"]["rollout_tok_s"] / r["float32"]["rollout_tok_s"]
  out += ["", f"bfloat16 rollout tokens/s over float32's in training: {ratio:.2f}x. Held-out "
          "accuracy by step: " + "; ".join(
              f"{n}: " + ", ".join(f"{s}: {a:.2f}" for s, a in r[n]["curve"]) for n in VARIANTS)]
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out", "precision"))
  ap.add_argument("--write-docs", action="store_true")
  ap.add_argument("--shared", action="store_true", help="say that other work shared the machine")
  ap.add_argument("--from-json", help="render a saved run (OUT_DIR/precision.json) instead of running")
  a = ap.parse_args()
  if a.from_json:
    with open(a.from_json) as f:
      r = json.load(f)
  else:
    r = run(a.steps, a.out_dir)
    with open(os.path.join(a.out_dir, "precision.json"), "w") as f:
      json.dump(r, f)
  emit_section("precision", lines(r, a.steps, a.shared), a.write_docs)
  print(json.dumps(r))


if __name__ == "__main__":
  main()
