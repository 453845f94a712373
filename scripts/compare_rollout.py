"""Rollout throughput: jaxroll vs transformers `generate`, same weights, same run.

  python scripts/compare_rollout.py [--reps 3] [--out-dir bench_out] [--write-docs]

For each benchmark shape it writes a random-weight Qwen2 checkpoint (once),
then alternates `scripts/bench_rollout.py` and `scripts/bench_transformers.py`
in fresh processes `--reps` times, and reports medians and their ratio,
jaxroll's decode-step `weight_stream_fraction` against the same process's
weight-stream probe (jaxroll.rollout.weight_stream) and both engines' peak
RSS. The bfloat16 cases run both engines with bfloat16 weights. A full
run also times jaxroll's decode step at the tiny shape against the length
of its static KV cache (`scripts/bench_cache_length.py`). With
--write-docs the table replaces the rollout section of docs/benchmarks.md.
Prints one JSON line last: {"cases": the per-case records, "cache_sweep"}.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from docs_section import write_section  # noqa: E402

sys.path.insert(0, ROOT)
from jaxroll import run_info  # noqa: E402

CASES = {
    # name: (shape, batch, prompt_len, new_tokens, dtype)
    "tiny": ("tiny", 16, 32, 128, "float32"),
    # Reasoning-length generations: the engine's cost when the KV cache is long.
    "tiny-long": ("tiny", 64, 64, 1024, "float32"),
    "qwen2.5-0.5b": ("qwen2.5-0.5b", 8, 32, 32, "float32"),
    "tiny-bf16": ("tiny", 16, 32, 128, "bfloat16"),
    "qwen2.5-0.5b-bf16": ("qwen2.5-0.5b", 8, 32, 32, "bfloat16"),
}
# The cache-length sweep: shape, batch, prompt length, new-token counts.
CACHE_SWEEP = ("tiny", 16, 32, (32, 64, 128, 256))
BEGIN, END = "<!-- rollout-throughput:begin -->", "<!-- rollout-throughput:end -->"


def run_json(cmd):
  out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
  return json.loads(out.strip().splitlines()[-1])


def checkpoint(shape, out_dir):
  """The random-weight checkpoint of `shape`, written once."""
  ckpt = os.path.join(out_dir, f"qwen2-{shape}")
  if not os.path.isfile(os.path.join(ckpt, "config.json")):
    print(f"writing {ckpt}", file=sys.stderr)
    # In a child process: Linux keeps a process's peak RSS across fork and
    # exec, so a checkpoint written here would set a floor under the peak
    # RSS every benchmark child reports.
    subprocess.run([sys.executable, os.path.join(HERE, "make_random_checkpoint.py"), "--shape", shape,
                    "--out", ckpt], check=True, cwd=ROOT)
  return ckpt


def cache_sweep(out_dir):
  shape, batch, prompt_len, new_tokens = CACHE_SWEEP
  rec = run_json([sys.executable, os.path.join(HERE, "bench_cache_length.py"), "--hf-checkpoint",
                  checkpoint(shape, out_dir), "--batch", str(batch), "--prompt-len", str(prompt_len),
                  "--new-tokens", ",".join(map(str, new_tokens))])
  return {"shape": shape, **rec}


def bench_case(name, shape, batch, prompt_len, new_tokens, dtype, reps, out_dir):
  ckpt = checkpoint(shape, out_dir)
  args = ["--hf-checkpoint", ckpt, "--batch", str(batch), "--prompt-len", str(prompt_len),
          "--new-tokens", str(new_tokens), "--dtype", dtype]
  ours, theirs = [], []
  for rep in range(reps):
    ours.append(run_json([sys.executable, os.path.join(HERE, "bench_rollout.py"), *args, "--seed", str(rep)]))
    theirs.append(run_json([sys.executable, os.path.join(HERE, "bench_transformers.py"), *args, "--seed", str(rep)]))
    print(f"{name} rep {rep}: jaxroll {ours[-1]['tokens_per_s']:.1f} tok/s, "
          f"transformers {theirs[-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
  med = lambda runs, k: statistics.median(r[k] for r in runs)
  return {
      "case": name, "shape": shape, "dtype": dtype, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "jaxroll_tok_s": med(ours, "tokens_per_s"), "transformers_tok_s": med(theirs, "tokens_per_s"),
      "jaxroll_compile_s": med(ours, "compile_s"), "jaxroll_peak_rss_mb": med(ours, "peak_rss_mb"),
      "transformers_peak_rss_mb": med(theirs, "peak_rss_mb"),
      "weight_stream_fraction": med(ours, "weight_stream_fraction"),
      "probe_gbps": med(ours, "probe_gbps"), "step_ms": 1e3 * med(ours, "step_s"),
      "step_other_ms": 1e3 * med(ours, "step_other_s"),
      "probe_xla_ms": 1e3 * med(ours, "probe_xla_s"),
      "prefill_s": med(ours, "prefill_s"), "prefill_matmul_s": med(ours, "prefill_matmul_s"),
      "probe_run_tok_s": med(ours, "probe_run_tokens_per_s"),
      "probe_int8_ms": 1e3 * med(ours, "probe_int8_s") if "probe_int8_s" in ours[0] else None,
      "jaxroll_runs": [round(r["tokens_per_s"], 1) for r in ours],
      "transformers_runs": [round(r["tokens_per_s"], 1) for r in theirs],
      "versions": {"jax": ours[0]["jax"], "torch": theirs[0]["torch"],
                   "transformers": theirs[0]["transformers"]},
  }


def to_markdown(results, reps, sweep=None, cpu=None):
  lines = [
      BEGIN,
      "## Rollout throughput: jaxroll vs transformers",
      "",
      f"Generated by `python scripts/compare_rollout.py --reps {reps} --write-docs` on "
      f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPU cores ({_where(cpu)}), "
      "random-weight Qwen2 checkpoints, temperature 1.0, no early stop; both engines hold "
      "their weights in the row's dtype. "
      "Each engine runs in a fresh process after one warm-up call (jaxroll compiles its "
      "decode loop and prefill from the checkpoint's shapes before reading the weights: "
      "`RolloutEngine.compile_ahead`); runs alternate between "
      "the engines and the table gives medians of the timed runs. The decode step "
      "(every slot live, prefill excluded) is set against a weight-stream probe in the same "
      "process: a chain of skinny matmuls over the model's own decode weights (in XLA, "
      "chains run 8 to a compiled loop, as the engine's steps run), the faster "
      "of XLA and NumPy (`jaxroll/rollout/weight_stream.py`); `stream` is the step's "
      "weight bytes per second over the probe's, and `other` the step's time beyond "
      "its weight reads at probe speed. `prefill s` is the engine's prefill of the batch's prompts "
      "beside the same matmuls over prompts x prompt length rows, timed alone "
      "(bound by arithmetic; the faster of XLA and NumPy). `at probe speeds` is the ratio jaxroll would "
      "show were its run nothing but those prefill matmuls and one weight read per decode step, at "
      "the speeds this process measured for them.",
      "",
      "| case | dtype | batch | prompt | new tokens | jaxroll tok/s | transformers tok/s | ratio "
      "| at probe speeds | stream | probe GB/s | step ms (other) | prefill s (matmuls alone) | jaxroll compile s "
      "| peak RSS MB (jaxroll / transformers) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    lines.append(
        f"| {r['case']} | {r['dtype']} | {r['batch']} | {r['prompt_len']} | {r['new_tokens']} | "
        f"{r['jaxroll_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
        f"**{r['jaxroll_tok_s'] / r['transformers_tok_s']:.2f}x** | {_at_probe(r)} | "
        f"{r['weight_stream_fraction']:.2f} | {r['probe_gbps']:.1f} | "
        f"{r['step_ms']:.2f} ({r['step_other_ms']:.2f}) | {_prefill(r)} | {r['jaxroll_compile_s']:.1f} | "
        f"{r['jaxroll_peak_rss_mb']:.0f} / {r['transformers_peak_rss_mb']:.0f} |")
  lines += precision_lines(results)
  if sweep:
    lines += ["", cache_sweep_line(sweep)]
  lines += ["", "Individual runs (tokens/s):", ""]
  for r in results:
    lines.append(f"- {r['case']}: jaxroll {r['jaxroll_runs']}, transformers {r['transformers_runs']}")
  v = results[0]["versions"]
  lines += ["", f"Versions: jax {v['jax']}, torch {v['torch']}, transformers {v['transformers']}.",
            "", "Single-engine command: `python scripts/bench_rollout.py --hf-checkpoint "
            "bench_out/qwen2-tiny --batch 16 --prompt-len 32 --new-tokens 128`.", END]
  return "\n".join(lines)


def _where(cpu) -> str:
  # The CPU model and vector extensions when the run recorded them: ratios
  # move by tenths between machines of the same kind.
  return f"{cpu['model']}: {', '.join(cpu['isa'])}" if cpu else platform.machine()


def _at_probe(r) -> str:
  # Saved runs from before the probe-speed run was measured have no such fields.
  return f"{r['probe_run_tok_s'] / r['transformers_tok_s']:.2f}x" if "probe_run_tok_s" in r else "n/a"


def _prefill(r) -> str:
  return f"{r['prefill_s']:.3f} ({r['prefill_matmul_s']:.3f})" if "prefill_s" in r else "n/a"


def cache_sweep_line(sw) -> str:
  """The decode step against its static cache's length, in words."""
  steps = ", ".join(f"S={n} {ms:.2f} ms" for n, ms in zip(sw["cache_lengths"], sw["step_ms"]))
  gbps = sw["kv_stream_gbps"]
  rate = (f"that position's {sw['kv_bytes_per_position'] / 1024:.0f} KiB of keys and values at "
          f"{gbps:.1f} GB/s" if gbps else "no cost per position at all")
  return (f"Decode step against the length S of the static KV cache ({sw['shape']}, batch "
          f"{sw['batch']}, prompt {sw['prompt_len']}, the same {sw['steps']} steps in every engine, medians of "
          f"runs alternated in one process, `scripts/bench_cache_length.py`): {steps}. Each cache "
          f"position costs a step {sw['slope_us_per_position']:.2f} us, {rate}; the line's "
          f"intercept (no cache at all) is {sw['intercept_ms']:.2f} ms. The sweep's engines read the "
          "whole cache (`cache_window=False`); the engine's default reads only a window of it, the "
          "smallest of S, S/2, S/4, S/8 (at least 64 positions) that holds the live rows' furthest "
          "position (`jaxroll/rollout/live_rows.py`).")


