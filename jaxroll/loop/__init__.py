"""The RL loop: one sampler (schedule and transforms together) and the drivers that run it
synchronously or from the rollout thread."""
