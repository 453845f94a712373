"""How close a decode step comes to streaming its weights at the memory system's speed.

At batch sizes where decoding is bound by memory, a step's floor is the
time to read every weight once. `probe` measures what this machine gives
for exactly those reads: a chain of skinny matmuls [B, in] @ [in, out] over
the model's own decode weights, in the order a step reads them (each
layer's qkv, out, gate|up and down kernels, then the [E, V] head), timed
in one jitted XLA loop of chains with the model's own matmul (`transformer.matmul`)
and, for float32, in NumPy's BLAS over arrays of the same shapes. The faster of the two is the probe bandwidth, and

  weight_stream_fraction = (weight bytes per step / step seconds) / probe bandwidth

says how much of it the engine's step reaches (1.0: the step costs what
its weight reads cost, everything else hidden). `split` turns the same
numbers into an estimate of the step's time in matmuls (the weight reads
at probe speed) and in everything else.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxroll.model import transformer
from jaxroll.rollout.decode_params import DecodeParams


def decode_weights(params: DecodeParams) -> list[jax.Array]:
  """The matmul weights one decode step reads, in the order it reads them."""
  pure = nnx.to_pure_dict(params.state)
  out = []
  for i in sorted(pure["layers"], key=int):
    layer = pure["layers"][i]
    out += [layer["attn"]["qkv"]["kernel"], layer["attn"]["out"]["kernel"],
            layer["mlp"]["gate_up"]["kernel"], layer["mlp"]["down"]["kernel"]]
  return out + [params.head_ExV]


def weight_bytes(params: DecodeParams) -> int:
  """Bytes of weights a decode step reads: every parameter but the
  embedding table (a step gathers B of its rows) and the head once."""
  pure = nnx.to_pure_dict(params.state)
  pure.pop("embed")
  pure.pop("lm_head", None)  # an untied head is params.head_ExV itself
  return sum(x.nbytes for x in jax.tree.leaves(pure)) + params.head_ExV.nbytes


def _fit(h, n, xp):
  """`h`'s first n columns, zero-padded when it has fewer."""
  if h.shape[1] >= n:
    return h[:, :n]
  return xp.concatenate([h, xp.zeros((h.shape[0], n - h.shape[1]), h.dtype)], axis=1)


def _chain(ws, x, xp, matmul):
  h = x
  for w in ws:
    h = matmul(_fit(h, w.shape[0], xp), w)
    # Keep activations near unit scale (random weights would otherwise
    # drift into denormals, which are slow on x86, or overflow).
    h = h / (xp.sqrt(xp.mean(h.astype(xp.float32) ** 2)) + 1e-6).astype(h.dtype)
  return h


# Chains per timed call of the XLA probes: a decode step runs inside the
# engine's compiled multi-step loop, so its time has no per-call dispatch;
# the probe's chains run the same way, each reading the previous one's
# output (nothing can be hoisted), and a call's time is divided by this.
CHAINS_PER_CALL = 8


def _looped(chain_fn, x):
  """`chain_fn` applied CHAINS_PER_CALL times in one compiled loop, each
  application fed the previous one's output cut to `x`'s width."""
  body = lambda _, h: _fit(chain_fn(h), x.shape[1], jnp)
  return jax.lax.fori_loop(0, CHAINS_PER_CALL, body, x)


def float_chains(ws, x):
  """CHAINS_PER_CALL chains over the weights `ws` with the model's matmul."""
  return _looped(lambda h: _chain(ws, h, jnp, transformer.matmul), x)


def median_seconds(fn, reps: int) -> float:
  """Median seconds of `reps` calls of `fn` after one untimed call."""
  fn()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def probe(params: DecodeParams, batch: int, *, reps: int = 5, numpy_probe: bool = True,
          step_seconds=None) -> dict:
  """Times the weight-read chain; returns seconds and GB/s for XLA and NumPy.

  Args:
    params: the engine's decode weights (the XLA chain reads these arrays).
    batch: rows per step (the skinny dimension).
    numpy_probe: also time NumPy over fresh float32 arrays of the same
      shapes (allocated here, as much memory again as the weights); skipped
      for other dtypes, where NumPy has no fast matmul.
    step_seconds: optional callable timing the engine's decode step
      (seconds per step); it is run in turn with the XLA chain, so that on
      a shared, noisy machine both medians come from the same stretch of
      time.

  Returns:
    {"weight_bytes", "probe_xla_s", "probe_xla_gbps", "probe_numpy_s",
     "probe_numpy_gbps" (None when skipped), "probe_gbps" (the best)}, and
    "step_s" (the median of `step_seconds`) when it is given.
  """
  ws = decode_weights(params)
  nbytes = weight_bytes(params)
  dtype = ws[0].dtype
  x = jnp.ones((batch, ws[0].shape[0]), dtype)
  # The model's own matmul (float32 accumulation: the fast bfloat16 path).
  chain = jax.jit(float_chains)
  run_chain = lambda: jax.block_until_ready(chain(ws, x))
  run_chain()  # compiles
  if step_seconds is not None:
    step_seconds()  # the step's own first call may compile too
  chain_s, step_s = [], []
  for _ in range(reps):
    if step_seconds is not None:
      step_s.append(step_seconds())
    t0 = time.perf_counter()
    run_chain()
    chain_s.append((time.perf_counter() - t0) / CHAINS_PER_CALL)
  xla_s = statistics.median(chain_s)
  out = {"weight_bytes": nbytes, "probe_xla_s": xla_s, "probe_xla_gbps": nbytes / xla_s / 1e9,
         "probe_numpy_s": None, "probe_numpy_gbps": None}
  if numpy_probe and dtype == jnp.float32:
    rng = np.random.default_rng(0)
    ws_np = [rng.standard_normal(w.shape, dtype=np.float32) * np.float32(0.02) for w in ws]
    x_np = np.ones((batch, ws_np[0].shape[0]), np.float32)
    np_s = median_seconds(lambda: _chain(ws_np, x_np, np, np.matmul), reps)
    del ws_np
    out.update(probe_numpy_s=np_s, probe_numpy_gbps=nbytes / np_s / 1e9)
  out["probe_gbps"] = max(g for g in (out["probe_xla_gbps"], out["probe_numpy_gbps"]) if g)
  if step_s:
    out["step_s"] = statistics.median(step_s)
  return out


