"""cuBLASLt's block-scaled FP8 GEMM as a JAX op (an XLA FFI custom call), for NVIDIA GPUs.

The W8A8 GEMM of `pallas_kernels.fp8_gemm` (same arguments, same math, `fp8_gemm_reference` is its
reference): ``out [M, N] = A [M, K] @ B [N, K]^T`` with E4M3 operands, ``a_scale`` per token in 1x128
groups and ``b_scale_inv`` per 128x128 block, float32 accumulation, bf16 or f32 out. cuBLAS (>= 12.9)
does it with ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`` x ``BLK128x128_32F`` on Hopper: the scaling
recipe and library of torch's ``scaled_mm`` BlockWise1x128 x BlockWise128x128. A well-kept library
does this GEMM, so we call it rather than out-tune it; the Mosaic kernel stays the choice where it is
faster, and the dispatcher picks (``W8A8Policy.gemm`` / ``FP8RL_FP8_GEMM``; numbers in
docs/performance.md).

How: ``csrc/cublaslt_fp8_gemm.cc`` is a small XLA FFI handler that needs no CUDA header to build
(g++ and jaxlib's FFI headers): it declares the few cuBLASLt entry points it calls and dlopens
cuBLASLt at the first call, the copy jax's CUDA plugin uses (``nvidia/cu13/lib``). `load` compiles
it once into a cache folder (keyed by the source and jaxlib version; ``FP8RL_CACHE_DIR`` or
``~/.cache/fp8rl_jax``) and registers the handler for the CUDA platform. Layout (cuBLAS is
column-major, so it computes ``out^T = B . A^T``): the weight is cuBLAS's A operand (K-major,
transposed) with its 128x128 scales as stored, ``[N/128, K/128]`` with the K blocks padded to a
multiple of 4; the activations are its B operand (K-major) with the 1x128 scales transposed to
``[K/128, M]`` (`fp8_gemm_cublaslt_t` takes them so, as `quantize_activations_t` writes them); M
is padded to a multiple of 16 (zero rows) so every leading dimension is 16-byte aligned. The
wrapper does those (small) copies; the handler checks shapes and dtypes again and caches
cuBLASLt's algorithm choice per (device, M, N, K, out dtype) and thread. cuBLASLt's
workspace (``WORKSPACE_BYTES``) is a second result of the call, so XLA allocates it with the
other buffers and the call can sit in XLA's command buffers (CUDA graphs) with the kernels around
it; ``FP8RL_CUBLASLT_GRAPHS=0`` registers calls that always launch from the host instead.

`fp8_gemm_cublaslt_1d` is the same call with 1x128 scales on *both* operands (``VEC128_32F`` for
cuBLAS's A too, its scales ``[C/128, N]``): the weight gradient of FP8 training, where both operands
are grouped along the token axis. Whether a cuBLASLt runs that scaling is probed once
(`one_d_available`); the trainer falls back to BF16 tensor cores where it does not.

Algorithm choice: cuBLASLt's heuristic ranks the algorithms it has for a shape and takes the first; at decode sizes
that can leave most SMs idle (a few dozen 128 x 128 output tiles on 132 SMs). ``algo=(index, split_k)`` runs the
algorithm at ``index`` of the heuristic's list, its K splits pinned to ``split_k`` when > 0 (1: none; more:
float32 partials reduced by a second kernel), where cuBLASLt accepts that (else the heuristic's first: a table made
with another cuBLASLt falls back, it does not fail). `list_algos` shows the list; ``python -m experiments.bench cublaslt_tune``
times the candidates per (M bucket, N, K) by GPU time and writes the winners into a table the W8A8 policy reads
(`fp8rl_jax.quant.policy.cublaslt_algo`). No table is committed: on cuBLASLt 13.1 the heuristic lists one
algorithm for every Qwen3-8B decode shape.

Limits: E4M3 only; K a multiple of 128 (the 1D call pads its contraction), N a multiple of 16; out
bfloat16 or float32; CUDA only (anywhere else the calls raise and `available` says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels.fp8_gemm import BK, _check_operands

__all__ = ["DEFAULT_ALGO", "FFI_TARGET", "FFI_TARGET_EAGER", "SOURCE", "WORKSPACE_BYTES", "available", "build",
           "declare", "ffi_target", "find_cublaslt", "fp8_gemm_cublaslt", "fp8_gemm_cublaslt_1d", "fp8_gemm_cublaslt_t",
           "list_algos", "load", "one_d_available", "supports"]

SOURCE = Path(__file__).with_name("csrc") / "cublaslt_fp8_gemm.cc"
CHECK_SOURCE = SOURCE.with_name("cublaslt_check.cc")
FFI_TARGET = "fp8rl_cublaslt_fp8_block_gemm"  # XLA may capture it into its command buffers (CUDA graphs)
FFI_TARGET_EAGER = "fp8rl_cublaslt_fp8_block_gemm_eager"  # the same handler, always launched from the host
_HANDLERS = {FFI_TARGET: "Fp8rlCublasLtFp8BlockGemm", FFI_TARGET_EAGER: "Fp8rlCublasLtFp8BlockGemmEager"}
WORKSPACE_BYTES = 32 << 20  # cuBLASLt's workspace, a second result of every call (the size NVIDIA suggests for Hopper)
_M_ALIGN = 16
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
DEFAULT_ALGO = (0, 0)  # (index in cuBLASLt's heuristic list, K splits pinned or 0): the heuristic's first, as it is
_ALGO_COLUMNS = ("tile_id", "stages_id", "split_k", "reduction_scheme", "cluster_shape_id", "workspace_bytes",
                 "waves_count", "accepted")


def cache_dir() -> Path:
    return Path(os.environ.get("FP8RL_CACHE_DIR", Path.home() / ".cache" / "fp8rl_jax"))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("building the cuBLASLt FP8 GEMM needs a C++17 compiler (g++ or $CXX); none found")
    return cxx


def build(out_dir: Path | None = None) -> Path:
    """Compile the FFI handler (once: the library is named by a hash of the source, jaxlib's version
    and the compiler) and return the shared library's path."""
    cxx = _compiler()
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + jaxlib.__version__.encode() + cxx.encode()).hexdigest()[:16]
    out_dir = cache_dir() if out_dir is None else Path(out_dir)
    lib = out_dir / f"libfp8rl_cublaslt_{tag}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-isystem", jax.ffi.include_dir(), str(SOURCE),
               "-o", str(tmp_lib), "-ldl"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent builders leave one complete library
    return lib


