"""jaxroll's Pallas kernels compiled for the device, against their references, and timed.

  python scripts/gpu_kernels.py                 # on a GPU: the issue shapes, bfloat16
  python scripts/gpu_kernels.py --small --interpret   # anywhere: tiny shapes, interpret mode

For each kernel (paged attention, Quest page scores, speculative
verification of point-mass and of sampled drafts) it builds one random input, checks the kernel against its
pure-JAX reference (outputs within tolerance; verification's accepted
lengths and tokens identical), then times the kernel, its reference and,
for paged attention, the XLA path the engine uses on CPU. Shapes: paged
attention and Quest at batch 64 over a 4K context in pages of 16, with
Qwen2.5-0.5B's heads (14 query, 2 KV, head dim 64); verification at batch
64, k = 4, vocabulary 151,936. Prints one JSON line per kernel, then one
with every record.
"""

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxroll.kernels import paged_attention as pa
from jaxroll.kernels import quest, spec_verify, spec_verify_sampled


def _time(fn, reps):
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _pool(rng, B, K, D, P, M, dtype):
  """A page pool with each row's M pages distinct, and ragged row lengths."""
  N = B * M
  k = jnp.asarray(rng.normal(size=(N + 1, K, D, P)), dtype)
  v = jnp.asarray(rng.normal(size=(N + 1, K, P, D)), dtype)
  table = jnp.asarray(rng.permutation(N).reshape(B, M), jnp.int32)
  lengths = rng.integers(P, M * P + 1, size=B)
  return k, v, table, lengths


