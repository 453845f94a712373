"""Metrics: per-step logs, progress, cost accounting and the run report."""
