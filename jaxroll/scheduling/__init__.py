"""Long-tail rollout: admission orders, length prediction, partial rollout and makespan simulation."""
