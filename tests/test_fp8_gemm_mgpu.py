"""Mosaic GPU FP8 block GEMM (`pallas_kernels.fp8_gemm_mgpu`) against `fp8_gemm_reference`.

`TestInterpret` runs the kernel in Mosaic GPU interpret mode on the CPU (small shapes: the interpreter
simulates every warpgroup, TMA and barrier in Python); `TestGpu` flips `interpret` and runs real Qwen3-8B
sizes on an H200 (marked `gpu`; conftest skips it elsewhere). Inputs are quantized from fresh random data
with the project's quantizers, so the comparison measures kernel error only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from experiments.bench.tables import merged_tuning
from fp8rl_jax.quant import quantize_activations, quantize_weight_blockwise
from pallas_kernels import fp8_gemm_mgpu as G
from pallas_kernels.fp8_gemm_mgpu import MatmulDimension, MgpuGemmConfig, fp8_gemm_mgpu, fp8_gemm_reference

# max |out - ref| / max |ref|. Interpret mode simulates wgmma in float32, so only the order of the two
# scale multiplies (kernel: d * (sa * sb); reference: (d * sa) * sb) separates them. On Hopper the FP8
# wgmma accumulates each 128-wide K block with reduced precision, hence the looser GPU float32 bound.
TOL_INTERPRET = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
TOL_GPU = {jnp.float32: 1e-3, jnp.bfloat16: 1e-2}

M_SPLIT = MgpuGemmConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.M, max_concurrent_steps=2, num_sms=2)
N_SPLIT = MgpuGemmConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.N, max_concurrent_steps=2, num_sms=2)
N_SPLIT_64 = MgpuGemmConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.N, max_concurrent_steps=3, num_sms=3)
TILE_M_128 = MgpuGemmConfig(tile_m=128, tile_n=128, wg_dimension=MatmulDimension.N, max_concurrent_steps=2, num_sms=2)
DECODE_256x64 = MgpuGemmConfig(tile_m=128, tile_n=64, wg_dimension=MatmulDimension.M, max_concurrent_steps=3, num_sms=2)
SPLIT_K3 = MgpuGemmConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.N, max_concurrent_steps=2, num_sms=3,
                          k_splits=3)
# clusters of 2 CTAs along N sharing the A tile by TMA multicast (num_sms=4: 2 clusters)
CLUSTER_DECODE = dataclasses.replace(DECODE_256x64, num_sms=4, cluster_n=2)
CLUSTER_N_SPLIT = MgpuGemmConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.N, max_concurrent_steps=2,
                                 num_sms=4, cluster_n=2, grid_tile_width=2)
CLUSTER_SPLIT_K = dataclasses.replace(CLUSTER_N_SPLIT, k_splits=2, grid_tile_width=1)
# promotion of K block kb - 1 overlapped with block kb's wgmma (the carry holds one block's product)
OVERLAP = dataclasses.replace(M_SPLIT, overlap_promotion=True)


def _quantized_operands(m: int, n: int, k: int, seed: int):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    # Rows of very different magnitude, so per-token and per-block scales differ and a misapplied scale shows.
    x = x * jnp.exp2(jax.random.randint(kx, (m, 1), -4, 5).astype(jnp.float32))
    w = jax.random.normal(kw, (n, k), jnp.float32) * jnp.exp2(jax.random.randint(kw, (n, 1), -6, 0).astype(jnp.float32))
    qa, sa = quantize_activations(x)
    qw = quantize_weight_blockwise(w)
    return x, w, qa, sa, qw.q, qw.scale_inv


# Every interpret-mode shape fits in this one. The quantizers run eagerly, compiling each op per shape (seconds per
# new shape on the CPU), so smaller shapes take the top-left corner of this shape's operands: activations are
# quantized per row in 1 x 128 groups and weights in 128 x 128 blocks, so with N and K whole blocks the corner is
# exactly what quantizing the corner of x and w gives.
_BASE = (256, 768, 768)


@functools.cache
def _base_operands(seed: int):
    return tuple(np.asarray(a) for a in _quantized_operands(*_BASE, seed))


def _operands(m: int, n: int, k: int, seed: int):
    """(x [m, k], w [n, k] float32, their FP8 codes and scales); the same draw per seed at every shape."""
    if m > _BASE[0] or n > _BASE[1] or k > _BASE[2] or n % 128 or k % 128:
        return _quantized_operands(m, n, k, seed)
    x, w, qa, sa, qb, sb = _base_operands(seed)
    return tuple(jnp.asarray(a) for a in (x[:m, :k], w[:n, :k], qa[:m, :k], sa[:m, : k // 128], qb[:n, :k],
                                          sb[: n // 128, : k // 128]))


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


class TestInterpret:
    INTERPRET: bool = True
    TOL = TOL_INTERPRET

    def check(self, m, n, k, config, out_dtype=jnp.float32, seed=0):
        _, _, qa, sa, qb, sb = _operands(m, n, k, seed)
        out = fp8_gemm_mgpu(qa, sa, qb, sb, out_dtype=out_dtype, config=config, interpret=self.INTERPRET)
        assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dtype)
        ref = fp8_gemm_reference(qa, sa, qb, sb, out_dtype=jnp.float32)
        err = _rel_err(out, ref)
        assert err <= self.TOL[out_dtype], f"M={m} N={n} K={k} {config}: rel err {err:.3e} > {self.TOL[out_dtype]}"
        return out

    @pytest.mark.parametrize(
        "m,n,k,config",
        [
            (128, 256, 384, M_SPLIT),  # 2 tiles x 3 K blocks: steady-state slot reuse
            (64, 256, 256, N_SPLIT),  # decode shape, warpgroups split N
            (200, 256, 128, M_SPLIT),  # partial M (padded), 4 tiles on 2 CTAs (persistent loop), 1 K block
            (64, 128, 384, N_SPLIT_64),  # tile_n=64: both warpgroups share one B scale block
            (128, 256, 256, TILE_M_128),  # tile_m=128 (two wgmma M=64 halves per warpgroup)
            (256, 128, 384, DECODE_256x64),  # CTA 256 x 64: every decode row in one CTA, weight read once
            (72, 256, 768, SPLIT_K3),  # split-K: 3 x 2 K blocks per tile, 6 tile-splits on 3 CTAs, partial M
            (256, 512, 384, CLUSTER_DECODE),  # 4 CTA columns = 2 clusters of 2 sharing A (multicast)
            (200, 768, 256, CLUSTER_N_SPLIT),  # 3 cluster columns x 2 M tiles on 2 clusters, partial M
            (64, 512, 512, CLUSTER_SPLIT_K),  # clusters with split-K
            (128, 256, 384, OVERLAP),  # overlapped promotion: 3 K blocks, the last promoted after the loop
            (200, 256, 128, OVERLAP),  # overlapped promotion with 1 K block (nothing to overlap), partial M
            (72, 256, 768, dataclasses.replace(SPLIT_K3, overlap_promotion=True)),  # ... with split-K
            (256, 512, 384, dataclasses.replace(CLUSTER_DECODE, overlap_promotion=True)),  # ... with clusters
        ],
    )
    def test_f32_matches_reference(self, m, n, k, config):
        self.check(m, n, k, config)

    def test_bf16_out_and_default_config(self):
        self.check(72, 256, 256, None, out_dtype=jnp.bfloat16, seed=1)

    def test_split_k_bf16_out_and_uneven_split_refused(self):
        """Split-K sums float32 partials before the one cast to the output dtype."""
        self.check(64, 128, 512, dataclasses.replace(SPLIT_K3, k_splits=2), out_dtype=jnp.bfloat16, seed=3)
        _, _, qa, sa, qb, sb = _operands(64, 128, 384, 4)
        assert G.supports(64, 128, 384, SPLIT_K3)  # 3 K blocks split 3 ways
        assert not G.supports(64, 128, 512, SPLIT_K3)
        with pytest.raises(ValueError, match="divide evenly"):
            fp8_gemm_mgpu(qa[:, :256], sa[:, :2], qb[:, :256], sb[:, :2], config=SPLIT_K3, interpret=self.INTERPRET)

    def test_close_to_unquantized_product(self):
        """The quantized GEMM stays within FP8 quantization error of the float32 product."""
        x, w, qa, sa, qb, sb = _operands(128, 256, 256, seed=2)
        out = fp8_gemm_mgpu(qa, sa, qb, sb, out_dtype=jnp.float32, config=M_SPLIT, interpret=self.INTERPRET)
        exact = jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST)
        assert _rel_err(out, exact) < 0.05


class TestGpu(TestInterpret):
    INTERPRET = False
    TOL = TOL_GPU

    pytestmark = pytest.mark.gpu

    @pytest.mark.parametrize("m", [64, 100, 2048])
    @pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (4096, 12288)])
    def test_f32_matches_reference(self, m, n, k):  # real sizes, default config
        self.check(m, n, k, None, seed=m + n + k)

    @pytest.mark.parametrize("config", G.SWEEP_CONFIGS + G.OVERLAP_CONFIGS
                             + tuple(c for c in G.DECODE_SWEEP_CONFIGS if c.cluster_n > 1), ids=str)
    def test_sweep_configs(self, config):
        self.check(512, 1024, 1024, dataclasses.replace(config, num_sms=None), out_dtype=jnp.bfloat16)

    def test_bf16_out_and_default_config(self):
        self.check(8192, 1024, 4096, None, out_dtype=jnp.bfloat16, seed=1)


def test_no_races_detected():
    """Interpret mode with race detection: TMA -> consumer ordering, epilogue stores, 4 CTAs.

    One tile per CTA and K blocks <= stages: at jax 0.11.2 the detector reports a race on every pipeline slot
    that `emit_pipeline_warp_specialized` refills after its consumed barrier (even for a kernel whose body
    only reads its input block; wgmma operand reads are not race-checked at all), so slot reuse is left out.
    """
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    _, _, qa, sa, qb, sb = _operands(256, 256, 256, seed=3)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = fp8_gemm_mgpu(qa, sa, qb, sb, out_dtype=jnp.float32, config=dataclasses.replace(M_SPLIT, num_sms=4),
                        interpret=params)
    jax.block_until_ready(out)
    assert not gpu_callbacks.get_races().races_found
    assert _rel_err(out, fp8_gemm_reference(qa, sa, qb, sb, out_dtype=jnp.float32)) <= TOL_INTERPRET[jnp.float32]


# ----------------------------------------------------------------------------
# Validation (no kernel runs)

def _valid(m=64, n=256, k=256):
    a = jnp.zeros((m, k), jnp.float8_e4m3fn)
    b = jnp.zeros((n, k), jnp.float8_e4m3fn)
    return a, jnp.ones((m, -(-k // 128)), jnp.float32), b, jnp.ones((-(-n // 128), -(-k // 128)), jnp.float32)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a, sa, b, sb: (a.astype(jnp.bfloat16), sa, b, sb), "a must be float8_e4m3fn"),
        (lambda a, sa, b, sb: (a, sa.astype(jnp.bfloat16), b, sb), "a_scale must be float32"),
        (lambda a, sa, b, sb: (a, sa, b[:, :128], sb), "contraction sizes differ"),
        (lambda a, sa, b, sb: (a, sa[:, :1], b, sb), r"a_scale has shape \(64, 1\)"),
        (lambda a, sa, b, sb: (a, sa, b, sb[:1]), "b_scale_inv has shape"),
        (lambda a, sa, b, sb: (a[None], sa, b, sb), "a must have rank 2"),
    ],
)
def test_rejects_bad_operands(mutate, match):
    with pytest.raises(ValueError, match=match):
        fp8_gemm_mgpu(*mutate(*_valid()))


def test_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match=r"K % 128 == 0, got K=200"):
        fp8_gemm_mgpu(*_valid(k=200))
    with pytest.raises(ValueError, match=r"N % 256 == 0 .*got N=384"):
        fp8_gemm_mgpu(*_valid(n=384), config=N_SPLIT)
    with pytest.raises(ValueError, match=r"N % 128 == 0 .*got N=192"):
        fp8_gemm_mgpu(*_valid(n=192), config=M_SPLIT)


def test_rejects_bad_config_and_flags():
    with pytest.raises(ValueError, match="tile_m must be 64 or 128"):
        MgpuGemmConfig(tile_m=32)
    with pytest.raises(ValueError, match="tile_n must be 64 or 128"):
        MgpuGemmConfig(tile_n=256)
    with pytest.raises(ValueError, match="max_concurrent_steps must be an int >= 2"):
        MgpuGemmConfig(max_concurrent_steps=1)
    with pytest.raises(ValueError, match="wg_dimension must be a MatmulDimension"):
        MgpuGemmConfig(wg_dimension="M")
    with pytest.raises(ValueError, match="k_splits must be a positive int"):
        MgpuGemmConfig(k_splits=0)
    with pytest.raises(ValueError, match="cluster_n must be 1 or 2"):
        MgpuGemmConfig(cluster_n=4)
    with pytest.raises(ValueError, match=r"N % 256 == 0 .*got N=128"):  # a cluster of two 128-wide CTA tiles
        fp8_gemm_mgpu(*_valid(n=128), config=dataclasses.replace(M_SPLIT, cluster_n=2))
    with pytest.raises(ValueError, match="shared memory"):
        fp8_gemm_mgpu(*_valid(), config=MgpuGemmConfig(tile_m=128, max_concurrent_steps=8))
    with pytest.raises(ValueError, match="config must be a MgpuGemmConfig"):
        fp8_gemm_mgpu(*_valid(), config=G.DEFAULT_CONFIG.__dict__)
    with pytest.raises(ValueError, match="interpret must be None, a bool"):
        fp8_gemm_mgpu(*_valid(), interpret="yes")
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        fp8_gemm_mgpu(*_valid(), out_dtype=jnp.int8)


def test_default_config_choice():
    assert G.default_config(64, 4096) == G.DECODE_CONFIG
    assert G.default_config(64, 384) == G.DEFAULT_CONFIG  # N not a multiple of 256
    assert G.default_config(2048, 4096) == G.DECODE_CONFIG
    assert G.default_config(2049, 4096) == G.DEFAULT_CONFIG
    assert G.supports(64, 4096, 4096) and G.supports(64, 384, 4096)
    assert not G.supports(64, 4096, 4000)  # K not a multiple of 128
    assert not G.supports(4096, 200, 4096)  # N not a multiple of the 128-wide CTA tile
    assert G.supports(256, 128, 128) and not G.supports(256, 128, 200)  # K blocks of 128 only
    assert not G.supports(256, 128, 128, dataclasses.replace(M_SPLIT, cluster_n=2))  # N covers no cluster
    for cfg in G.SWEEP_CONFIGS + G.DECODE_SWEEP_CONFIGS:  # the benchmark sweeps fit in shared memory (bf16 out)
        assert cfg.smem_bytes(jnp.bfloat16) <= G._SMEM_BYTES


def test_default_config_fits_shared_memory_with_float32_out():
    # the tuned M = 256, N = 6144 config of the H200 table: 128 x 64 tiles, 4 stages; bf16 out fits, f32 does not
    tuned = G.MgpuGemmConfig(128, 64, G.MatmulDimension.M, 4, G.MatmulDimension.N, 1)
    assert tuned.smem_bytes(jnp.bfloat16) <= G._SMEM_BYTES < tuned.smem_bytes(jnp.float32)
    fitted = G.fit_shared_memory(tuned, jnp.float32)
    assert fitted == dataclasses.replace(tuned, max_concurrent_steps=3)
    assert fitted.smem_bytes(jnp.float32) <= G._SMEM_BYTES
    assert G.fit_shared_memory(tuned, jnp.bfloat16) == tuned  # untouched where it fits
    assert G.fit_shared_memory(G.DEFAULT_CONFIG, jnp.float32) == G.DEFAULT_CONFIG


def test_w8a8_policy_dispatches_to_the_mosaic_kernel(monkeypatch):
    """W8A8Policy with Kernels.PALLAS runs this kernel for shapes it supports and the Triton kernel
    (masked edges) otherwise; both agree with the reference path (interpret mode here)."""
    from fp8rl_jax.models.policy import Proj, Site
    from fp8rl_jax.quant.policy import Kernels, W8A8Policy
    from pallas_kernels import fp8_gemm as T

    calls = []
    for mod, name in ((G, "fp8_gemm_mgpu"), (T, "fp8_gemm")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **kw: (calls.append(_n), _o(*a, **kw))[1])
    site = Site(0, Proj.Q)
    for (m, n, k), expect in (((6, 128, 512), "fp8_gemm_mgpu"), ((6, 96, 512), "fp8_gemm"), ((6, 128, 200), "fp8_gemm")):
        x, w, *_ = _operands(m, n, k, seed=m + n)
        qw = quantize_weight_blockwise(w)
        calls.clear()
        out = W8A8Policy("float32", kernels=Kernels.PALLAS).dot(x, qw, site)
        assert calls == [expect]
        ref = W8A8Policy("float32", kernels=Kernels.REFERENCE).dot(x, qw, site)
        assert _rel_err(out, ref) < TOL_INTERPRET[jnp.float32]


def test_tuning_table_lookup(tmp_path, monkeypatch):
    """`default_config` takes a measured entry for this device kind, (M bucket, N, K), and only that."""
    import json

    entry = {"device_kind": "TestGPU", "m_bucket": 256, "n": 4096, "k": 4096,
             "config": G.config_dict(MgpuGemmConfig(128, 64, MatmulDimension.M, 3))}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": [entry, dict(entry, device_kind="OtherGPU", n=1024)]}))
    monkeypatch.setattr(G, "TUNING_FILE", path)
    monkeypatch.setattr(G, "_device_kind", lambda: "TestGPU")
    G._tuning.cache_clear()
    try:
        assert G.default_config(200, 4096, 4096) == MgpuGemmConfig(128, 64, MatmulDimension.M, 3)  # bucket 256
        assert G.default_config(300, 4096, 4096) == G.DECODE_CONFIG  # bucket 512: no entry
        assert G.default_config(256, 1024, 4096) == G.DECODE_CONFIG  # measured on another device kind
        assert G.default_config(256, 4096) == G.DECODE_CONFIG  # no K: no lookup
    finally:
        G._tuning.cache_clear()


def test_missing_or_unreadable_tuning_table_warns_once_naming_it(tmp_path, monkeypatch):
    """A table that is absent (a wheel built without its package data) or not JSON is a RuntimeWarning naming
    the file, once per file; the kernel then takes its untuned default. An optional table (``required=False``)
    may be absent quietly."""
    import warnings

    from pallas_kernels import common

    monkeypatch.setattr(common, "_WARNED", set())
    monkeypatch.setattr(G, "_device_kind", lambda: "TestGPU")
    bad = tmp_path / "garbled.json"
    bad.write_text("{not json")
    for path in (tmp_path / "absent.json", bad):
        monkeypatch.setattr(G, "TUNING_FILE", path)
        G._tuning.cache_clear()
        try:
            with pytest.warns(RuntimeWarning, match=path.name):
                assert G.default_config(256, 4096, 4096) == G.DECODE_CONFIG
            G._tuning.cache_clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the second read of the same file is quiet
                assert common.tuning_entries(path, "TestGPU") == []
        finally:
            G._tuning.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a table the package does not ship may be absent quietly
        assert common.tuning_entries(tmp_path / "site_measured.json", "TestGPU", required=False) == []
    with pytest.warns(RuntimeWarning, match=bad.name):  # but one that is there must be readable
        monkeypatch.setattr(common, "_WARNED", set())
        assert common.tuning_entries(bad, "TestGPU", required=False) == []


def test_merged_tuning_replaces_measured_shapes_only(tmp_path):
    import json

    def entry(kind, m, n, k, ms):
        return {"device_kind": kind, "m_bucket": m, "n": n, "k": k, "config": {}, "ms": ms}

    path = tmp_path / "t.json"
    old = [entry("H200", 256, 4096, 4096, 1.0), entry("H200", 256, 1024, 4096, 2.0), entry("H100", 256, 4096, 4096, 3.0)]
    path.write_text(json.dumps({"entries": old}))
    new = [entry("H200", 256, 4096, 4096, 0.5), entry("H200", 256, 6144, 4096, 0.7)]
    merged = merged_tuning(path, new)
    assert sorted((e["device_kind"], e["n"], e["ms"]) for e in merged) == [
        ("H100", 4096, 3.0), ("H200", 1024, 2.0), ("H200", 4096, 0.5), ("H200", 6144, 0.7)]
    assert merged_tuning(tmp_path / "absent.json", new) == new


@pytest.mark.parametrize("config", [c for c in G.SWEEP_CONFIGS + G.DECODE_SWEEP_CONFIGS + G.OVERLAP_CONFIGS
                                    if c.cluster_n > 1 or c.overlap_promotion], ids=str)
def test_cluster_and_overlap_configs_lower_for_cuda(config):
    """The clustered (TMA multicast) and overlapped-promotion sweep configs pass the Mosaic GPU
    lowering for CUDA on the CPU (layouts, cluster barriers, shared memory) at the fused q/k/v shape;
    PTX and timing need the H200."""
    import functools

    m, n, k = 256, 6144, 4096
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, k // 128), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n // 128, k // 128), jnp.float32))
    f = jax.jit(functools.partial(G._fp8_gemm_mgpu, out_dtype=jnp.bfloat16,
                                  config=dataclasses.replace(config, num_sms=132), interpret=None))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
