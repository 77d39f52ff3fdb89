"""fp8rl_jax: a JAX-native FP8 stack for reinforcement learning of LLMs on Hopper GPUs."""

__version__ = "0.1.0"
