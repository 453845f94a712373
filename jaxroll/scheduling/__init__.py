"""Long-tail rollout: length prediction and makespan simulation."""
