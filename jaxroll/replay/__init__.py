"""Rollout transforms over one replay state: filtering, allocation, selection, controls."""
