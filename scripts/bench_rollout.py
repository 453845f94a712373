"""Rollout throughput of jaxroll on a Hugging Face checkpoint.

  python scripts/bench_rollout.py --hf-checkpoint DIR --batch B --prompt-len P \
      --new-tokens N [--group-size G] [--dtype float32] [--seed 0]

Prints one JSON line last: tokens_per_s, seconds, compile_s, batch,
new_tokens, peak_rss_mb, the decode step's seconds, the weight-stream probe
(probe_gbps, probe_xla_gbps, probe_numpy_gbps), weight_stream_fraction, the
step's split (step_matmul_s, step_other_s) and the settings; for float32
weights also the weight-only int8 chain (probe_int8_s, probe_int8_gbps,
int8_weight_bytes: jaxroll.rollout.weight_stream.int8_probe); with
--peak-gbps (an accelerator's memory bandwidth, e.g. 4800 for an H200) also
roofline_fraction. Last the run at probe speeds: prefill_s (the engine's
prefill), prefill_matmul_s (its matmuls timed alone), probe_run_s and
probe_run_tokens_per_s (jaxroll.rollout.benchmark).
"""

import argparse
import json

from jaxroll.rollout.benchmark import add_decode_shape_args, bench_rollout


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_decode_shape_args(ap)
  ap.add_argument("--group-size", type=int, default=1)
  ap.add_argument("--peak-gbps", type=float, default=0.0)
  a = ap.parse_args()
  print(json.dumps(bench_rollout(a.hf_checkpoint, batch=a.batch, prompt_len=a.prompt_len,
                                 new_tokens=a.new_tokens, group_size=a.group_size,
                                 dtype=a.dtype, seed=a.seed, peak_gbps=a.peak_gbps)))


if __name__ == "__main__":
  main()
