"""Rollout throughput measurement shared by `scripts/bench_rollout.py` and the docs.

The engine compiles its decode loop and prefill from the checkpoint's
shapes before the weights are read (`RolloutEngine.compile_ahead`: the
compiler's scratch memory is gone before the weights arrive) and one
warm-up run compiles the few small programs left (together: compile_s),
then one timed run samples `new_tokens` tokens for every row at temperature
1.0 with no stop tokens, so each row generates exactly `new_tokens` tokens.
Peak RSS is read then, before anything else is allocated.

Then the decode step alone: a full batch is inserted and `generate` is
timed (prefill excluded), in turn with the weight-stream probe
(jaxroll.rollout.weight_stream), medians over `step_reps` runs of each,
and the two are set against each other: the step's
`weight_stream_fraction` and its time split. For float32 weights the
same chain is also timed over weight-only int8 copies (`int8_probe`).
With `peak_gbps` (an accelerator's memory bandwidth) the record also
gives the step's fraction of that roofline.

Last, the run at probe speeds (`probe_run_s`, `probe_run_tokens_per_s`):
the prefill's matmuls at the speed of the same matmuls timed alone
(`weight_stream.prefill_probe`; at prompts x prompt length rows they are
bound by arithmetic) plus one weight read per decode step at probe speed,
beside the engine's own prefill time (`prefill_s`). tokens / probe_run_s
is the rate the engine would reach were its run nothing but these matmuls
at the speeds this process measured for them: how far the engine is from
what its arithmetic and weight reads cost on this machine. A fused
prefill can beat its matmuls timed alone by a little; the decode step
cannot beat the probe's reads by much.
"""

from __future__ import annotations

import functools
import resource
import time
from typing import Optional

import jax
import numpy as np

from jaxroll.model.hf_import import hf_decode_weight_shapes, load_hf_decode_weights
from jaxroll.rollout import weight_stream
from jaxroll.rollout.engine import RolloutEngine
from jaxroll.rollout.sampling import SamplingParams


