"""A quick modular-walk run for tests and fast iteration (CPU, about 50 s on 2 cores).

  jaxroll train configs/quick.py

The built-in modular walk (short responses of 1-19 values, a fresh
problem almost every time; jaxroll/tasks/mod_walk.py) with the 2-layer,
0.5M-parameter policy: 300 warm-start steps on worked solutions that slip
10% of the time, 40 GRPO steps of 16 prompts x 8 samples, held-out
accuracy on 64 prompts every 10 steps. Enough to see every metric, the
report and the C(q) curves move (held-out accuracy about 0.45 -> 0.90,
seed 0); not a measurement, and not the reasoning-shaped workload (that is
configs/default.py). Writes runs/quick/.
"""

from jaxroll.config import ExperimentConfig, TaskConfig, WarmStartConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(run_dir="runs/quick", steps=40, eval_every=10,
                          task=TaskConfig(num_heldout=64), warm_start=WarmStartConfig(steps=300))
