"""Pallas GPU kernels for block-scaled FP8 LLM work on Hopper: quantization, GEMMs, attention.

One kernel family per module, each with its design note, config dataclasses, validating wrappers and
pure-jnp ``*_reference`` twins. The package imports only jax, numpy and itself; kernels take and return
arrays. Tuning tables the kernels read (``*_tuning.json``) ship beside them.
"""
