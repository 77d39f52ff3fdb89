"""cuBLASLt block-scaled FP8 GEMM (``fp8rl_jax.quant.cublaslt``): the FFI handler builds, loads and
explains what it lacks on any machine; its cuBLASLt declarations match cublasLt.h wherever that header
is installed; on the CPU it gives the reference product against a host-memory model of cuBLASLt
(tests/fake_cublaslt.cc); the dispatchers route to it; on the GPU it matches the jnp reference."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.models.policy import Kernels, Proj, Site
from fp8rl_jax.quant import cublaslt, quantize_activations, quantize_activations_t, quantize_weight_blockwise
from fp8rl_jax.quant.policy import GemmBackend, W8A8Policy
from pallas_kernels.fp8_gemm import fp8_gemm_reference

ON_GPU = jax.default_backend() == "gpu"


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # one program per shape, not an eager op each
def _operands(m, n, k, seed):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.exp2(jax.random.randint(kx, (m, 1), -4, 5).astype(jnp.float32))
    w = jax.random.normal(kw, (n, k), jnp.float32) * jnp.exp2(jax.random.randint(kw, (n, 1), -6, 0).astype(jnp.float32))
    qa, sa = quantize_activations(x)
    qw = quantize_weight_blockwise(w)
    return qa, sa, qw.q, qw.scale_inv


@pytest.fixture(scope="module")
def handler_build(tmp_path_factory) -> Path:
    """The folder of this module's one build of the handler (a C++ compile of seconds)."""
    folder = tmp_path_factory.mktemp("cublaslt_build")
    cublaslt.build(folder)
    return folder


def _load_copy(build_dir: Path, tmp_path: Path, library: str) -> ctypes.CDLL:
    """A private copy of the handler library built in ``build_dir`` (a file of its own in ``tmp_path``:
    own globals), pointed at ``library``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    copy = tmp_path / "libfp8rl_cublaslt_copy.so"
    shutil.copyfile(cublaslt.build(build_dir), copy)
    lib = cublaslt.declare(ctypes.CDLL(str(copy)))
    lib.fp8rl_cublaslt_set_library(library.encode())
    return lib


def test_handler_builds_once_and_reports_a_missing_cublaslt(handler_build, tmp_path):
    built = sorted(handler_build.glob("*.so"))
    assert len(built) == 1  # the fixture's build
    lib_path = cublaslt.build(handler_build)
    assert lib_path == built[0] and lib_path.exists()  # cached by source hash: built once
    assert sorted(handler_build.glob("*.so")) == built
    lib = _load_copy(handler_build, tmp_path, "/nonexistent/libcublasLt.so.13")
    assert hasattr(lib, "Fp8rlCublasLtFp8BlockGemm")
    msg = ctypes.create_string_buffer(2048)
    version = lib.fp8rl_cublaslt_load(msg, len(msg))
    if version == 0:  # no cuBLASLt on the loader path either (CI): the message names what was tried
        assert "could not load cuBLASLt" in msg.value.decode() and "/nonexistent/libcublasLt.so.13" in msg.value.decode()
    else:  # a machine with cuBLASLt installed falls back to its soname
        assert version >= 120900 and msg.value == b""


def test_resolves_every_entry_point_of_an_installed_cublaslt(handler_build, tmp_path):
    """The dlsym of every entry point the handler calls, against the pip NVIDIA package's library
    where one is installed (the GPU image; jax[cuda13] installs it)."""
    found = cublaslt.find_cublaslt()
    if found is None:
        pytest.skip("no pip nvidia-cublas here (CPU-only jax); runs on the device")
    msg = ctypes.create_string_buffer(2048)
    version = _load_copy(handler_build, tmp_path, str(found)).fp8rl_cublaslt_load(msg, len(msg))
    assert version >= 120900, msg.value.decode()


def _cublas_include_dirs() -> list[str] | None:
    for root in [Path("/usr/local/cuda/include")] + [d / "nvidia" / sub / "include" for d in cublaslt._site_dirs()
                                                      for sub in ("cu13", "cublas")]:
        if (root / "cublasLt.h").exists():
            dirs = [root] + [root / "cccl"] * (root / "cccl").is_dir()
            cuda_rt = root.parent.parent / "cuda_runtime" / "include"  # CUDA 12 wheels split the headers
            return [str(d) for d in dirs + [cuda_rt] * cuda_rt.is_dir()]
    return None


def test_declarations_match_cublaslt_h():
    """cublaslt_check.cc static_asserts the handler's constants and struct layouts against the real
    cublasLt.h (installed with the CUDA toolkit or the pip NVIDIA headers)."""
    inc = _cublas_include_dirs()
    if inc is None:
        pytest.skip("cublasLt.h is not installed here; runs on the device (CUDA toolkit)")
    cmd = [cublaslt._compiler(), "-std=c++17", "-fsyntax-only", "-isystem", jax.ffi.include_dir()]
    for d in inc:
        cmd += ["-isystem", d]
    proc = subprocess.run(cmd + [str(cublaslt.CHECK_SOURCE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_wrapper_validates_and_explains_where_it_cannot_run():
    qa, sa, qb, sb = _operands(8, 256, 256, 0)
    with pytest.raises(ValueError, match="K % 128 == 0"):
        a2, s2 = quantize_activations(jnp.ones((8, 200), jnp.float32))
        w2 = quantize_weight_blockwise(jnp.ones((256, 200), jnp.float32))
        cublaslt.fp8_gemm_cublaslt(a2, s2, w2.q, w2.scale_inv)
    w3 = quantize_weight_blockwise(jnp.ones((200, 256), jnp.float32))
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cublaslt.fp8_gemm_cublaslt(qa, sa, w3.q, w3.scale_inv)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        cublaslt.fp8_gemm_cublaslt(qa, sa, qb, sb, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="b_scale_inv has shape"):
        cublaslt.fp8_gemm_cublaslt(qa, sa, qb, sb[:1])
    for bad in (sa, sa[0]):  # [M, K/128] given where [K/128, M] is asked; a vector
        with pytest.raises(ValueError, match=r"a_scale_t must be \[K/128, M\] for a \(8, 256\)"):
            cublaslt.fp8_gemm_cublaslt_t(qa, bad, qb, sb)
    assert cublaslt.supports(6144, 4096) and not cublaslt.supports(6144, 4000) and not cublaslt.supports(100, 4096)
    if not ON_GPU:
        ok, why = cublaslt.available()
        assert not ok and "CUDA GPU" in why
        with pytest.raises(RuntimeError, match="cannot run here"):
            cublaslt.fp8_gemm_cublaslt(qa, sa, qb, sb)


def test_handler_against_a_host_cublaslt_stand_in(handler_build, tmp_path):
    """The real handler (its host-buffer twin, on the CPU platform) driven through the real wrappers
    against tests/fake_cublaslt.cc, a CPU model of cuBLASLt's documented semantics: descriptors,
    layouts, scale pointers, padding and workspace wiring give the jnp reference's product."""
    fake = tmp_path / "libfake_cublaslt.so"
    proc = subprocess.run([cublaslt._compiler(), "-std=c++17", "-O2", "-shared", "-fPIC",
                           str(Path(__file__).with_name("fake_cublaslt.cc")), "-o", str(fake)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = _load_copy(handler_build, tmp_path / "handler", str(fake))
    msg = ctypes.create_string_buffer(256)
    assert lib.fp8rl_cublaslt_load(msg, len(msg)) == 131000, msg.value
    target = "fp8rl_cublaslt_test_host"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.Fp8rlCublasLtFp8BlockGemmHost), platform="cpu")
    fake_lib = ctypes.CDLL(str(fake))
    with jax.default_device(jax.devices("cpu")[0]):  # the host twin is registered for the CPU platform only
        _run_against_stand_in(target)
        assert fake_lib.fake_cublaslt_matmuls() == 6  # one cuBLASLt call per GEMM, nothing done twice
        _algorithm_choice_against_stand_in(target, lib, fake_lib)


