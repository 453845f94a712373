"""RL core: group-relative advantages and policy-gradient losses."""
