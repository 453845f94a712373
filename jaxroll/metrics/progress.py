"""One-line progress displays: RL steps, the warm start, evaluations."""

from __future__ import annotations

import contextlib
import sys
import time


class Progress:
  """A line rewritten in place: `label done/total | fields | ETA`.

  Args:
    total: steps in all; start: the step counting starts from (a resume).
    enabled: False makes it silent; label: what a step is ("step", "warm start").
  """

  def __init__(self, total: int, start: int = 0, enabled: bool = True, stream=sys.stderr,
               label: str = "step"):
    self.total, self.start, self.enabled, self.stream = total, start, enabled, stream
    self.label = label
    self.t0 = time.monotonic()
    self._shown = 0.0
    self.last_acc = None
    self.last_loss = None

  def update(self, step: int, reward: float | None = None, tokens_per_s: float | None = None,
             heldout_accuracy: float | None = None) -> None:
    if heldout_accuracy is not None:
      self.last_acc = heldout_accuracy
    now = time.monotonic()
    # At most a few writes a second (a warm start takes hundreds of fast steps).
    if not self.enabled or (now - self._shown < 0.25 and step < self.total):
      return
    self._shown = now
    done = step - self.start
    eta = (now - self.t0) / done * (self.total - step) if done > 0 else float("nan")
    parts = [f"{self.label} {step}/{self.total}"]
    if self.last_loss is not None:
      parts.append(f"loss {self.last_loss:.3f}")
    if reward is not None:
      parts.append(f"reward {reward:.3f}")
    if self.last_acc is not None or reward is not None:
      parts.append("held-out acc " + ("-" if self.last_acc is None else f"{self.last_acc:.3f}"))
    if tokens_per_s is not None:
      parts.append(f"{tokens_per_s:,.0f} tok/s")
    parts.append("ETA " + ("?" if eta != eta else f"{int(eta) // 60}:{int(eta) % 60:02d}"))
    self.stream.write("\r" + " | ".join(parts) + "   ")
    self.stream.flush()

  def close(self) -> None:
    if self.enabled:
      self.stream.write("\n")
      self.stream.flush()

  @staticmethod
  @contextlib.contextmanager
  def note(text: str, enabled: bool = True, stream=sys.stderr):
    """Shows `text` while the block runs, then how long it took."""
    t0 = time.monotonic()
    if enabled:
      stream.write(f"\r{text} ...")
      stream.flush()
    yield
    if enabled:
      stream.write(f"\r{text}: {time.monotonic() - t0:.1f} s\n")
      stream.flush()
