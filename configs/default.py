"""The embedded default: GRPO on the reasoning-shaped counted-walk task, from scratch.

  jaxroll train configs/default.py

The built-in counted walk (jaxroll/tasks/count_walk.py): responses are
chains of 2 to 766 tokens, log-normal in length (median about 100, a tail
past 4x the median), over a fixed pool of 64 problems that RL revisits 10
times, with a disjoint held-out set of 128. A 2-layer, 0.6M-parameter
policy is warm-started with 600 supervised steps on fresh worked
solutions that slip 2% of the time per value (held-out accuracy about
0.3: long walks nearly always slip), then trained with 40 GRPO steps of
16 prompts x 8 samples at up to 768 new tokens, where rollout is about
half of each step. Runs on CPU; about 5 minutes on 2 cores,
held-out accuracy to about 0.7 (docs/benchmarks.md, "The default
workload", has the measured numbers). Writes runs/default/.

Lean settings that modern recipes use: no KL term (so no reference
forward pass) and no per-step rollout/trainer mismatch pass (the sampler
runs in float32 here, the same numerics as the trainer).
"""

from jaxroll.config import ExperimentConfig, RLConfig, RolloutConfig, TaskConfig, WarmStartConfig


def get_config() -> ExperimentConfig:
  return ExperimentConfig(
      run_dir="runs/default", steps=40, eval_every=10, eval_samples=2,
      task=TaskConfig(name="count_walk", num_train=64, num_heldout=128, walk_median=48.0,
                      walk_sigma=0.8, warm_walk_median=12.0, warm_walk_sigma=1.2),
      warm_start=WarmStartConfig(steps=600, batch_size=48, learning_rate=5e-3, error_rate=0.02),
      rollout=RolloutConfig(max_new_tokens=768),
      rl=RLConfig(kl_coef=0.0, measure_mismatch=False))