def _site_dirs() -> list[Path]:
    dirs = [Path(p) for p in sys.path if p]
    try:
        dirs += [Path(p) for p in site.getsitepackages()]
    except AttributeError:  # some virtualenvs
        pass
    return dirs


def find_cublaslt() -> Path | None:
    """The libcublasLt of the pip NVIDIA packages jax's CUDA plugin loads (CUDA 13, then 12), if any."""
    for d in _site_dirs():
        for rel in ("nvidia/cu13/lib/libcublasLt.so.13", "nvidia/cublas/lib/libcublasLt.so.13",
                    "nvidia/cublas/lib/libcublasLt.so.12"):
            if (d / rel).exists():
                return d / rel
    return None


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The C entry points' signatures on a loaded handler library (returned)."""
    lib.fp8rl_cublaslt_set_library.argtypes = [ctypes.c_char_p]
    lib.fp8rl_cublaslt_load.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.fp8rl_cublaslt_load.restype = ctypes.c_size_t
    lib.fp8rl_cublaslt_algos.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                                         ctypes.c_char_p, ctypes.c_size_t]
    lib.fp8rl_cublaslt_algos.restype = ctypes.c_int
    return lib


@functools.cache
def load() -> ctypes.CDLL:
    """Build (once), load and register the handler for the CUDA platform; cuBLASLt itself is
    loaded by `available` or at the first call."""
    lib = declare(ctypes.CDLL(str(build())))
    path = find_cublaslt()
    lib.fp8rl_cublaslt_set_library(str(path).encode() if path else b"")
    for target, handler in _HANDLERS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, handler)), platform="CUDA")
    return lib


def ffi_target() -> str:
    """The registration calls use: the graph-capturable one unless ``FP8RL_CUBLASLT_GRAPHS=0``."""
    return FFI_TARGET_EAGER if os.environ.get("FP8RL_CUBLASLT_GRAPHS", "1") == "0" else FFI_TARGET


def cublaslt_version() -> tuple[int, str]:
    """(cuBLASLt version, "") once it loads, else (0, why not)."""
    msg = ctypes.create_string_buffer(1024)
    version = load().fp8rl_cublaslt_load(msg, len(msg))
    return int(version), msg.value.decode()


@functools.cache
def available() -> tuple[bool, str]:
    """Whether `fp8_gemm_cublaslt` can run here, and why not: a CUDA GPU backend, the handler built,
    and a cuBLASLt with block-scaled FP8 (>= 12.9)."""
    if jax.default_backend() != "gpu" or "rocm" in str(getattr(jax.devices()[0].client, "platform_version", "")).lower():
        return False, f"needs a CUDA GPU backend (jax.default_backend() is {jax.default_backend()!r})"
    try:
        version, why = cublaslt_version()
    except Exception as e:  # no compiler, no cuBLASLt...
        return False, f"{type(e).__name__}: {e}"
    return (version > 0), why