def precision_lines(results) -> list[str]:
  """bfloat16 against float32 weights, per shape measured in both, and the
  weight-only int8 chain against the float32 one."""
  by = {(r["shape"], r["batch"], r["new_tokens"], r["dtype"]): r for r in results}
  out = []
  for (shape, batch, new, dtype), bf in by.items():
    f32 = by.get((shape, batch, new, "float32"))
    if dtype != "bfloat16" or f32 is None:
      continue
    out.append(
        f"- {shape}, batch {batch}: bfloat16 over float32 weights, jaxroll tokens/s "
        f"{bf['jaxroll_tok_s'] / f32['jaxroll_tok_s']:.2f}x (decode step "
        f"{bf['step_ms'] / f32['step_ms']:.2f}x the time, probe {bf['probe_gbps'] / f32['probe_gbps']:.2f}x "
        f"the bytes/s), transformers {bf['transformers_tok_s'] / f32['transformers_tok_s']:.2f}x; "
        f"peak RSS jaxroll {bf['jaxroll_peak_rss_mb'] / f32['jaxroll_peak_rss_mb']:.2f}x, "
        f"transformers {bf['transformers_peak_rss_mb'] / f32['transformers_peak_rss_mb']:.2f}x.")
  int8 = {}  # per shape, its first float32 case (they share one weight chain)
  for r in results:
    if r["dtype"] == "float32" and r.get("probe_int8_ms"):
      int8.setdefault(r["shape"], r)
  for r in int8.values():
    out.append(
        f"- {r['shape']}, batch {r['batch']}: weight-only int8 (the probe's chain over int8 weights with a "
        f"scale per column, dequantised before each matmul): {r['probe_int8_ms']:.2f} ms against "
        f"{r['probe_xla_ms']:.2f} ms in float32 ({r['probe_int8_ms'] / r['probe_xla_ms']:.2f}x the time "
        f"for about a quarter of the bytes).")
  return ["", "Low-precision weights on this CPU:", ""] + out if out else []


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench_out"))
  ap.add_argument("--only", choices=list(CASES))
  ap.add_argument("--write-docs", action="store_true")
  ap.add_argument("--from-json", help="render a saved run (OUT_DIR/compare_rollout.json) instead of running")
  a = ap.parse_args()
  if a.only and a.write_docs:
    sys.exit("--write-docs rewrites the whole table: run every case (drop --only)")
  os.makedirs(a.out_dir, exist_ok=True)
  if a.from_json:
    with open(a.from_json) as f:
      saved = json.load(f)
    saved = saved if isinstance(saved, dict) else {"cases": saved, "cache_sweep": None}  # older runs
  else:
    saved = {"cases": [bench_case(name, *c, a.reps, a.out_dir) for name, c in CASES.items()
                       if a.only in (None, name)],
             "cache_sweep": cache_sweep(a.out_dir) if a.only is None else None, "cpu": run_info.cpu()}
    with open(os.path.join(a.out_dir, "compare_rollout.json"), "w") as f:
      json.dump(saved, f)
  section = to_markdown(saved["cases"], a.reps, saved["cache_sweep"], saved.get("cpu"))
  print(section)
  print(json.dumps(saved))
  if a.write_docs:
    write_section("rollout-throughput", section.split(BEGIN, 1)[1].rsplit(END, 1)[0].strip("\n"))


if __name__ == "__main__":
  main()
