"""Rollout throughput measurement shared by `scripts/bench_rollout.py` and the docs.

One warm-up run compiles every shape (its time is reported as compile_s),
then one timed run samples `new_tokens` tokens for every row at temperature
1.0 with no stop tokens, so each row generates exactly `new_tokens` tokens.
"""

from __future__ import annotations

import resource
import time

import jax
import numpy as np

from jaxroll.model.hf_import import load_hf_model
from jaxroll.rollout.engine import RolloutEngine
from jaxroll.rollout.sampling import SamplingParams


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def bench_rollout(hf_checkpoint: str, *, batch: int, prompt_len: int, new_tokens: int,
                  group_size: int = 1, dtype: str = "float32", seed: int = 0) -> dict:
  """Returns the benchmark record (see module docstring)."""
  if batch % group_size:
    raise ValueError(f"--batch ({batch}) must be a multiple of --group-size ({group_size})")
  t0 = time.perf_counter()
  model = load_hf_model(hf_checkpoint, param_dtype=dtype, dtype=dtype)
  load_s = time.perf_counter() - t0
  cfg = model.cfg
  engine = RolloutEngine.for_model(model, num_slots=batch, max_prompt_len=prompt_len,
                                   max_new_tokens=new_tokens, sampling=SamplingParams(temperature=1.0))
  params = engine.load(model, version=0)
  del model  # the engine holds its own decode-layout copy
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
      "decode_steps": engine.last_stats.decode_steps,
      "peak_rss_mb": peak_rss_mb(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
  }
