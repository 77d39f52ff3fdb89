"""Memory-mapped safetensors reading for every dtype a Qwen3 checkpoint can hold.

Why not ``safetensors.safe_open``: with numpy 2.x it cannot read FP8 tensors (F8_E4M3 /
F8_E5M2, the dtype of the public Qwen3-*-FP8 checkpoints) in the numpy or flax frameworks. The
format is a u64 header length, a JSON header and raw little-endian bytes, so a reader that maps
the file and returns zero-copy ``np.memmap`` views (ml_dtypes for bfloat16 and float8) is small,
streams tensor by tensor, and checks each header entry against the file. Writing goes through
``safetensors.numpy.save_file``, which handles all these dtypes, into a temporary file renamed
into place (``save_tensors``), with the mode a plain ``open()`` gives (save_file's is 0600).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from fp8rl_jax.checkpoint.atomic import atomic_path

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A malformed or incompatible checkpoint; the message names the file and tensor."""


class SafetensorsFile:
    """Header of one .safetensors file plus lazy, memory-mapped tensor access."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{self.path}: not a safetensors file (shorter than its header length)")
                (n,) = struct.unpack("<Q", raw)
                if n > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{self.path}: not a safetensors file (header length {n} is invalid)")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a safetensors file (header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: not a safetensors file (header is not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        for name, e in header.items():
            try:
                dtype = DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except KeyError as err:
                raise CheckpointError(f"{self.path}: tensor {name!r} has an unknown dtype or a malformed entry ({err})") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != nbytes or begin < 0 or self.data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} (shape {shape}, {e['dtype']}) has data offsets [{begin}, {end}] "
                    f"that do not match its size {nbytes} or lie past the end of the file ({size} bytes)"
                )
            self.entries[name] = (dtype, shape, begin)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor ``name`` (no copy until used)."""
        dtype, shape, begin = self.entries[name]
        if 0 in shape:
            return np.zeros(shape, dtype)
        count = int(np.prod(shape, dtype=np.int64))
        view = np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=(count,))
        return view.reshape(shape)


def save_tensors(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` as the safetensors file ``path``, atomically (a temporary file renamed)."""
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
