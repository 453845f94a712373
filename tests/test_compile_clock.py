"""The compile clock: program preparation seconds as a union of JAX's
stage intervals, and nothing on a call whose program is ready."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxroll.metrics import compile_clock


def union_length(intervals):
  """Brute force: sort by start and sweep."""
  total, cur_s, cur_e = 0.0, None, None
  for s, e in sorted(intervals):
    if cur_e is None or s > cur_e:
      if cur_e is not None:
        total += cur_e - cur_s
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  return total + (cur_e - cur_s if cur_e is not None else 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_span_union_counts_nested_and_overlapping_time_once(seed):
  rng = np.random.default_rng(seed)
  intervals = []
  for _ in range(40):
    # An outer stage with stages nested inside it, then a gap.
    start = (intervals[-1][1] if intervals else 0.0) + rng.uniform(0.0, 1.0)
    length = rng.uniform(0.1, 2.0)
    for _ in range(rng.integers(0, 4)):
      s = start + rng.uniform(0, length)
      intervals.append((s, min(s + rng.uniform(0, length), start + length)))
    intervals.append((start, start + length))
    if rng.uniform() < 0.3:  # another thread's stage overlapping this one
      s = start + rng.uniform(-0.5, length)
      intervals.append((s, s + rng.uniform(0.05, 1.0)))
  # Arrival order is by end, with neighbours sometimes swapped (threads).
  order = sorted(intervals, key=lambda iv: iv[1])
  for i in range(0, len(order) - 1, 7):
    order[i], order[i + 1] = order[i + 1], order[i]
  union = compile_clock.SpanUnion()
  for s, e in order:
    union.add(s, e)
  assert union.total == pytest.approx(union_length(intervals), rel=1e-12)
  assert union.total < sum(e - s for s, e in intervals)  # nesting present
  starts = [s for s, _ in union.spans]
  assert starts == sorted(starts)
  assert all(a[1] < b[0] for a, b in zip(union.spans, union.spans[1:]))


def test_the_clock_counts_a_first_call_and_nothing_on_a_ready_program():
  @jax.jit
  def inner(x):
    return jnp.sin(x) * 2

  @jax.jit
  def outer(x):
    return inner(x) + inner(x * 3) + jnp.cos(x) @ x

  x = jnp.ones((16, 16))
  r0, t0 = compile_clock.read(), time.perf_counter()
  outer(x).block_until_ready()
  elapsed, r1 = time.perf_counter() - t0, compile_clock.read()
  prepare, xla = r1.prepare_s - r0.prepare_s, r1.xla_compile_s - r0.xla_compile_s
  assert 0 < xla <= prepare + 1e-6
  assert prepare <= elapsed
  outer(x).block_until_ready()
  assert compile_clock.read() == r1
