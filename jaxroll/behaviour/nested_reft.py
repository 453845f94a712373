"""Nested-ReFT (Heuillet et al., 2025): a subset of the policy's layers rolls out.

The behaviour model is the policy with some of its blocks skipped
(jaxroll.model.layer_subset): it shares every weight, costs fewer layers
per decoded token, and samples with its own exact log-probs, which the
engine records as the behaviour log-probs. The update scores the tokens
with the full policy and corrects with the configured objective
(rl.off_policy):

  sis        one weight per sequence, prod_t pi / mu, truncated at is_cap:
             unbiased for the on-policy gradient when is_cap = inf
             (tests/test_behaviour.py checks it by enumeration);
  tis        per-token weights truncated at is_cap: biased (the prefix's
             mismatch is ignored), far lower variance; the practical choice;
  decoupled  per-token weights, tokens above is_cap masked (AReaL);
  aipo       truncated-ratio policy gradient;
  ppo        the clipped ratio against the skipped model itself.

Correctness (survey Section 6.3): sis uncapped is unbiased for the
on-policy objective; every capped variant is unbiased for a modified one
and empirical beyond that. The paper's three bias-mitigation variants
are not spelled out in its abstract; these corrections are jaxroll's.

Which layers: `behaviour.layer_fraction` of them are kept (at least one);
`behaviour.keep_ends` keeps the first and, when two or more are kept, the
last; the others are drawn uniformly from the rest, anew for every policy
version (`layer_schedule=per_step`, the paper's dynamic skipping per
batch) or once (`fixed`). The draw is a function of (seed, version), so a
resumed run draws the same layers. Every subset of one size decodes with
one compiled engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxroll.behaviour import PolicyBehaviour
from jaxroll.model.layer_subset import subset_config, subset_graphdef, subset_state


def kept_layer_count(num_layers: int, fraction: float) -> int:
  return min(num_layers, max(1, int(round(fraction * num_layers))))


def draw_layers(num_layers: int, keep: int, keep_ends: bool, seed: int, version: int) -> tuple[int, ...]:
  """The increasing layer ids of one draw."""
  fixed = [0, num_layers - 1][:min(keep, 2)] if keep_ends else []
  fixed = sorted(set(fixed))
  rest = [i for i in range(num_layers) if i not in fixed]
  rng = np.random.default_rng([seed, version])
  drawn = rng.choice(rest, size=keep - len(fixed), replace=False).tolist() if keep > len(fixed) else []
  return tuple(sorted(fixed + [int(i) for i in drawn]))


class NestedBehaviour(PolicyBehaviour):
  kind = "nested"

  def __init__(self, cfg, model_cfg, graphdef):
    b = cfg.behaviour
    self.full_layers = model_cfg.num_layers
    self.keep = kept_layer_count(self.full_layers, b.layer_fraction)
    self.keep_ends, self.seed, self.per_step = b.keep_ends, cfg.seed, b.layer_schedule == "per_step"
    super().__init__(subset_config(model_cfg, self.keep), subset_graphdef(model_cfg, self.keep))

  def layers_at(self, version: int) -> tuple[int, ...]:
    return draw_layers(self.full_layers, self.keep, self.keep_ends, self.seed,
                       version if self.per_step else 0)

  def decode_args(self, params, version: int):
    return subset_state(params, self.layers_at(version)), {}

  def metrics(self, version: int) -> dict[str, Any]:
    return {"behaviour_layers": list(self.layers_at(version)),
            "behaviour_layer_fraction": self.keep / self.full_layers}