def list_algos(m: int, n: int, k: int, out_dtype=jnp.bfloat16, split_k: int = 0, *, lib: ctypes.CDLL | None = None,
               device: int = 0) -> list[dict]:
    """The algorithms cuBLASLt's heuristic offers for the ``[M, K] x [N, K]^T`` block-scaled GEMM (M padded to 16 as
    the call pads it), in its order: per algorithm its ``index`` (what ``algo=(index, split_k)`` runs), cuBLASLt's
    tile, stages, K splits, reduction scheme and cluster shape ids, workspace bytes, waves count, and ``accepted``:
    whether its K splits can be pinned to ``split_k`` (when > 0; the split and workspace are then the pinned ones).
    ``lib``: a loaded handler library (default: `load`'s)."""
    lib = load() if lib is None else lib
    mp = -(-m // _M_ALIGN) * _M_ALIGN
    rows = (ctypes.c_int64 * (8 * 32))()
    msg = ctypes.create_string_buffer(1024)
    out_bf16 = int(jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16))
    found = lib.fp8rl_cublaslt_algos(device, mp, n, k, out_bf16, split_k, WORKSPACE_BYTES, rows, 32, msg, len(msg))
    if found < 0:
        raise RuntimeError(f"cuBLASLt's algorithms for M={m} N={n} K={k}: {msg.value.decode()}")
    out = []
    for i in range(min(found, 32)):
        row = dict(zip(_ALGO_COLUMNS, rows[8 * i: 8 * i + 8]))
        row["waves_count"] /= 1000.0
        row["accepted"] = bool(row["accepted"])
        out.append({"index": i, **row})
    return out


def _algo(algo) -> tuple[int, int]:
    if not (isinstance(algo, tuple) and len(algo) == 2 and all(isinstance(x, int) and x >= 0 for x in algo)):
        raise ValueError(f"algo must be (index >= 0, split_k >= 0), got {algo!r}")
    return algo


def supports(n: int, k: int, out_dtype=jnp.bfloat16) -> bool:
    """Whether `fp8_gemm_cublaslt` takes this weight shape and output dtype (any M)."""
    return k % BK == 0 and n % _M_ALIGN == 0 and jnp.dtype(out_dtype) in _OUT_DTYPES


def fp8_gemm_cublaslt(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale_inv: jax.Array, *,
                      out_dtype=jnp.bfloat16, algo: tuple[int, int] = DEFAULT_ALGO) -> jax.Array:
    """Block-scaled FP8 ``A @ B^T`` by cuBLASLt (module note): the arguments of
    `pallas_kernels.fp8_gemm.fp8_gemm`; ``K % 128 == 0``, ``N % 16 == 0``, out bfloat16 or float32. ``algo``:
    (index in cuBLASLt's heuristic list, K splits pinned or 0), see the module note."""
    out_dtype = _check(a, a_scale, b, b_scale_inv, out_dtype)
    return _call(a, a_scale, b, b_scale_inv, out_dtype, target=ffi_target(), algo=_algo(algo))