def layer_flops(params: DecodeParams, rows: int) -> int:
  """Multiply-adds x 2 of the layers' matmuls over `rows` token rows (the
  head excluded: a prefill computes no logits)."""
  return 2 * rows * sum(int(w.shape[0]) * int(w.shape[1]) for w in decode_weights(params)[:-1])


def prefill_probe(params: DecodeParams, rows: int, *, reps: int = 3, numpy_probe: bool = True) -> dict:
  """The prefill's matmuls timed alone: one chain over the layers' weights (no
  head) at `rows` rows, a prefill's prompts x prompt length, where a
  matmul is bound by arithmetic rather than by its weight reads.

  Prefill is also attention and elementwise work; its matmuls at this
  speed are most of its time, not all of it. The faster of
  XLA (the model's matmul) and, for float32, NumPy's BLAS.

  Returns {"prefill_matmul_s", "prefill_matmul_gflops", "prefill_flops"}.
  """
  ws = decode_weights(params)[:-1]
  x = jnp.ones((rows, ws[0].shape[0]), ws[0].dtype)
  chain = jax.jit(lambda ws, x: _chain(ws, x, jnp, transformer.matmul))
  best = median_seconds(lambda: jax.block_until_ready(chain(ws, x)), reps)
  if numpy_probe and ws[0].dtype == jnp.float32:
    rng = np.random.default_rng(0)
    ws_np = [rng.standard_normal(w.shape, dtype=np.float32) * np.float32(0.02) for w in ws]
    best = min(best, median_seconds(lambda: _chain(ws_np, np.ones(x.shape, np.float32), np, np.matmul), reps))
    del ws_np
  flops = layer_flops(params, rows)
  return {"prefill_matmul_s": best, "prefill_matmul_gflops": flops / best / 1e9, "prefill_flops": flops}


def int8_chains(qs, scales, x):
  """CHAINS_PER_CALL chains over weight-only int8 weights `qs` (one float32
  scale per output column in `scales`), each turned into `x`'s dtype where
  it is read."""

  def chain(h):
    # An int8 zero tied to the loop's carry (XLA keeps a float x * 0), so
    # the conversion cannot be hoisted out of the loop: every chain reads
    # the int8 weights, as every decode step would.
    zero = (0.0 * h[0, 0]).astype(jnp.int8)
    return _chain([(q + zero).astype(x.dtype) * s.astype(x.dtype) for q, s in zip(qs, scales)], h, jnp,
                  transformer.matmul)

  return _looped(chain, x)


def int8_probe(params: DecodeParams, batch: int, *, reps: int = 5) -> dict:
  """The same chain with weight-only int8 weights: what an int8 engine's
  weight reads would cost here.

  Int8 arrays of the decode weights' shapes (random values: the speed does
  not depend on them) with one float32 scale per output column, turned
  back into the activations' dtype inside the jitted chain, as a
  weight-only int8 decode step would. XLA:CPU has no int8-weight matmul,
  so the conversion is its own operation.

  Returns {"int8_weight_bytes", "probe_int8_s", "probe_int8_gbps" (int8
  bytes per second)}.
  """
  shapes = [w.shape for w in decode_weights(params)]
  dtype = params.head_ExV.dtype
  rng = np.random.default_rng(0)
  qs = [jnp.asarray(rng.integers(-127, 128, size=s, dtype=np.int8)) for s in shapes]
  scales = [jnp.full((s[1],), 0.01, jnp.float32) for s in shapes]
  chain = jax.jit(int8_chains)
  x = jnp.ones((batch, shapes[0][0]), dtype)
  seconds = median_seconds(lambda: jax.block_until_ready(chain(qs, scales, x)), reps) / CHAINS_PER_CALL
  nbytes = sum(q.nbytes for q in qs)
  return {"int8_weight_bytes": nbytes, "probe_int8_s": seconds, "probe_int8_gbps": nbytes / seconds / 1e9}


def split(step_s: float, probe_result: dict) -> dict:
  """The step's time as weight reads at probe speed plus the rest.

  Returns {"weight_stream_fraction", "step_matmul_s" (estimate),
  "step_other_s" (step_s minus it; negative would mean faster than the
  probe), "step_gbps"}.
  """
  nbytes, gbps = probe_result["weight_bytes"], probe_result["probe_gbps"]
  matmul_s = nbytes / (gbps * 1e9)
  return {"weight_stream_fraction": (nbytes / step_s / 1e9) / gbps,
          "step_matmul_s": matmul_s, "step_other_s": step_s - matmul_s,
          "step_gbps": nbytes / step_s / 1e9}
