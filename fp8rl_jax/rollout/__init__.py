"""Rollout: the generator interface and the built-in JAX engine (paged KV, continuous batching)."""
