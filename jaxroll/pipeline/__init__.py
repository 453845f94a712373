"""Asynchronous rollout: a sampler thread ahead of the trainer by at most k versions."""
