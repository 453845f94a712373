"""Which policy samples the training rollouts (behaviour.kind).

  policy  the policy itself (on-policy; every other jaxroll technique)
  nested  Nested-ReFT: a subset of the policy's layers (jaxroll.behaviour.nested_reft)
  r2po    the policy plus a residual rollout head (jaxroll.behaviour.r2po)

A behaviour says what the sampler's engine decodes (`model_cfg`,
`graphdef`), what it is handed each version (`decode_args`), what it
learns beside the policy (`learn`, before the policy's update, on the
weights that sampled), and what of it a checkpoint keeps (`state`).
Evaluation always samples from the policy alone.
"""

from __future__ import annotations

from typing import Any

from jaxroll.config import ConfigError


class PolicyBehaviour:
  """The policy samples its own rollouts: exact on-policy data."""

  kind = "policy"

  def __init__(self, model_cfg, graphdef):
    self.model_cfg, self.graphdef = model_cfg, graphdef

  def decode_args(self, params, version: int) -> tuple[Any, dict]:
    """(the state the engine loads, engine.load's keyword arguments)."""
    return params, {}

  def learn(self, params, ub, sample) -> dict[str, float]:
    return {}

  def metrics(self, version: int) -> dict[str, Any]:
    return {}

  def state(self):
    return None

  def load_state(self, state) -> None:
    pass


def make_behaviour(cfg, model_cfg, graphdef, placement=None):
  """The behaviour `cfg.behaviour.kind` names, for a policy of `model_cfg`."""
  kind = cfg.behaviour.kind
  if kind == "policy":
    return PolicyBehaviour(model_cfg, graphdef)
  if kind == "nested":
    from jaxroll.behaviour.nested_reft import NestedBehaviour

    return NestedBehaviour(cfg, model_cfg, graphdef)
  if kind == "r2po":
    import jax

    if jax.process_count() > 1:
      raise ConfigError("behaviour.kind=r2po runs in one process only (its rollout head is updated "
                        "on the host's rows); run it without jax.distributed")
    from jaxroll.behaviour.r2po import R2POBehaviour

    return R2POBehaviour(cfg, model_cfg, graphdef, placement)
  raise ConfigError(f"unknown behaviour.kind {kind!r}")
