"""Rollout throughput measurement shared by `scripts/bench_rollout.py` and the docs.

One warm-up run compiles every shape (its time is reported as compile_s),
then one timed run samples `new_tokens` tokens for every row at temperature
1.0 with no stop tokens, so each row generates exactly `new_tokens` tokens.
Peak RSS is read then, before anything else is allocated.

Then the decode step alone: a full batch is inserted and `generate` is
timed (prefill excluded), in turn with the weight-stream probe
(jaxroll.rollout.weight_stream), medians over `step_reps` runs of each,
and the two are set against each other: the step's
`weight_stream_fraction` and its time split. With `peak_gbps` (an
accelerator's memory bandwidth) the record also gives the step's fraction
of that roofline.
"""

from __future__ import annotations

import functools
import resource
import time

import jax
import numpy as np

from jaxroll.model.hf_import import load_hf_decode_weights
from jaxroll.rollout import weight_stream
from jaxroll.rollout.engine import RolloutEngine
from jaxroll.rollout.sampling import SamplingParams


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def bench_rollout(hf_checkpoint: str, *, batch: int, prompt_len: int, new_tokens: int,
                  group_size: int = 1, dtype: str = "float32", seed: int = 0,
                  step_reps: int = 5, peak_gbps: float = 0.0) -> dict:
  """Returns the benchmark record (see module docstring)."""
  if batch % group_size:
    raise ValueError(f"--batch ({batch}) must be a multiple of --group-size ({group_size})")
  t0 = time.perf_counter()
  # Straight into decode layout: the weights are held once.
  cfg, graphdef, state, head_ExV = load_hf_decode_weights(hf_checkpoint, param_dtype=dtype, dtype=dtype)
  load_s = time.perf_counter() - t0
  engine = RolloutEngine(cfg, graphdef, num_slots=batch, max_prompt_len=prompt_len,
                         max_new_tokens=new_tokens, sampling=SamplingParams(temperature=1.0))
  params = engine.load(state, version=0, head_ExV=head_ExV)
  del state, head_ExV
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, cfg.vocab_size, size=(batch // group_size, prompt_len)).tolist()
  key = jax.random.key(seed)

  t0 = time.perf_counter()
  engine.rollout(params, prompts, group_size=group_size, key=jax.random.fold_in(key, 1))
  compile_s = time.perf_counter() - t0

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
      "jax": jax.__version__,
      "backend": jax.default_backend(),
  }


def decode_step_seconds(engine: RolloutEngine, params, prefix, group_size: int, key) -> float:
  """Seconds per decode step of one full batch decoded to its end (no prefill)."""
  B = engine.num_slots
  rows = [i // group_size for i in range(B)]
  state = jax.block_until_ready(engine.insert(engine.init_decode_state(), prefix, list(range(B)),
                                              rows, jax.random.split(key, B)))
  t0 = time.perf_counter()
  state, steps = jax.block_until_ready(engine.generate(params, state))
  return (time.perf_counter() - t0) / int(steps)
