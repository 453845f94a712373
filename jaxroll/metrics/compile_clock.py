"""Seconds the XLA backend has spent compiling in this process.

A step's phases are timed by the wall clock, so a step that meets a new
shape also pays its compilation. Short benchmark runs meet many, and
their medians would compare compilers, not updates: timing.jsonl records
the compile seconds inside each update (`update_compile_s`) from this
clock. It is process-wide: with a rollout thread it also counts what that
thread compiled meanwhile.
"""

from __future__ import annotations

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_total = [0.0]
_listening = False


def compile_seconds() -> float:
  """Backend compile seconds so far (from the first call on)."""
  global _listening
  if not _listening:
    import jax.monitoring

    def on_event(event: str, duration_secs: float, **kwargs) -> None:
      if event == _COMPILE_EVENT:
        _total[0] += duration_secs

    jax.monitoring.register_event_duration_secs_listener(on_event)
    _listening = True
  return _total[0]
