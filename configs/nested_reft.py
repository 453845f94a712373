"""Nested-ReFT on the default task: 2 of a 4-layer policy's layers roll out.

  jaxroll train configs/nested_reft.py

The default's counted walk with a 4-layer policy (the default's 2 layers
leave no layer to skip but one); training rollouts are decoded by its
first and last layers (jaxroll/behaviour/nested_reft.py), which record
their own log-probs, and the update corrects with per-token truncated
importance weights against the full policy (rl.off_policy=tis). Held-out
evaluation samples from the full policy. docs/benchmarks.md ("Rollout-policy
methods") compares it with GRPO and R2PO. Writes runs/nested_reft/.
"""

import dataclasses
import os

from jaxroll import config as config_lib


def get_config() -> config_lib.ExperimentConfig:
  cfg = config_lib.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py"))
  return config_lib.apply_overrides(dataclasses.replace(cfg, run_dir="runs/nested_reft"), [
      # The deeper policy's warm start diverges at the default's rate 5e-3.
      "policy.num_layers=4", "warm_start.learning_rate=2e-3",
      "behaviour.kind=nested", "behaviour.layer_fraction=0.5",
      "rl.off_policy=tis"])
