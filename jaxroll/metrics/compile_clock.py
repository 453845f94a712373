"""Wall-clock seconds this process has spent preparing programs: tracing,
lowering and XLA compilation.

A step's phases are timed by the wall clock, so a step that meets a new
shape also pays for its program. Short benchmark runs meet many, and their
medians would compare compilers, not updates: timing.jsonl records the
preparation seconds inside each update (`update_compile_s`) and step
(`step_compile_s`) from this clock, and the step's XLA compilation alone
(`step_xla_compile_s`; with a persistent compilation cache,
jaxroll.compile_cache, it is the loading of a cached program instead,
while tracing and lowering remain).

JAX reports each stage as a duration when it ends. The stages nest (an
inner jit is traced while the outer one is; a constant folded during
tracing compiles a small program), so the clock is the length of the union
of the reported intervals, not their sum: nested time counts once. It is
process-wide: with a rollout thread it also counts what that thread
prepared meanwhile, and time both threads spent preparing counts once.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class SpanUnion:
  """The total length of a growing union of [start, end] intervals."""

  def __init__(self):
    self.spans: list[list[float]] = []  # disjoint, in order
    self.total = 0.0

  def add(self, start: float, end: float) -> None:
    # Events arrive as they end, so an interval overlaps only the latest
    # ones (an outer stage ends after the stages nested in it); another
    # thread's event may end a little out of order, so later spans that
    # do not overlap are put back after it.
    later = []
    while self.spans and self.spans[-1][1] >= start:
      s, e = self.spans.pop()
      if s > end:
        later.append([s, e])
        continue
      self.total -= e - s
      start, end = min(start, s), max(end, e)
    self.spans.append([start, end])
    self.total += end - start
    self.spans.extend(reversed(later))


_lock = threading.Lock()
_prepare = SpanUnion()
_xla_compile_s = [0.0]
_listening = False


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
  if event not in (_TRACE_EVENT, _LOWER_EVENT, _COMPILE_EVENT):
    return
  end = time.perf_counter()
  with _lock:
    _prepare.add(end - duration_secs, end)
    if event == _COMPILE_EVENT:
      _xla_compile_s[0] += duration_secs


def _listen() -> None:
  global _listening
  with _lock:
    if _listening:
      return
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    _listening = True


class Reading(NamedTuple):
  """The clock's seconds so far (from the first reading on)."""

  prepare_s: float  # tracing, lowering or compiling (their union)
  xla_compile_s: float  # XLA compilation alone (or loading it from a persistent cache)


def read() -> Reading:
  _listen()
  with _lock:
    return Reading(_prepare.total, _xla_compile_s[0])
