"""Nothing compiles in steady state at the loop level, whatever a filter, a
refill, over-provisioning or the rollout thread leave per step.

The engine's prefill runs at power-of-two (prompts, tokens) buckets, a
bounded set that partial rollout can reach late (resumed rows are
prefilled with their tokens so far, in chunks of a fixed row count, at
power-of-two token widths): those compilations are allowed, at most one
per bucket; any other after the first two steps fails.
"""

import logging
import math

import jax
import pytest

from jaxroll import train as train_mod
from jaxroll.loop.learner import Learner
from test_training import tiny

_compiles: list[tuple[int, str]] = []
_state = {"step": None}
ENGINE_BUCKETS = ("jit(prefill)", "jit(insert)")


class _CompileLog(logging.Handler):
  def emit(self, record):
    msg = record.getMessage()
    if msg.startswith("Finished XLA compilation of ") and _state["step"] is not None:
      _compiles.append((_state["step"], msg[len("Finished XLA compilation of "):].split(" in ")[0]))

CLASSES = {
    "plain": [],
    "filter + over-provisioning + refill": ["algorithm.techniques=dapo", "schedule.over_provision=1.25"],
    "allocation + LPT": ["algorithm.techniques=vigor", "schedule.order=lpt"],
    "replay + async": ["algorithm.techniques=popo", "pipeline.mode=async", "pipeline.max_lag=1",
                       "rl.off_policy=tis"],
    "prompt filter + interrupt + sibling probe": [
        "algorithm.techniques=greso", "pipeline.mode=interrupt", "pipeline.max_lag=1",
        "rl.off_policy=decoupled", "schedule.order=lpt", "schedule.predictor=sibling_probe"],
    "selection + sorted batches": ["algorithm.techniques=pods", "schedule.sorted_batches=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_no_compilation_after_the_first_steps(name, tmp_path, monkeypatch):
  learn = Learner.learn

  def counting_learn(self, step, *args, **kwargs):
    out = learn(self, step, *args, **kwargs)
    # Steps 1-2 compile (new shapes, the thread's first batches); count after.
    _state["step"] = step + 1 if step + 1 >= 2 else None
    return out

  monkeypatch.setattr(Learner, "learn", counting_learn)
  cfg = tiny(str(tmp_path / "run"), "steps=20", "eval_every=100", "checkpoint_every=5", *CLASSES[name])
  _compiles.clear()
  handler, jax_log = _CompileLog(), logging.getLogger("jax")
  jax_log.addHandler(handler)
  jax.config.update("jax_log_compiles", True)
  try:
    train_mod.train(cfg)
  finally:
    _state["step"] = None
    jax.config.update("jax_log_compiles", False)
    jax_log.removeHandler(handler)
  loop = [c for c in _compiles if c[1] not in ENGINE_BUCKETS]
  assert loop == [], f"compilations after warm-up (step, function): {loop}"
  # Prefill buckets: prompt counts 1..slots and token widths up to prompt + response, in powers of two.
  r = cfg.rollout
  slots, width = r.num_slots, r.max_prompt_len + r.max_new_tokens
  buckets = (int(math.log2(slots)) + 1) * (int(math.log2(width)) + 1)
  assert len([c for c in _compiles if c[1] == "jit(prefill)"]) <= buckets
