"""A one-line progress display: step, reward, accuracy, tokens/s, ETA."""

from __future__ import annotations

import sys
import time


class Progress:
  def __init__(self, total: int, start: int = 0, enabled: bool = True, stream=sys.stderr):
    self.total, self.start, self.enabled, self.stream = total, start, enabled, stream
    self.t0 = time.monotonic()
    self.last_acc = None

  def update(self, step: int, reward: float | None, tokens_per_s: float,
             heldout_accuracy: float | None = None) -> None:
    if heldout_accuracy is not None:
      self.last_acc = heldout_accuracy
    if not self.enabled:
      return
    done = step - self.start
    elapsed = time.monotonic() - self.t0
    eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
    acc = "-" if self.last_acc is None else f"{self.last_acc:.3f}"
    eta_text = "?" if eta != eta else f"{int(eta) // 60}:{int(eta) % 60:02d}"
    rew = "-" if reward is None else f"{reward:.3f}"
    self.stream.write(f"\rstep {step}/{self.total} | reward {rew} | held-out acc {acc} | "
                      f"{tokens_per_s:,.0f} tok/s | ETA {eta_text}   ")
    self.stream.flush()

  def close(self) -> None:
    if self.enabled:
      self.stream.write("\n")
      self.stream.flush()
