"""Hugging Face checkpoint I/O (config.json, safetensors, tokenizer.json)."""

from fp8rl_jax.checkpoint.hf import (
    HFCheckpoint,
    TensorSpec,
    load_checkpoint,
    load_config,
    load_params,
    load_tokenizer,
    param_table,
    save_checkpoint,
)
from fp8rl_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile

__all__ = [
    "CheckpointError",
    "HFCheckpoint",
    "SafetensorsFile",
    "TensorSpec",
    "load_checkpoint",
    "load_config",
    "load_params",
    "load_tokenizer",
    "param_table",
    "save_checkpoint",
]
