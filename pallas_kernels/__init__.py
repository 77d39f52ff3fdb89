"""Pallas GPU kernels for fp8rl_jax (one kernel per module; see each module's design note)."""