def add_decode_shape_args(ap) -> None:
  """The arguments every single-engine decode script takes: the checkpoint
  and the batch's shape, its weights' dtype and the prompts' seed."""
  ap.add_argument("--hf-checkpoint", required=True)
  ap.add_argument("--batch", type=int, required=True)
  ap.add_argument("--prompt-len", type=int, required=True)
  ap.add_argument("--new-tokens", type=int, required=True)
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--seed", type=int, default=0)


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def bench_rollout(hf_checkpoint: str, *, batch: int, prompt_len: int, new_tokens: int,
                  group_size: int = 1, dtype: str = "float32", seed: int = 0,
                  step_reps: int = 5, peak_gbps: float = 0.0) -> dict:
  """Returns the benchmark record (see module docstring)."""
  if batch % group_size:
    raise ValueError(f"--batch ({batch}) must be a multiple of --group-size ({group_size})")
  # The decode loop and prefill compile before the weights are read (the
  # compiler's scratch memory and the weights are never resident together).
  t0 = time.perf_counter()
  cfg, graphdef, state_shapes, head_shape = hf_decode_weight_shapes(
      hf_checkpoint, param_dtype=dtype, dtype=dtype)
  engine = RolloutEngine(cfg, graphdef, num_slots=batch, max_prompt_len=prompt_len,
                         max_new_tokens=new_tokens, sampling=SamplingParams(temperature=1.0))
  engine.compile_ahead(state_shapes, head_shape, num_prompts=batch // group_size, prompt_len=prompt_len)
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  # Straight into decode layout: the weights are held once.
  cfg, graphdef, state, head_ExV = load_hf_decode_weights(hf_checkpoint, param_dtype=dtype, dtype=dtype)
  load_s = time.perf_counter() - t0
  params = engine.load(state, version=0, head_ExV=head_ExV)
  del state, head_ExV
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, cfg.vocab_size, size=(batch // group_size, prompt_len)).tolist()
  key = jax.random.key(seed)

  t0 = time.perf_counter()  # the warm-up call compiles the small programs left
  engine.rollout(params, prompts, group_size=group_size, key=jax.random.fold_in(key, 1))
  compile_s += time.perf_counter() - t0

  t0 = time.perf_counter()
  traj = engine.rollout(params, prompts, group_size=group_size, key=key)
  seconds = time.perf_counter() - t0
  tokens = traj.num_tokens
  if tokens != batch * new_tokens:
    raise RuntimeError(f"expected {batch * new_tokens} generated tokens, got {tokens}")
  decode_steps = engine.last_stats.decode_steps
  rss_mb = peak_rss_mb()

  probe = weight_stream.probe(params, batch, reps=step_reps, step_seconds=functools.partial(
      decode_step_seconds, engine, params, engine.prefill(params, prompts), group_size, key))
  stream = weight_stream.split(probe["step_s"], probe)
  if dtype == "float32":  # would int8 weights pay here? (their own chain, same process)
    probe.update(weight_stream.int8_probe(params, batch, reps=step_reps))
  # The run at probe speeds: its prefill's matmuls (bound by arithmetic)
  # and one weight read per decode step.
  at_probe = weight_stream.prefill_probe(params, len(prompts) * prompt_len, reps=3)
  at_probe["prefill_s"] = weight_stream.median_seconds(
      lambda: jax.block_until_ready(engine.prefill(params, prompts)), 3)
  at_probe["probe_run_s"] = (at_probe["prefill_matmul_s"]
                             + decode_steps * probe["weight_bytes"] / (probe["probe_gbps"] * 1e9))
  at_probe["probe_run_tokens_per_s"] = tokens / at_probe["probe_run_s"]
  if peak_gbps:
    stream["roofline_fraction"] = stream["step_gbps"] / peak_gbps
  return {
      "engine": "jaxroll",
      "tokens_per_s": tokens / seconds,
      "seconds": seconds,
      "compile_s": compile_s,
      "load_s": load_s,
      "batch": batch,
      "group_size": group_size,
      "prompt_len": prompt_len,
      "new_tokens": new_tokens,
      "dtype": dtype,
      "decode_steps": decode_steps,
      "peak_rss_mb": rss_mb,
      **probe,
      **stream,
      **at_probe,
      "jax": jax.__version__,
      "backend": jax.default_backend(),
  }


def decode_step_seconds(engine: RolloutEngine, params, prefix, group_size: int, key,
                        max_steps: Optional[int] = None) -> float:
  """Seconds per decode step of one full batch decoded to its end, or for
  `max_steps` steps (no prefill)."""
  B = engine.num_slots
  rows = [i // group_size for i in range(B)]
  state = jax.block_until_ready(engine.insert(engine.init_decode_state(), prefix, list(range(B)),
                                              rows, jax.random.split(key, B)))
  t0 = time.perf_counter()
  state, steps = jax.block_until_ready(engine.generate(params, state, max_steps=max_steps))
  return (time.perf_counter() - t0) / int(steps)


def cache_length_sweep(hf_checkpoint: str, *, batch: int, prompt_len: int, new_tokens: list,
                       steps: int = 32, reps: int = 15, dtype: str = "float32", seed: int = 0) -> dict:
  """Decode-step time against the static KV cache's length, in one process.

  One engine per `new_tokens` value (cache length S = prompt_len + n), all
  on the same weights; each times `steps` decode steps of a full batch from
  the same prompts, so only S differs. The engines attend over the whole
  cache (`cache_window=False`): the sweep prices a position that is read.
  Runs alternate between the engines `reps` times (a shared machine's slow
  stretches hit all of them alike) and the medians are fitted with a line:
  its slope is what one more cache position costs a step, set against that
  position's bytes of keys and values (every row, every layer).

  Returns {"batch", "prompt_len", "steps", "cache_lengths", "step_ms",
  "slope_us_per_position", "intercept_ms", "kv_bytes_per_position",
  "kv_stream_gbps"}.
  """
  if any(n < steps for n in new_tokens):
    raise ValueError(f"every new_tokens value must be >= steps ({steps}): {new_tokens}")
  cfg, graphdef, state, head_ExV = load_hf_decode_weights(hf_checkpoint, param_dtype=dtype, dtype=dtype)
  prompts = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, prompt_len)).tolist()
  key = jax.random.key(seed)
  timers = []
  for n in new_tokens:
    engine = RolloutEngine(cfg, graphdef, num_slots=batch, max_prompt_len=prompt_len,
                           max_new_tokens=n, sampling=SamplingParams(temperature=1.0),
                           cache_window=False)
    params = engine.load(state, version=0, head_ExV=head_ExV)
    timers.append(functools.partial(decode_step_seconds, engine, params, engine.prefill(params, prompts), 1,
                                    key, max_steps=steps))
    timers[-1]()  # compiles
  runs = [[timer() for timer in timers] for _ in range(reps)]  # alternating
  lengths = np.asarray([prompt_len + n for n in new_tokens], np.float64)
  step_s = np.median(np.asarray(runs), axis=0)
  slope, intercept = np.polyfit(lengths, step_s, 1)
  per_position = batch * engine.kv_bytes_per_token  # the same for every engine
  return {"batch": batch, "prompt_len": prompt_len, "steps": steps,
          "cache_lengths": lengths.astype(int).tolist(),
          "step_ms": (1e3 * step_s).tolist(), "slope_us_per_position": 1e6 * slope,
          "intercept_ms": 1e3 * intercept, "kv_bytes_per_position": per_position,
          "kv_stream_gbps": per_position / slope / 1e9 if slope > 0 else None}