def fp8_gemm_cublaslt_t(a: jax.Array, a_scale_t: jax.Array, b: jax.Array, b_scale_inv: jax.Array, *,
                        out_dtype=jnp.bfloat16, algo: tuple[int, int] = DEFAULT_ALGO) -> jax.Array:
    """`fp8_gemm_cublaslt` with A's scales given transposed, ``a_scale_t [K/128, M]`` (the order cuBLASLt
    reads; `fp8rl_jax.quant.quantize_activations_t` writes them so): no transpose before the call."""
    if a.ndim != 2 or a_scale_t.ndim != 2 or tuple(a_scale_t.shape) != (-(-a.shape[1] // BK), a.shape[0]):
        raise ValueError(f"a_scale_t must be [K/128, M] for a {tuple(a.shape)}, got shape {tuple(a_scale_t.shape)}")
    out_dtype = _check(a, a_scale_t.T, b, b_scale_inv, out_dtype)
    return _call_t(a, a_scale_t, b, b_scale_inv, out_dtype, target=ffi_target(), algo=_algo(algo))


def _check(a, a_scale, b, b_scale_inv, out_dtype):
    out_dtype = _check_operands(a, a_scale, b, b_scale_inv, out_dtype)
    k = a.shape[1]
    n = b.shape[0]
    if k % BK:
        raise ValueError(f"fp8_gemm_cublaslt needs K % {BK} == 0, got K={k}; use pallas_kernels.fp8_gemm.fp8_gemm")
    if n % _M_ALIGN:
        raise ValueError(f"fp8_gemm_cublaslt needs N % {_M_ALIGN} == 0, got N={n}; use pallas_kernels.fp8_gemm.fp8_gemm")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_gemm_cublaslt writes bfloat16 or float32, got out_dtype={out_dtype}")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"fp8_gemm_cublaslt cannot run here: {why}")
    return out_dtype


@functools.partial(jax.jit, static_argnames=("out_dtype", "target", "algo"))
def _call(a, a_scale, b, b_scale_inv, out_dtype, target=FFI_TARGET, algo=DEFAULT_ALGO):
    return _call_t(a, a_scale.T, b, b_scale_inv, out_dtype, target, algo)


@functools.partial(jax.jit, static_argnames=("out_dtype", "target", "algo"))
def _call_t(a, a_scale_t, b, b_scale_inv, out_dtype, target=FFI_TARGET, algo=DEFAULT_ALGO):
    kb = a.shape[1] // BK
    kb4 = -(-kb // 4) * 4  # the 128x128 scales' leading dimension: K blocks rounded up to 4
    bs = b_scale_inv if kb4 == kb else jnp.pad(b_scale_inv, ((0, 0), (0, kb4 - kb)))
    return _ffi(a, a_scale_t, b, bs, out_dtype, target, b_blocks=1, algo=algo)


def _ffi(a, as_t, b, bs, out_dtype, target, b_blocks: int, algo: tuple[int, int] = DEFAULT_ALGO):
    """The custom call with A's rows zero-padded to a multiple of 16 (``as_t``: its scales [K/128, M],
    M-contiguous as cuBLAS reads them) and the padding rows sliced off the output."""
    m, n = a.shape[0], b.shape[0]
    mp = -(-m // _M_ALIGN) * _M_ALIGN
    if mp != m:
        a = jnp.pad(a, ((0, mp - m), (0, 0)))
        as_t = jnp.pad(as_t, ((0, 0), (0, mp - m)))
    out, _ = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct((mp, n), out_dtype),
                                       jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)))(
        a, as_t, b, bs, b_blocks=np.int32(b_blocks), algo=np.int32(algo[0]), split_k=np.int32(algo[1]))
    return out[:m] if mp != m else out


def fp8_gemm_cublaslt_1d(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, *,
                         out_dtype=jnp.float32) -> jax.Array:
    """``A [M, C] @ B [N, C]^T`` with 1x128 scales along the contraction on *both* operands
    (``a_scale [M, ceil(C/128)]``, ``b_scale [N, ceil(C/128)]``): the weight gradient of FP8 training
    (tokens as the contraction). C is zero-padded to a multiple of 128 (exact); ``N % 16 == 0``."""
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 2 or jnp.dtype(x.dtype) != jnp.dtype(jnp.float8_e4m3fn):
            raise ValueError(f"{name} must be a float8_e4m3fn matrix, got {x.dtype}{tuple(x.shape)}")
    (m, c), (n, c_b) = a.shape, b.shape
    cb = -(-c // BK)
    if c != c_b or tuple(a_scale.shape) != (m, cb) or tuple(b_scale.shape) != (n, cb):
        raise ValueError(f"fp8_gemm_cublaslt_1d: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, b {tuple(b.shape)}, "
                         f"b_scale {tuple(b_scale.shape)} do not form [M, C], [M, C/128], [N, C], [N, C/128]")
    if n % _M_ALIGN:
        raise ValueError(f"fp8_gemm_cublaslt_1d needs N % {_M_ALIGN} == 0, got N={n}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_gemm_cublaslt_1d writes bfloat16 or float32, got out_dtype={out_dtype}")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"fp8_gemm_cublaslt_1d cannot run here: {why}")
    return _call_1d(a, a_scale.astype(jnp.float32), b, b_scale.astype(jnp.float32), out_dtype, target=ffi_target())


@functools.partial(jax.jit, static_argnames=("out_dtype", "target"))
def _call_1d(a, a_scale, b, b_scale, out_dtype, target=FFI_TARGET):
    c = a.shape[1]
    cp = -(-c // BK) * BK
    if cp != c:  # zero codes in the padding: their products are exactly 0 whatever the group's scale
        a = jnp.pad(a, ((0, 0), (0, cp - c)))
        b = jnp.pad(b, ((0, 0), (0, cp - c)))
    return _ffi(a, a_scale.T, b, b_scale.T, out_dtype, target, b_blocks=0)  # B's scales N-contiguous too


@functools.cache
def one_d_available() -> bool:
    """Whether this GPU's cuBLASLt runs the 1x128 x 1x128 scaling (`fp8_gemm_cublaslt_1d`): probed once
    with a 128 x 128 x 128 product, eagerly."""
    if not available()[0]:
        return False
    try:
        with jax.ensure_compile_time_eval():  # concrete even when asked while tracing
            z = jnp.zeros((128, 128), jnp.float8_e4m3fn)
            s = jnp.ones((128, 1), jnp.float32)
            jax.block_until_ready(_call_1d(z, s, z, s, jnp.dtype(jnp.float32), target=ffi_target()))
        return True
    except Exception:  # cuBLASLt has no algorithm for it: the handler's error
        return False
