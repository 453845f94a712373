"""Sparrow's rule for the sparse KV budget: keep the lower tail of the
per-token agreement between the sparse sampler and the dense trainer near
a threshold.

The agreement of a token is exp(-|log p_dense - log p_sparse|); each update
reports its 5th percentile over the batch's loss tokens
(`mismatch_agreement_p5`, rl.measure_mismatch). After update s the
controller reads it: below rollout.kv_budget_p5 the budget rises by
rollout.kv_budget_step (up to 1, which is dense attention over the live
pages); above the threshold plus rollout.kv_budget_margin it falls by one
step (down to rollout.kv_budget, the sparsest the run allows); in between
it stays. It starts at rollout.kv_budget_start (0: at the floor). Starting
dense spares the first steps the rejections of a budget too low for the
policy: the budget then only falls while the agreement allows it. Version s + 1 is published
with the new budget (jaxroll.rollout.decode_params.DecodeParams.kv_budget),
so every batch decodes with the budget of the weights that sample it.

The budget is kept as a whole number of steps above the floor, so it is
exact in a checkpoint and a resumed run continues with the same values.
"""

from __future__ import annotations

import math


class KVBudgetController:
  def __init__(self, rollout_cfg):
    r = rollout_cfg
    self.enabled = r.kv_budget_p5 > 0
    self.floor, self.step, self.threshold, self.margin = (r.kv_budget, r.kv_budget_step,
                                                          r.kv_budget_p5, r.kv_budget_margin)
    self.top = math.ceil((1.0 - self.floor) / self.step - 1e-9) if self.enabled else 0
    start = r.kv_budget_start
    self.start_level = (min(self.top, math.ceil((start - self.floor) / self.step - 1e-9))
                        if self.enabled and start > 0 else 0)
    self.level = self.start_level
    self._by_version = {}  # version -> the budget it was published with

  @property
  def budget(self) -> float:
    return min(1.0, self.floor + self.level * self.step)

  def observe(self, stats) -> None:
    """Moves the budget by the step's agreement p5 (steps without loss
    tokens report none and leave it)."""
    if not self.enabled:
      return
    p5 = stats.get("mismatch_agreement_p5")
    if p5 is None or not math.isfinite(float(p5)):
      return
    p5 = float(p5)
    if p5 < self.threshold:
      self.level = min(self.top, self.level + 1)
    elif p5 > self.threshold + self.margin:
      self.level = max(0, self.level - 1)

  def publish_kw(self, version: int) -> dict:
    """engine.load's argument for the weights of `version` (none when off)."""
    if not self.enabled:
      return {}
    # Batches in flight come from the last max_lag versions; 64 keeps far more.
    self._by_version = {v: b for v, b in self._by_version.items() if v >= version - 64}
    self._by_version[version] = self.budget
    return {"kv_budget": self.budget}

  def metrics(self, version: int) -> dict:
    """The budget a batch sampled from `version` decoded with."""
    if not self.enabled or version not in self._by_version:
      return {}
    return {"kv_budget": self._by_version[version]}

  def state(self) -> int:
    return self.level

  def load_state(self, level) -> None:
    self.level = self.start_level if level is None else int(level)
