"""What the kernel files share at run time: the interpret-mode rule, Triton's FP8 wgmma switch, the
device kind and M bucket that key the measured tuning tables, the tables' reader, and an offline
sm_90 Triton lowering for codegen checks on any host."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings
from pathlib import Path
from unittest import mock

import jax

try:  # private JAX API (jax 0.11): the Triton lowering that the two Triton hooks below patch
    from jax._src.lib.mlir import ir as _ir
    from jax._src.pallas.triton import gpu_info as _gpu_info
    from jax._src.pallas.triton import lowering as _triton_lowering
    from jax._src.pallas.triton import pallas_call_registration as _triton_registration
except ImportError:  # a JAX without it: no wgmma switch, no offline lowering
    _ir = _gpu_info = _triton_lowering = _triton_registration = None

_FP8_WGMMA: bool | None = None


def enable_fp8_wgmma() -> bool:
    """Lets Triton run the Pallas kernels' FP8 x FP8 -> float32 dots on Hopper's wgmma; idempotent.

    Triton's Hopper matmul pass takes wgmma (MMAv3) for FP8 operands with a float32 result only
    if the dot allows imprecise accumulation (``maxNumImpreciseAcc`` >= 32); otherwise it falls
    back to Ampere-style ``mma.sync`` on operands converted to float16 in registers (ALU work
    per loaded byte, no asynchronous MMA). Pallas' Triton lowering (jax 0.11) builds every
    ``tt.dot`` without the attribute, so without this every FP8 dot of the Triton kernels takes
    the fallback (see ``experiments/inspect_triton_codegen.py --kernel grouped_gemm``).
    This wraps the lowering's ``tt.dot`` builder: a dot of FP8 operands gets
    ``maxNumImpreciseAcc = K``, its own contraction length. The kernels contract one 128-wide
    scale block per dot into a fresh accumulator and add the scaled result in float32 outside
    the MMA, so the tensor core's reduced-precision accumulation spans 128 products, the
    promotion interval of DeepSeek-V3 / cuBLAS block FP8 (the GPU tests hold it to the float64
    reference). Other dots are untouched. ``FP8RL_TRITON_FP8_MMAV2=1`` keeps the fallback (for
    timing both); returns whether the wrapper is installed (False also when this JAX's lowering
    does not have the expected shape)."""
    global _FP8_WGMMA
    if _FP8_WGMMA is not None:
        return _FP8_WGMMA
    _FP8_WGMMA = False
    if os.environ.get("FP8RL_TRITON_FP8_MMAV2", "") not in ("", "0") or _triton_lowering is None:
        return False
    try:
        dialect = _triton_lowering.tt_dialect
        original = dialect.dot
        if "max_num_imprecise_acc" not in inspect.signature(original).parameters:
            return False
    except (AttributeError, TypeError, ValueError):
        return False

    def dot(a, b, c, *, max_num_imprecise_acc=None, **kwargs):
        if max_num_imprecise_acc is None:
            a_type = _ir.RankedTensorType(a.type)
            if str(a_type.element_type) in ("f8E4M3FN", "f8E5M2"):
                max_num_imprecise_acc = a_type.shape[-1]
        return original(a, b, c, max_num_imprecise_acc=max_num_imprecise_acc, **kwargs)

    dot.__wrapped__ = original
    dialect.dot = dot
    _FP8_WGMMA = True
    return True


@contextlib.contextmanager
def triton_ir_for_sm90(native_kernels: bool = False):
    """Within: Pallas Triton lowerings (``jit(...).trace(...).lower(lowering_platforms=("cuda",))`` on
    any host) target Hopper (sm_90, the H200's GPU info), and the Triton IR (TTIR text) of each
    lowered kernel is appended to the yielded list. ``native_kernels``: ``jax.default_backend()`` says
    "gpu" too, so the kernels' ``interpret=None`` (`resolve_interpret`) and the policies' backend
    choices trace a whole program as on the GPU (lower it only). Private JAX API (jax 0.11): offline
    codegen inspection and tests."""
    if _triton_lowering is None:
        raise RuntimeError("this JAX has no Pallas Triton lowering to inspect")
    info = _gpu_info.get_gpu_info_from_version(_gpu_info.GpuVersion.H200)
    captured: list[str] = []
    original = _triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    with mock.patch.object(_triton_registration.gpu_info_lib, "get_gpu_info", lambda *a, **k: info), \
            mock.patch.object(_triton_registration.lowering, "lower_jaxpr_to_triton_module", capture), \
            mock.patch.object(jax, "default_backend", (lambda: "gpu") if native_kernels else jax.default_backend):
        yield captured


def resolve_interpret(interpret: bool | None) -> bool:
    """None: native on a GPU backend, interpret mode elsewhere; a bool forces it."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None or a bool, got {interpret!r}")
    return interpret


def m_bucket(m: int) -> int:
    """The M key of the measured tables (GEMM configs, GEMM backends): the next power of two, at least 64."""
    return max(64, 1 << (max(m, 1) - 1).bit_length())


def device_kind() -> str:
    """The key of a tuning-table entry: the GPU's device kind, or "cpu" off the GPU."""
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "cpu"


_WARNED: set[str] = set()


def tuning_entries(path: Path, kind: str, required: bool = True) -> list[dict]:
    """The entries of a kernel's measured tuning table (written by its benchmark suite) made on
    device kind ``kind``. A table that is missing or unreadable gives none, with a warning naming
    the file (once per file): the kernels then run their untuned defaults. ``required=False``: a
    table the package does not ship (measured per site) may be absent without a warning."""
    if not required and not Path(path).exists():
        return []
    try:
        entries = json.loads(Path(path).read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError) as e:
        if str(path) not in _WARNED:
            _WARNED.add(str(path))
            warnings.warn(f"tuning table {path} is missing or unreadable ({type(e).__name__}: {e}); "
                          "the kernels use their untuned defaults", RuntimeWarning, stacklevel=2)
        return []
    return [e for e in entries if e.get("device_kind") == kind]
