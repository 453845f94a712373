"""The embedded default: GRPO on the built-in modular-walk task, from scratch.

  jaxroll train configs/default.py

A 2-layer, 0.5M-parameter policy is warm-started with 600 supervised steps
on worked solutions that slip 10% of the time, then trained with 150 GRPO
steps (16 prompts x 8 samples). Runs on CPU; about 2 minutes on 2 cores,
held-out accuracy from about 0.36 to 0.90 (docs/benchmarks.md has the
measured numbers). Writes runs/default/.
"""

from jaxroll.config import ExperimentConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(run_dir="runs/default")
