"""Gives host memory that the process has freed back to the OS (glibc's malloc_trim).

Two things in jaxroll free a lot of host memory in many pieces: loading a
checkpoint (raw tensors read, converted and dropped one at a time) and XLA
compilation (the compiler's scratch, on its own threads). glibc keeps such
memory in its heaps, still counted in the process's RSS, and a 0.5B model's
load plus its engine's first compiles leave about 200 MB of it. `release`
returns it; `release_after_compiles` does so after every XLA compilation
from then on (one listener per process). Both are no-ops without glibc.
"""

from __future__ import annotations

import ctypes

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_listening = False


def release() -> None:
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def release_after_compiles() -> None:
  global _listening
  if _listening:
    return
  import jax.monitoring

  def on_event(event: str, duration_secs: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
      release()

  jax.monitoring.register_event_duration_secs_listener(on_event)
  _listening = True
