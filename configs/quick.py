"""A quick modular-walk run for tests and fast iteration (CPU, about 50 s on 2 cores).

  jaxroll train configs/quick.py

The default run's task and model (configs/default.py), shortened: 300
warm-start steps, 40 GRPO steps of 16 prompts x 8 samples, held-out
accuracy on 64 prompts every 10 steps. Enough to see every metric, the
report and the C(q) curves move (held-out accuracy about 0.45 -> 0.90, seed 0);
not a measurement. Writes runs/quick/.
"""

from jaxroll.config import ExperimentConfig, TaskConfig, WarmStartConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(run_dir="runs/quick", steps=40, eval_every=10,
                          task=TaskConfig(num_heldout=64), warm_start=WarmStartConfig(steps=300))