def _algorithm_choice_against_stand_in(target: str, lib: ctypes.CDLL, fake_lib: ctypes.CDLL) -> None:
    """``algo=(index, split_k)`` reaches cuBLASLt as that entry of the heuristic's list with its K splits and a
    reduction scheme set; an index past the list or splits the algorithm refuses fall back to the heuristic's
    first; the product does not change; `list_algos` reports the list (the stand-in offers 3, the last refusing
    pinned splits)."""
    def last_algo():
        out = (ctypes.c_uint64 * 4)()
        fake_lib.fake_cublaslt_last_algo(out)
        return list(out)

    qa, sa, qb, sb = _operands(24, 256, 384, seed=11)
    want = np.asarray(cublaslt._call(qa, sa, qb, sb, jnp.dtype(jnp.float32), target=target))
    assert last_algo() == [1, 10, 1, 0]  # rank 0, its own splits
    # (rank, splits) -> the algorithm words cuBLASLt ran: [rank + 1, tile, K splits, reduction scheme]
    for algo, ran in (((1, 4), [2, 11, 4, 2]), ((1, 1), [2, 11, 1, 0]), ((2, 0), [3, 12, 1, 0]),
                      ((2, 4), [1, 10, 1, 0]), ((7, 0), [1, 10, 1, 0])):
        got = np.asarray(cublaslt._call(qa, sa, qb, sb, jnp.dtype(jnp.float32), target=target, algo=algo))
        np.testing.assert_array_equal(got, want)
        assert last_algo() == ran, algo
    with pytest.raises(ValueError, match="algo must be"):
        cublaslt._algo((-1, 0))
    listed = cublaslt.list_algos(24, 256, 384, jnp.float32, split_k=4, lib=lib)
    assert [(a["index"], a["tile_id"], a["split_k"], a["reduction_scheme"], a["accepted"]) for a in listed] == [
        (0, 10, 4, 2, True), (1, 11, 4, 2, True), (2, 12, 1, 0, False)]
    assert [a["waves_count"] for a in listed] == [0.25, 0.5, 0.75]
    assert [a["tile_id"] for a in cublaslt.list_algos(24, 256, 384, lib=lib)] == [10, 11, 12]


