"""R2PO on the default task: a residual rollout head diversifies training rollouts.

  jaxroll train configs/r2po.py

The default's counted walk and policy; training rollouts sample from the
policy's logits plus a residual head trained on rarity advantages
(jaxroll/behaviour/r2po.py), and the policy learns from them as if they
were its own. Held-out evaluation samples from the policy alone, bit for
bit. docs/benchmarks.md ("Rollout-policy methods") compares it with GRPO
and Nested-ReFT. Writes runs/r2po/.
"""

import dataclasses
import os

from jaxroll import config as config_lib


def get_config() -> config_lib.ExperimentConfig:
  cfg = config_lib.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))
  return config_lib.apply_overrides(dataclasses.replace(cfg, run_dir="runs/r2po"), ["behaviour.kind=r2po"])
