"""Decode-step time against the static KV cache's length (jaxroll only).

  python scripts/bench_cache_length.py --hf-checkpoint DIR --batch B --prompt-len P \
      --new-tokens N1,N2,... [--steps 32] [--reps 15] [--dtype float32] [--seed 0]

One engine per N (cache length P + N) on the same weights, the same
`--steps` decode steps timed in each, alternating. Prints one JSON line
last: batch, prompt_len, steps, cache_lengths, step_ms (medians),
slope_us_per_position, intercept_ms, kv_bytes_per_position and
kv_stream_gbps (a position's keys and values over the slope: the rate the
step streams its cache at).
"""

import argparse
import json

from jaxroll.rollout.benchmark import cache_length_sweep


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hf-checkpoint", required=True)
  ap.add_argument("--batch", type=int, required=True)
  ap.add_argument("--prompt-len", type=int, required=True)
  ap.add_argument("--new-tokens", required=True, help="comma-separated, at least two values")
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args()
  try:
    lengths = sorted({int(n) for n in a.new_tokens.split(",")})
  except ValueError:
    ap.error(f"--new-tokens must be comma-separated integers, got {a.new_tokens!r}")
  if len(lengths) < 2 or lengths[0] < a.steps:
    ap.error(f"--new-tokens needs at least two distinct values, each >= --steps ({a.steps}); got {a.new_tokens}")
  print(json.dumps(cache_length_sweep(a.hf_checkpoint, batch=a.batch, prompt_len=a.prompt_len,
                                      new_tokens=lengths, steps=a.steps, reps=a.reps, dtype=a.dtype,
                                      seed=a.seed)))


if __name__ == "__main__":
  main()