def check_paged(rng, a, dtype):
  B, H, K, D, P, ctx, T = a.batch, 14, 2, 64, 16, a.context, 1
  M = ctx // P
  k, v, table, lengths = _pool(rng, B, K, D, P, M, dtype)
  q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
  q_pos = jnp.asarray(np.stack([np.arange(n - T, n) for n in lengths]), jnp.int32)
  pages = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, K, M))
  n = jnp.asarray(np.broadcast_to(((lengths - 1) // P + 1)[:, None], (B, K)), jnp.int32)
  args = (q, k, v, table, q_pos, pages, n)
  kernel = lambda: pa.paged_attention(*args, interpret=a.interpret)
  ref = jax.jit(pa.paged_attention_reference)
  xla = jax.jit(pa.paged_attention_xla)
  err = float(jnp.max(jnp.abs(kernel().astype(jnp.float32) - ref(*args).astype(jnp.float32))))
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
  return {"kernel": "paged_attention", "shape": f"B{B} ctx{ctx} P{P} H{H} K{K} D{D}",
          "dtype": str(jnp.dtype(dtype)), "max_abs_err": err, "ok": err <= tol,
          "kernel_ms": 1e3 * _time(kernel, a.reps), "reference_ms": 1e3 * _time(lambda: ref(*args), a.reps),
          "xla_path_ms": 1e3 * _time(lambda: xla(*args), a.reps),
          "kv_bytes_live": int(2 * K * D * P * n[:, 0].sum() * jnp.dtype(dtype).itemsize)}


def check_quest(rng, a, dtype):
  B, H, K, D, P, ctx = a.batch, 14, 2, 64, 16, a.context
  M = ctx // P
  N = B * M
  kmin = jnp.asarray(rng.normal(size=(N + 1, K, D)) - 1.0, dtype)
  kmax = kmin + jnp.asarray(rng.random(size=(N + 1, K, D)) * 2.0, dtype)
  table = jnp.asarray(rng.permutation(N).reshape(B, M), jnp.int32)
  n_live = jnp.asarray(rng.integers(1, M + 1, size=B), jnp.int32)
  q = jnp.asarray(rng.normal(size=(B, 1, H, D)), dtype)
  args = (q, kmin, kmax, table, n_live)
  kernel = lambda: quest.quest_scores(*args, interpret=a.interpret)
  ref = jax.jit(quest.quest_scores_reference)
  got, want = np.asarray(kernel(), np.float32), np.asarray(ref(*args), np.float32)
  live = np.isfinite(want)
  same_mask = bool(np.array_equal(live, np.isfinite(got)))
  err = float(np.max(np.abs(got[live] - want[live]) / (1.0 + np.abs(want[live]))))
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  return {"kernel": "quest_scores", "shape": f"B{B} ctx{ctx} P{P} H{H} K{K} D{D}",
          "dtype": str(jnp.dtype(dtype)), "max_rel_err": err, "ok": same_mask and err <= tol,
          "kernel_ms": 1e3 * _time(kernel, a.reps), "reference_ms": 1e3 * _time(lambda: ref(*args), a.reps)}


def _verify_record(name, shape, dtype, kernel, ref, T, reps):
  """Kernel against reference: identical accepted lengths and emitted tokens."""
  (n1, t1, l1), (n2, t2, l2) = kernel(), ref()
  same = bool(np.array_equal(n1, n2))
  if same:  # tokens past a row's emitted ones are unspecified
    emitted = np.arange(T)[None, :] <= np.asarray(n1)[:, None]
    same = bool(np.array_equal(np.asarray(t1)[emitted], np.asarray(t2)[emitted]))
    err = float(np.max(np.abs(np.asarray(l1)[emitted] - np.asarray(l2)[emitted])))
  else:
    err = float("nan")
  return {"kernel": name, "shape": shape, "dtype": str(jnp.dtype(dtype)),
          "identical_tokens": same, "max_abs_logp_err": err, "ok": same and err <= 1e-3,
          "kernel_ms": 1e3 * _time(kernel, reps), "reference_ms": 1e3 * _time(ref, reps)}


def _verify_inputs(rng, a, dtype):
  B, k, V = a.batch, 4, a.vocab
  T = k + 1
  scores = jnp.asarray(rng.normal(size=(B, T, V)) * 3.0, dtype)
  # Drafts that are often the most likely token, so acceptance varies.
  best = np.asarray(jnp.argmax(scores, axis=-1))
  draft = np.where(rng.random((B, T)) < 0.7, best, rng.integers(0, V, (B, T))).astype(np.int32)
  k_B = rng.integers(0, k + 1, size=B).astype(np.int32)
  seed = rng.integers(0, 2**32, size=(B, 2), dtype=np.uint32)
  count = rng.integers(0, 100, size=B).astype(np.int32)
  return scores, (jnp.asarray(draft), jnp.asarray(k_B), jnp.asarray(seed), jnp.asarray(count)), f"B{B} k{k} V{V}", T


def check_verify(rng, a, dtype):
  scores, rest, shape, T = _verify_inputs(rng, a, dtype)
  ref = jax.jit(spec_verify.verify_reference)
  return _verify_record("spec_verify", shape, dtype,
                        lambda: spec_verify.verify(scores, *rest, interpret=a.interpret),
                        lambda: ref(scores, *rest), T, a.reps)


def check_verify_sampled(rng, a, dtype):
  """The general rule (layer-skip drafts): q a perturbed softmax of the scores."""
  scores, rest, shape, T = _verify_inputs(rng, a, dtype)
  noise = jnp.asarray(rng.normal(size=scores.shape), jnp.float32)
  q = jax.nn.softmax(scores.astype(jnp.float32) + noise, axis=-1).astype(dtype)
  ref = jax.jit(spec_verify_sampled.verify_sampled_reference)
  return _verify_record("spec_verify_sampled", shape, dtype,
                        lambda: spec_verify_sampled.verify_sampled(scores, q, *rest, interpret=a.interpret),
                        lambda: ref(scores, q, *rest), T, a.reps)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--small", action="store_true", help="tiny shapes (for interpret mode on CPU)")
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  ap.add_argument("--reps", type=int, default=10)
  a = ap.parse_args()
  a.batch, a.context, a.vocab = (4, 64, 1000) if a.small else (64, 4096, 151936)
  dtype = getattr(jnp, a.dtype)
  rng = np.random.default_rng(0)
  records = []
  for check in (check_paged, check_quest, check_verify, check_verify_sampled):
    rec = {**check(rng, a, dtype), "backend": jax.default_backend(), "interpret": a.interpret}
    print(json.dumps(rec), flush=True)
    records.append(rec)
  print(json.dumps(records))
  sys.exit(0 if all(r["ok"] for r in records) else 1)


if __name__ == "__main__":
  main()