def _run_against_stand_in(target: str) -> None:
    for m, n, k, out_dtype, tol in ((100, 384, 768, jnp.float32, 1e-5), (16, 256, 512, jnp.bfloat16, 1e-2),
                                    (1, 128, 1024, jnp.float32, 1e-5)):
        qa, sa, qb, sb = _operands(m, n, k, seed=m + k)
        got = cublaslt._call(qa, sa, qb, sb, jnp.dtype(out_dtype), target=target)
        ref = fp8_gemm_reference(qa, sa, qb, sb, out_dtype=jnp.float32)
        assert got.shape == (m, n) and got.dtype == jnp.dtype(out_dtype)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
        assert err <= tol, f"M={m} N={n} K={k} {out_dtype}: {err:.2e}"
    # the scales already in cuBLASLt's order, as the policy's quantization writes them: the same product
    x = jax.random.normal(jax.random.key(5), (40, 512), jnp.float32)
    qa, sa = quantize_activations(x)
    _, _, qb, sb = _operands(40, 256, 512, seed=3)
    got = cublaslt._call_t(*quantize_activations_t(x), qb, sb, jnp.dtype(jnp.float32), target=target)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(cublaslt._call(qa, sa, qb, sb, jnp.dtype(jnp.float32),
                                                                             target=target)))
    # 1D x 1D (the wgrad): contraction 300 (padded to 384), 20 rows (padded to 32)
    ka, kb = jax.random.split(jax.random.key(9))
    a, sa = quantize_activations(jax.random.normal(ka, (20, 300), jnp.float32))
    b, sb = quantize_activations(jax.random.normal(kb, (48, 300), jnp.float32) * 0.01)
    got = np.asarray(cublaslt._call_1d(a, sa, b, sb, jnp.dtype(jnp.float32), target=target), np.float64)
    ref = _deq64(a, sa) @ _deq64(b, sb).T
    assert got.shape == (20, 48) and np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_lowers_for_cuda_with_the_handlers_contract():
    """On the CPU, lowered for CUDA: one custom call to the registered target with the operands the
    handler decodes (M padded to 16, scales transposed / K blocks padded to 4) and its int32 attribute."""
    a, s = jax.ShapeDtypeStruct((100, 768), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((100, 6), jnp.float32)
    b, bs = jax.ShapeDtypeStruct((384, 768), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((3, 6), jnp.float32)
    text = cublaslt._call.trace(a, s, b, bs, jnp.dtype(jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and f"@{cublaslt.FFI_TARGET}(" in calls[0] and "b_blocks = 1 : i32" in calls[0]
    ws = f"tensor<{cublaslt.WORKSPACE_BYTES}xui8>"  # cuBLASLt's workspace: a second result, allocated by XLA
    assert ("(tensor<112x768xf8E4M3FN>, tensor<6x112xf32>, tensor<384x768xf8E4M3FN>, tensor<3x8xf32>) -> "
            f"(tensor<112x384xbf16>, {ws})") in calls[0]
    sb1 = jax.ShapeDtypeStruct((384, 6), jnp.float32)
    text = cublaslt._call_1d.trace(a, s, b, sb1, jnp.dtype(jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "b_blocks = 0 : i32" in calls[0]
    assert f"tensor<6x384xf32>) -> (tensor<112x384xf32>, {ws})" in calls[0]


def test_graph_capturable_registration_unless_turned_off(handler_build, monkeypatch):
    monkeypatch.delenv("FP8RL_CUBLASLT_GRAPHS", raising=False)
    assert cublaslt.ffi_target() == cublaslt.FFI_TARGET
    monkeypatch.setenv("FP8RL_CUBLASLT_GRAPHS", "0")
    assert cublaslt.ffi_target() == cublaslt.FFI_TARGET_EAGER
    if not ON_GPU:  # both handler symbols exist in the built library (registered for CUDA by `load`)
        lib = ctypes.CDLL(str(cublaslt.build(handler_build)))  # the module's build (the same source)
        assert lib.Fp8rlCublasLtFp8BlockGemm and lib.Fp8rlCublasLtFp8BlockGemmEager


def test_1d_wrapper_validates():
    a = jnp.zeros((32, 300), jnp.float8_e4m3fn)
    sa = jnp.ones((32, 3), jnp.float32)
    with pytest.raises(ValueError, match="do not form"):
        cublaslt.fp8_gemm_cublaslt_1d(a, sa, a, sa[:, :2])
    with pytest.raises(ValueError, match="float8_e4m3fn matrix"):
        cublaslt.fp8_gemm_cublaslt_1d(a.astype(jnp.bfloat16), sa, a, sa)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cublaslt.fp8_gemm_cublaslt_1d(a, sa, a[:20], sa[:20])
    if not ON_GPU:
        with pytest.raises(RuntimeError, match="cannot run here"):
            cublaslt.fp8_gemm_cublaslt_1d(a, sa, a, sa)
        assert not cublaslt.one_d_available()


def test_fp8_training_routes_fprop_dgrad_and_wgrad_to_cublaslt(monkeypatch):
    """Fp8TrainRecipe(gemm=cublaslt) on a (stand-in) GPU: the trainer's fprop and dgrad call the
    block-scaled GEMM and its wgrad the 1D x 1D one; the gradients equal the reference path's."""
    import fp8rl_jax.quant.training as T
    from fp8rl_jax.models.policy import Kernels as K
    from fp8rl_jax.quant.training import Fp8TrainRecipe, fp8_linear

    calls = []

    def block(aq, a_s, bq, b_s, out_dtype):
        calls.append("block")
        return fp8_gemm_reference(aq, a_s, bq, b_s, out_dtype=out_dtype)

    def one_d(a, a_s, b, b_s, out_dtype):
        calls.append("1d")
        deq = lambda q, s: (q.astype(jnp.float32).reshape(q.shape[0], -1, 128) * s[..., None]).reshape(q.shape)
        return jnp.dot(deq(a, a_s), deq(b, b_s).T, precision=jax.lax.Precision.HIGHEST).astype(out_dtype)

    monkeypatch.delenv("FP8RL_FP8_GEMM", raising=False)
    monkeypatch.setattr(T, "_interpret", lambda: False)
    monkeypatch.setattr(T.cublaslt, "available", lambda: (True, ""))
    monkeypatch.setattr(T.cublaslt, "one_d_available", lambda: True)
    monkeypatch.setattr(T.cublaslt, "fp8_gemm_cublaslt", block)
    monkeypatch.setattr(T.cublaslt, "fp8_gemm_cublaslt_1d", one_d)
    monkeypatch.setattr(T, "quantize_weight", lambda w, block_size, kernels: quantize_weight_blockwise(w, block_size))
    kx, kw, kd = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (256, 256), jnp.float32)
    w = jax.random.normal(kw, (128, 256), jnp.float32) * 0.1
    dy = jax.random.normal(kd, (256, 128), jnp.float32)

    def grads(recipe):
        y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, recipe, dtype=jnp.float32), x, w)
        return (y, *vjp(dy))

    got = grads(Fp8TrainRecipe(kernels=K.PALLAS, gemm=GemmBackend.CUBLASLT))
    assert calls == ["block", "block", "1d"], calls
    want = grads(Fp8TrainRecipe(kernels=K.REFERENCE))
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * np.abs(r).max())


def test_gemm_backend_resolution(monkeypatch):
    import fp8rl_jax.quant.policy as P

    monkeypatch.delenv("FP8RL_FP8_GEMM", raising=False)
    monkeypatch.setattr(P, "device_kind", lambda: "a device kind never measured")
    assert GemmBackend.AUTO.resolve() is GemmBackend.MOSAIC
    monkeypatch.setenv("FP8RL_FP8_GEMM", "cublaslt")
    assert GemmBackend.AUTO.resolve() is GemmBackend.CUBLASLT
    assert GemmBackend.MOSAIC.resolve() is GemmBackend.MOSAIC  # an explicit choice wins over the variable
    monkeypatch.setenv("FP8RL_FP8_GEMM", "cutlass")
    with pytest.raises(ValueError, match="FP8RL_FP8_GEMM must be one of"):
        GemmBackend.AUTO.resolve()


def test_auto_follows_the_measured_table_per_shape(tmp_path, monkeypatch):
    """AUTO: the variable first, else the faster backend measured on this device kind at the shape's
    (M bucket, N, K), else the table's default for the device kind, else Mosaic; bench_gemm's entries
    are what the table holds, and rewriting the table keeps its defaults."""
    import json

    import fp8rl_jax.quant.policy as P

    from experiments.bench.suites import gemm as bench_gemm

    rows = [{"M": 200, "N": 6144, "K": 4096, "ours_mgpu": {"ms": 0.040}, "ours_cublaslt": {"ms": 0.025}},
            {"M": 4096, "N": 4096, "K": 4096, "ours_mgpu": {"ms": 0.20}, "ours_cublaslt": {"ms": 0.30}},
            {"M": 64, "N": 1024, "K": 4096, "ours_mgpu": {"ms": 0.01}, "ours_cublaslt": {"error": "no algorithm"}}]
    entries = bench_gemm.backend_entries(rows, "NVIDIA H200")
    assert [(e["m_bucket"], e["n"], e["backend"]) for e in entries] == [(256, 6144, "cublaslt"), (4096, 4096, "mosaic")]
    table = tmp_path / "fp8_gemm_backends.json"
    table.write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(P, "GEMM_BACKEND_TABLE", table)
    monkeypatch.setattr(P, "device_kind", lambda: "NVIDIA H200")
    P._measured_backends.cache_clear()
    P._default_backend.cache_clear()
    monkeypatch.delenv("FP8RL_FP8_GEMM", raising=False)
    try:
        assert P.GemmBackend.AUTO.resolve(256, 6144, 4096) is P.GemmBackend.CUBLASLT
        assert P.GemmBackend.AUTO.resolve(129, 6144, 4096) is P.GemmBackend.CUBLASLT  # same M bucket
        assert P.GemmBackend.AUTO.resolve(4000, 4096, 4096) is P.GemmBackend.MOSAIC
        assert P.GemmBackend.AUTO.resolve(256, 1024, 4096) is P.GemmBackend.MOSAIC  # not in the table
        assert P.GemmBackend.AUTO.resolve() is P.GemmBackend.MOSAIC  # no shape
        assert P.GemmBackend.MOSAIC.resolve(256, 6144, 4096) is P.GemmBackend.MOSAIC  # explicit wins
        monkeypatch.setenv("FP8RL_FP8_GEMM", "mosaic")
        assert P.GemmBackend.AUTO.resolve(256, 6144, 4096) is P.GemmBackend.MOSAIC  # the variable wins
        assert P.GemmBackend.AUTO.describe() == "mosaic" and P.GemmBackend.CUBLASLT.describe() == "cublaslt"
        monkeypatch.delenv("FP8RL_FP8_GEMM")
        assert P.GemmBackend.AUTO.describe() == "auto"
        # a default for the device kind (from a measured rollout) covers the shapes without an entry
        defaults = [{"device_kind": "NVIDIA H200", "backend": "cublaslt", "evidence": "a rollout"}]
        table.write_text(json.dumps({"entries": entries, "defaults": defaults}))
        P._measured_backends.cache_clear()
        P._default_backend.cache_clear()
        assert P.GemmBackend.AUTO.resolve(256, 1024, 4096) is P.GemmBackend.CUBLASLT  # not in the table
        assert P.GemmBackend.AUTO.resolve() is P.GemmBackend.CUBLASLT
        assert P.GemmBackend.AUTO.resolve(4000, 4096, 4096) is P.GemmBackend.MOSAIC  # the entry wins
        out = tmp_path / "rewritten.json"
        monkeypatch.setattr(bench_gemm, "GEMM_BACKEND_TABLE", table)
        bench_gemm.write_backend_table(out, entries[:1])
        rewritten = json.loads(out.read_text())
        assert rewritten["defaults"] == defaults and len(rewritten["entries"]) == 2  # merged, defaults kept
        monkeypatch.setattr(P, "device_kind", lambda: "NVIDIA H100")  # measured elsewhere: not used
        P._measured_backends.cache_clear()
        P._default_backend.cache_clear()
        assert P.GemmBackend.AUTO.resolve(256, 6144, 4096) is P.GemmBackend.MOSAIC
    finally:
        P._measured_backends.cache_clear()
        P._default_backend.cache_clear()


def _spy_triton_configs(monkeypatch, scales_t: list | None = None) -> list:
    """Records the `GemmConfig` of every call the policy makes to the Triton GEMM kernel (which still runs), and in
    ``scales_t`` (when given) whether the call passed the activation scales transposed."""
    import fp8rl_jax.quant.policy as P

    configs = []
    real = P.gemm_kernel.fp8_gemm

    def spy(*args, config=None, **kw):
        configs.append(config)
        if scales_t is not None:
            scales_t.append(kw.get("a_scale_t", False))
        return real(*args, config=config, **kw)

    monkeypatch.setattr(P.gemm_kernel, "fp8_gemm", spy)
    return configs


def test_triton_backend_runs_the_split_k_kernel(monkeypatch):
    """``GemmBackend.TRITON`` (or ``FP8RL_FP8_GEMM=triton``) runs the dense W8A8 matmul on the Triton kernel with
    `triton_config`'s split-K tiling for the rows (interpret mode here), in the policy and in FP8 training's
    GEMM; the product equals the reference's."""
    import fp8rl_jax.quant.policy as P
    import fp8rl_jax.quant.training as T

    configs = _spy_triton_configs(monkeypatch)
    monkeypatch.setattr(P.mgpu_kernel, "fp8_gemm_mgpu", lambda *a, **k: pytest.fail("the Mosaic kernel ran"))
    x = jax.random.normal(jax.random.key(1), (3, 5, 256), jnp.float32)
    w = quantize_weight_blockwise(jax.random.normal(jax.random.key(2), (384, 256), jnp.float32) * 0.1)
    ref = W8A8Policy("float32", kernels=Kernels.REFERENCE).dot(x, w, Site(0, Proj.Q))
    y = W8A8Policy("float32", kernels=Kernels.PALLAS, gemm=GemmBackend.TRITON).dot(x, w, Site(0, Proj.Q))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-5, atol=2e-5)
    assert configs == [P.triton_config(15)] and configs[0].k_splits == 2
    monkeypatch.setenv("FP8RL_FP8_GEMM", "triton")
    W8A8Policy("float32", kernels=Kernels.PALLAS).dot(x, w, Site(0, Proj.Q))
    qa, sa = quantize_activations(x.reshape(15, 256))
    T._block_gemm(qa, sa, w.q, w.scale_inv, jnp.float32, GemmBackend.AUTO)
    assert len(configs) == 3
    assert all(P.triton_config(m) in P.gemm_kernel.DECODE_CONFIGS for m in (1, 64, 65, 128, 256))
    assert P.triton_config(4096) == P.gemm_kernel.DEFAULT_CONFIG


def test_triton_backend_reads_the_scales_as_quantized(monkeypatch):
    """On the GPU the policy has the activation quantization write the scales transposed ([K/128, M]) for a shape
    on the Triton kernel, as for cuBLASLt, and the kernel reads them so (``a_scale_t``): no transpose kernel between
    them. Forced here on the CPU (interpret mode): every one-pass quantization (plain, SwiGLU, add + RMSNorm) and the
    composed one hand over transposed scales, with products equal to the untransposed path's."""
    import fp8rl_jax.quant.policy as P

    flags: list = []
    _spy_triton_configs(monkeypatch, flags)
    k = 256
    x = jax.random.normal(jax.random.key(1), (6, k), jnp.bfloat16)
    res = jax.random.normal(jax.random.key(4), (6, k), jnp.bfloat16)
    w = quantize_weight_blockwise(jax.random.normal(jax.random.key(2), (384, k), jnp.float32) * 0.1)
    w2 = quantize_weight_blockwise(jax.random.normal(jax.random.key(3), (384, 2 * k), jnp.float32) * 0.1)
    gu = jax.random.normal(jax.random.key(5), (6, 4 * k), jnp.bfloat16)
    norm_w = jnp.ones((k,), jnp.bfloat16)
    runs = {}
    for forced in (False, True):
        monkeypatch.setattr(P.W8A8Policy, "_scales_t", lambda self, *a, forced=forced: forced)
        pol = W8A8Policy(kernels=Kernels.PALLAS, gemm=GemmBackend.TRITON)
        runs[forced] = [pol.dot(x, w, Site(0, Proj.Q)), pol.swiglu_dot(gu, w2, Site(0, Proj.DOWN)),
                        pol.norm_dot(x, norm_w, 1e-6, w, Site(0, Proj.Q), residual=res)[1],
                        pol.dot(x.astype(jnp.float32), w, Site(0, Proj.Q))]  # f32 x: the composed quantization
    assert flags == [False] * 4 + [True] * 4
    for a, b in zip(runs[False], runs[True]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_measured_triton_table_chooses_shapes_and_configs(monkeypatch, tmp_path):
    """``python -m experiments.bench decode_gemms --triton-table-out`` keeps per (M bucket, N, K) the fastest Triton config and whether
    it beat cuBLASLt by the margin; the policy reads that file: ``GemmBackend.AUTO`` runs the winning shapes on
    Triton (``FP8RL_FP8_GEMM`` and explicit backends still win) and `triton_config` returns the measured config;
    other device kinds and unmeasured shapes keep the defaults."""
    import json

    import fp8rl_jax.quant.policy as P

    from experiments.bench.suites import decode_gemms as bench

    fast, slow = P.gemm_kernel.DECODE_CONFIGS[-1], P.gemm_kernel.DECODE_CONFIGS[-2]
    cfg = dataclasses.asdict

    def row(m, n, variant, ms, config=None):
        r = {"shape": "x", "m": m, "n": n, "k": 4096, "variant": variant, "gpu_ms": ms}
        return r if config is None else {**r, "config": cfg(config)}

    rows = [row(128, 6144, "fp8_cublaslt", 0.0160), row(128, 6144, "fp8_triton_a", 0.0120, fast),
            row(128, 6144, "fp8_triton_b", 0.0130, slow), row(128, 6144, "bf16", 0.001),
            row(128, 4096, "fp8_cublaslt", 0.0150), row(128, 4096, "fp8_triton_a", 0.0148, fast),  # within 3%
            row(256, 4096, "fp8_triton_a", float("nan"), fast)]  # untimed (off the GPU): no entry
    entries = bench.triton_table_entries(rows, "NVIDIA H200", margin=0.03)
    assert [(e["m_bucket"], e["n"], e["backend"], e["us"]["triton"]) for e in entries] == [
        (128, 4096, "cublaslt", 14.8), (128, 6144, "triton", 12.0)]
    table = tmp_path / "fp8_gemm_triton.json"
    table.write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(P, "TRITON_GEMM_TABLE", table)
    monkeypatch.setattr(P, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.delenv("FP8RL_FP8_GEMM", raising=False)
    P._measured_triton.cache_clear()
    try:
        assert P.GemmBackend.AUTO.resolve(100, 6144, 4096) is P.GemmBackend.TRITON  # M bucket 128
        assert P.triton_config(100, 6144, 4096) == fast
        assert P.GemmBackend.AUTO.resolve(100, 4096, 4096) is not P.GemmBackend.TRITON  # cuBLASLt kept it
        assert P.triton_config(100, 4096, 4096) == fast  # the measured config, should Triton be asked for
        assert P.GemmBackend.AUTO.resolve(200, 6144, 4096) is not P.GemmBackend.TRITON  # another M bucket
        assert P.triton_config(200, 6144, 4096) == P.triton_config(200)
        assert P.GemmBackend.CUBLASLT.resolve(100, 6144, 4096) is P.GemmBackend.CUBLASLT
        monkeypatch.setenv("FP8RL_FP8_GEMM", "cublaslt")
        assert P.GemmBackend.AUTO.resolve(100, 6144, 4096) is P.GemmBackend.CUBLASLT
        monkeypatch.delenv("FP8RL_FP8_GEMM")
        monkeypatch.setattr(P, "device_kind", lambda: "NVIDIA H100")  # measured elsewhere: not used
        P._measured_triton.cache_clear()
        assert P.GemmBackend.AUTO.resolve(100, 6144, 4096) is not P.GemmBackend.TRITON
        assert P.triton_config(100, 6144, 4096) == P.triton_config(100)
    finally:
        P._measured_triton.cache_clear()


def test_committed_triton_table_is_consistent(monkeypatch):
    """The committed `TRITON_GEMM_TABLE` (H200): every entry's config is one of the decode configs (so
    the interpret and lowering tests cover what AUTO runs), "triton" only where it beat cuBLASLt by the bench's 3%
    margin, one entry per (device kind, M bucket, N, K); and on that device kind AUTO routes exactly those shapes
    to Triton with the measured config."""
    import json

    import fp8rl_jax.quant.policy as P

    entries = json.loads(P.TRITON_GEMM_TABLE.read_text())["entries"]
    assert entries
    keys = [(e["device_kind"], e["m_bucket"], e["n"], e["k"]) for e in entries]
    assert len(keys) == len(set(keys))
    monkeypatch.delenv("FP8RL_FP8_GEMM", raising=False)
    P._measured_triton.cache_clear()
    try:
        for e in entries:
            cfg = P.gemm_kernel.GemmConfig(**e["config"])
            assert cfg in P.gemm_kernel.DECODE_CONFIGS, cfg
            assert e["backend"] in ("triton", "cublaslt")
            assert (e["backend"] == "triton") == (e["us"]["triton"] <= 0.97 * e["us"]["cublaslt"]), e
            monkeypatch.setattr(P, "device_kind", lambda kind=e["device_kind"]: kind)
            m = e["m_bucket"] - 1
            assert (P.GemmBackend.AUTO.resolve(m, e["n"], e["k"]) is P.GemmBackend.TRITON) == (e["backend"] == "triton")
            assert P.triton_config(m, e["n"], e["k"]) == cfg
        assert any(e["backend"] == "triton" for e in entries)
    finally:
        P._measured_triton.cache_clear()


def test_policy_routes_supported_shapes_to_cublaslt(monkeypatch):
    """With gemm=cublaslt on a (stand-in) GPU the dense FP8 matmul calls cuBLASLt with the quantized
    activations and the weight as stored; a shape it does not take goes to the Pallas kernels."""
    import fp8rl_jax.quant.policy as P

    calls = []

    algos = []

    def fake(xq, xs_t, q, s, out_dtype, algo):  # the scales come as cuBLASLt reads them, [K/128, M]
        assert xs_t.shape == (xq.shape[1] // 128, xq.shape[0])
        calls.append((xq.shape, q.shape, jnp.dtype(out_dtype)))
        algos.append(algo)
        return fp8_gemm_reference(xq, xs_t.T, q, s, out_dtype=out_dtype)

    monkeypatch.setattr(P.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(P.cublaslt, "available", lambda: (True, ""))
    monkeypatch.setattr(P.cublaslt, "fp8_gemm_cublaslt_t", fake)
    monkeypatch.setattr(P.mgpu_kernel, "fp8_gemm_mgpu", lambda *a, **k: pytest.fail("the Mosaic kernel ran"))
    monkeypatch.setattr(P.gemm_kernel, "fp8_gemm",
                        lambda xq, xs, q, s, out_dtype, interpret: fp8_gemm_reference(xq, xs, q, s, out_dtype=out_dtype))
    policy = W8A8Policy("float32", kernels=Kernels.PALLAS, gemm=GemmBackend.CUBLASLT)
    x = jax.random.normal(jax.random.key(1), (3, 5, 256), jnp.float32)
    w = quantize_weight_blockwise(jax.random.normal(jax.random.key(2), (384, 256), jnp.float32) * 0.1)
    y = policy.dot(x, w, Site(0, Proj.Q))
    ref = W8A8Policy("float32", kernels=Kernels.REFERENCE).dot(x, w, Site(0, Proj.Q))
    assert calls == [((15, 256), (384, 256), jnp.dtype(jnp.float32))] and y.shape == (3, 5, 384)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # the measured algorithm table's entry for (M bucket, N, K), unless FP8RL_CUBLASLT_ALGO=heuristic
    monkeypatch.setattr(P, "_measured_cublaslt_algos", lambda kind: {(64, 384, 256): (2, 4)})
    policy.dot(x, w, Site(0, Proj.Q))
    policy.dot(x[:, :1], quantize_weight_blockwise(jnp.ones((128, 256), jnp.float32)), Site(0, Proj.Q))  # no entry
    monkeypatch.setenv("FP8RL_CUBLASLT_ALGO", "heuristic")
    policy.dot(x, w, Site(0, Proj.Q))
    assert algos == [(0, 0), (2, 4), (0, 0), (0, 0)]
    monkeypatch.setenv("FP8RL_CUBLASLT_ALGO", "fastest")
    with pytest.raises(ValueError, match="FP8RL_CUBLASLT_ALGO must be"):
        policy.dot(x, w, Site(0, Proj.Q))
    monkeypatch.delenv("FP8RL_CUBLASLT_ALGO")
    del calls[1:]
    odd = quantize_weight_blockwise(jax.random.normal(jax.random.key(3), (200, 256), jnp.float32))  # N % 16 != 0
    policy.dot(x, odd, Site(0, Proj.Q))
    assert len(calls) == 1
    monkeypatch.setattr(P.cublaslt, "available", lambda: (False, "no cuBLASLt here"))
    with pytest.raises(RuntimeError, match="no cuBLASLt here"):  # asked for by name: an error, not a fallback
        policy.dot(x, w, Site(0, Proj.Q))
    monkeypatch.setenv("FP8RL_FP8_GEMM", "cublaslt")
    with pytest.raises(RuntimeError, match="no cuBLASLt here"):
        dataclasses.replace(policy, gemm=GemmBackend.AUTO).dot(x, w, Site(0, Proj.Q))
    monkeypatch.delenv("FP8RL_FP8_GEMM")
    monkeypatch.setattr(P, "_measured_backends", lambda kind: {(64, 384, 256): GemmBackend.CUBLASLT})
    calls.clear()  # the measured table's choice falls back to the Mosaic kernel quietly
    monkeypatch.setattr(P.mgpu_kernel, "fp8_gemm_mgpu", lambda xq, xs, q, s, out_dtype, interpret: (
        calls.append("mosaic"), fp8_gemm_reference(xq, xs, q, s, out_dtype=out_dtype))[1])
    dataclasses.replace(policy, gemm=GemmBackend.AUTO).dot(x, w, Site(0, Proj.Q))
    assert calls == ["mosaic"]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU; run on the device (README: GPU tests)")
class TestGpu:
    @pytest.mark.parametrize("m", [1, 100, 256, 4096])
    @pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (6144, 4096), (4096, 12288), (256, 768)])
    def test_matches_reference(self, m, n, k):
        qa, sa, qb, sb = _operands(m, n, k, seed=m + n + k)
        ref = np.asarray(fp8_gemm_reference(qa, sa, qb, sb, out_dtype=jnp.float32))
        for out_dtype, tol in ((jnp.float32, 2e-3), (jnp.bfloat16, 1e-2)):
            out = np.asarray(cublaslt.fp8_gemm_cublaslt(qa, sa, qb, sb, out_dtype=out_dtype), np.float32)
            assert out.shape == (m, n)
            err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
            assert err <= tol, f"M={m} N={n} K={k} {out_dtype}: rel err {err:.2e}"

    def test_inside_a_jitted_loop_and_the_policy(self, monkeypatch):
        """Called from a scan (the decode loop's shape of use) and through W8A8Policy."""
        qa, sa, qb, sb = _operands(64, 1024, 4096, seed=7)

        @jax.jit
        def loop(qa, sa):
            def body(c, i):
                return c + cublaslt.fp8_gemm_cublaslt(qa, sa * (1.0 + i), qb, sb, out_dtype=jnp.float32), None
            return jax.lax.scan(body, jnp.zeros((64, 1024), jnp.float32), jnp.arange(3.0))[0]

        ref = fp8_gemm_reference(qa, sa, qb, sb, out_dtype=jnp.float32) * 6.0
        np.testing.assert_allclose(np.asarray(loop(qa, sa)), np.asarray(ref), rtol=0, atol=2e-3 * float(jnp.max(jnp.abs(ref))))
        x = jax.random.normal(jax.random.key(0), (2, 32, 4096), jnp.bfloat16)
        w = quantize_weight_blockwise(jax.random.normal(jax.random.key(1), (1024, 4096), jnp.float32) * 0.02)
        got = W8A8Policy(gemm=GemmBackend.CUBLASLT).dot(x, w, Site(0, Proj.O)).astype(jnp.float32)
        want = W8A8Policy(gemm=GemmBackend.MOSAIC).dot(x, w, Site(0, Proj.O)).astype(jnp.float32)
        assert float(jnp.max(jnp.abs(got - want))) <= 2e-2 * float(jnp.max(jnp.abs(want)))

    def test_auto_follows_the_committed_triton_table(self, monkeypatch):
        """On a device kind the committed `TRITON_GEMM_TABLE` measured, AUTO runs each of its Triton shapes on the
        Triton kernel with the measured config (traced under jit, as the generator runs it) and the rest on
        cuBLASLt; the products agree with cuBLASLt's."""
        import json

        import fp8rl_jax.quant.policy as P

        kind = P.device_kind()
        entries = [e for e in json.loads(P.TRITON_GEMM_TABLE.read_text())["entries"] if e["device_kind"] == kind]
        if not entries:
            pytest.skip(f"the committed Triton table has no entry for {kind}")
        monkeypatch.delenv("FP8RL_FP8_GEMM", raising=False)
        flags: list = []
        configs = _spy_triton_configs(monkeypatch, flags)
        for e in entries:
            m, n, k = e["m_bucket"], e["n"], e["k"]
            x = jax.random.normal(jax.random.key(n + k + m), (m, k), jnp.bfloat16)
            w = quantize_weight_blockwise(jax.random.normal(jax.random.key(n), (n, k), jnp.float32) * k ** -0.5)
            configs.clear()
            got = jax.jit(lambda x, w=w: W8A8Policy(gemm=GemmBackend.AUTO).dot(x, w, Site(0, Proj.O)))(x)
            assert configs == ([P.gemm_kernel.GemmConfig(**e["config"])] if e["backend"] == "triton" else []), e
            assert all(flags), "the Triton GEMM got untransposed scales: a transpose kernel runs before it"
            want = W8A8Policy(gemm=GemmBackend.CUBLASLT).dot(x, w, Site(0, Proj.O)).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
            assert err <= 2e-2, (e, err)

    @pytest.mark.parametrize("m,n,c", [(4096, 4096, 8192), (1024, 4096, 3000), (100, 768, 640)])
    def test_1d_matches_reference_or_says_why_not(self, m, n, c):
        """The wgrad's 1x128 x 1x128 scaling: against the dequantized float32 product where this cuBLASLt
        runs it, else a clear error naming the scaling (and `one_d_available` says False)."""
        ka, kb = jax.random.split(jax.random.key(m + n + c))
        a, sa = quantize_activations(jax.random.normal(ka, (m, c), jnp.float32))
        b, sb = quantize_activations(jax.random.normal(kb, (n, c), jnp.float32) * 0.01)
        if not cublaslt.one_d_available():
            with pytest.raises(Exception, match="1x128 x 1x128"):
                jax.block_until_ready(cublaslt.fp8_gemm_cublaslt_1d(a, sa, b, sb))
            return
        ref = _deq64(a, sa) @ _deq64(b, sb).T
        out = np.asarray(cublaslt.fp8_gemm_cublaslt_1d(a, sa, b, sb), np.float64)
        assert out.shape == (m, n)
        assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 2e-3


def _deq64(q, s) -> np.ndarray:
    """float64 codes x their 1x128 group scales."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    return q * np.repeat(np.asarray(s, np.float64), 128, axis=1)[:, : q.shape[1]]
