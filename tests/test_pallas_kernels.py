"""Pallas kernels: the same cases in interpret mode on the CPU and natively on the GPU.

Each kernel has a base class whose cases run with ``INTERPRET = True`` (CPU,
always) and a ``@pytest.mark.gpu`` twin with ``INTERPRET = False`` (skipped
without a GPU by conftest). Interpret-mode shapes and tiles are small so the
file runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.numerics import fp8
from pallas_kernels import fp8_gemm as fg
from pallas_kernels import fp8_quant as fq
from pallas_kernels.common import triton_ir_for_sm90

# ----------------------------------------------------------------------------
# Quantization


def _bits_equal(got: tuple, want: tuple) -> None:
    """``(q, scale_inv)`` pairs equal bit for bit (E4M3 codes, float32 128x128 block scales)."""
    (got_q, got_s), (want_q, want_s) = got, want
    assert got_q.shape == want_q.shape and got_q.dtype == want_q.dtype == jnp.float8_e4m3fn
    assert got_s.shape == want_s.shape and got_s.dtype == jnp.float32
    assert got_s.shape[-2:] == (-(-got_q.shape[-2] // 128), -(-got_q.shape[-1] // 128))
    gq, wq = np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8)
    n_bad = int(np.sum(gq != wq))
    assert n_bad == 0, f"{n_bad} of {gq.size} fp8 codes differ"
    gs, ws = np.asarray(got_s).view(np.uint32), np.asarray(want_s).view(np.uint32)
    assert np.array_equal(gs, ws), f"scales differ: {np.asarray(got_s)} vs {np.asarray(want_s)}"


QUANT_CASES = [
    # (shape, dtype, config)
    ((300, 200), jnp.bfloat16, None),  # partial edge blocks on both axes
    ((128, 128), jnp.float32, None),  # exactly one block
    ((2, 130, 260), jnp.bfloat16, None),  # stacked [E, N, K], partial edges
    ((257, 384), jnp.float32, fq.QuantConfig(256, 256, 8)),  # larger tiles, partial tile and scale block
    ((3, 64, 100), jnp.float32, fq.QuantConfig(128, 256)),  # everything smaller than one tile
]


class TestQuantInterpret:
    INTERPRET = True

    @pytest.mark.parametrize("shape,dtype,config", QUANT_CASES, ids=lambda v: str(v))
    def test_bit_exact_vs_reference(self, shape, dtype, config):
        rng = np.random.default_rng(sum(shape))
        w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0)
        w = jnp.asarray(w, dtype)
        got = fq.quantize_weight(w, config, interpret=self.INTERPRET)
        _bits_equal(got, fq.quantize_weight_reference(w))

    def test_special_blocks(self):
        # All-zero block -> scale 1.0 and zero codes; tiny block -> floored scale;
        # huge block saturates at 448 without NaN.
        rng = np.random.default_rng(7)
        w = rng.standard_normal((256, 384)).astype(np.float32)
        w[:128, :128] = 0.0
        # Tiny but normal float32 (|x| in [1e-37, 4e-37]): the GPU flushes float32
        # subnormals to zero (Triton and XLA:GPU alike), the CPU does not.
        w[128:, :128] = np.sign(w[128:, :128]) * rng.uniform(1.0, 4.0, (128, 128)) * 1e-37
        w[:128, 128:256] *= 3e38 / np.abs(w[:128, 128:256]).max()
        w = jnp.asarray(w)
        got = fq.quantize_weight(w, interpret=self.INTERPRET)
        _bits_equal(got, fq.quantize_weight_reference(w))
        q, s = got
        s = np.asarray(s)
        assert s[0, 0] == 1.0 and s[1, 0] == np.finfo(np.float32).tiny
        assert not np.isnan(np.asarray(q.astype(jnp.float32))).any()


    @pytest.mark.parametrize("rows", [(256, 128, 128), (128, 384, 200)], ids=str)
    def test_concat_is_the_concatenation_of_the_parts(self, rows):
        """`quantize_weight_concat`: each part quantized into its rows of one buffer (aliased kernel
        launches) equals the reference of the concatenated weight, bit for bit (a partial last part
        included); jitted, as the weight sync runs it."""
        rng = np.random.default_rng()
        parts = [jnp.asarray(rng.standard_normal((n, 384)) * rng.uniform(0.01, 3.0), jnp.bfloat16) for n in rows]
        got = jax.jit(lambda ps: fq.quantize_weight_concat(ps, interpret=self.INTERPRET))(parts)
        _bits_equal(got, fq.quantize_weight_reference(jnp.concatenate(parts)))


@pytest.mark.gpu
class TestQuantGpu(TestQuantInterpret):
    INTERPRET = False

    def test_real_size_bf16(self):
        w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 1024, 4096)), jnp.bfloat16)
        for cfg in fq.SWEEP_CONFIGS:
            _bits_equal(fq.quantize_weight(w, cfg, interpret=False), fq.quantize_weight_reference(w))


class TestQuantValidation:
    def test_errors(self):
        with pytest.raises(ValueError, match="rank 2"):
            fq.quantize_weight(jnp.zeros((4,)))
        with pytest.raises(ValueError, match="bfloat16 or float32"):
            fq.quantize_weight(jnp.zeros((4, 4), jnp.float16))
        with pytest.raises(ValueError, match="zero-size"):
            fq.quantize_weight(jnp.zeros((0, 4)))
        with pytest.raises(ValueError, match="multiple of 128"):
            fq.QuantConfig(block_n=100)
        with pytest.raises(ValueError, match="QuantConfig"):
            fq.quantize_weight(jnp.zeros((4, 4)), config=(128, 128))
        ok = jnp.zeros((128, 256))
        with pytest.raises(ValueError, match="part 0 has N=100, not a multiple of 128"):
            fq.quantize_weight_concat([jnp.zeros((100, 256)), ok])
        with pytest.raises(ValueError, match="one K and one dtype"):
            fq.quantize_weight_concat([ok, jnp.zeros((128, 128))])
        with pytest.raises(ValueError, match="one K and one dtype"):
            fq.quantize_weight_concat([ok, ok.astype(jnp.bfloat16)])
        with pytest.raises(ValueError, match="block_n == 128"):
            fq.quantize_weight_concat([ok], config=fq.QuantConfig(256, 256))
        with pytest.raises(ValueError, match="non-empty"):
            fq.quantize_weight_concat([ok, jnp.zeros((0, 256))])


# ----------------------------------------------------------------------------
# GEMM

# max |out - ref| / max |ref|, keyed by out dtype. f32 out: the kernel and the
# reference sum the same exact fp8 products in a different order (~1e-7). bf16
# out: one bf16 rounding (2**-8 relative) plus the above.
GEMM_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}

GEMM_CASES = [
    # (M, N, K, config)
    (5, 300, 200, fg.GemmConfig(16, 32, 4, 2)),  # M < tile, partial N and K blocks
    (32, 64, 256, fg.GemmConfig(16, 16, 4, 2)),  # aligned: unmasked path, BN < 128
    (40, 130, 130, fg.GemmConfig(32, 64, 4, 2)),  # partial everywhere, N spans two scale blocks
    (16, 256, 128, fg.GemmConfig(16, 256, 4, 2)),  # BN > 128: two weight scale blocks per tile
    # split-K: 5 K blocks as 3 + 2, masked edges; 8 blocks as 4 x 2, aligned; more splits than blocks (2 used)
    (40, 130, 640, fg.GemmConfig(32, 64, 4, 2, k_splits=2)),
    (32, 256, 1024, fg.GemmConfig(16, 128, 4, 2, k_splits=4)),
    (16, 64, 256, fg.GemmConfig(16, 64, 4, 2, k_splits=8)),
    # swap_ab (the tile transposed, one weight scale per K step) and preloaded scales (steps padded to a power of
    # two: 3 of 4 preloaded in a split of 5 blocks as 3 + 2, whose scale rows end at 7), masked and aligned
    (5, 300, 200, fg.GemmConfig(16, 32, 4, 2, swap_ab=True)),
    (40, 130, 640, fg.GemmConfig(32, 64, 4, 2, k_splits=2, swap_ab=True, preload_scales=True)),
    (32, 256, 1024, fg.GemmConfig(16, 128, 4, 2, k_splits=4, swap_ab=True, preload_scales=True)),
    (40, 130, 640, fg.GemmConfig(32, 64, 4, 2, k_splits=2, preload_scales=True)),
    (16, 64, 384, fg.GemmConfig(16, 64, 4, 2, preload_scales=True)),
    # prefetched scales (each step loads the next's; the last reloads its own), with and without splits and swap_ab
    (5, 300, 200, fg.GemmConfig(16, 32, 4, 2, prefetch_scales=True)),
    (40, 130, 640, fg.GemmConfig(32, 64, 4, 2, k_splits=2, swap_ab=True, prefetch_scales=True)),
    (40, 130, 640, fg.GemmConfig(32, 64, 4, 2, swap_ab=True, prefetch_scales=True)),
    # swap_ab over several 128-row scale blocks (one accumulator and scale each, A loaded once a step): N = 300 ends
    # inside the second 256-row tile, whose upper block lies wholly past N (its scale index clamped, stores masked)
    (40, 300, 640, fg.GemmConfig(32, 256, 4, 2, k_splits=2, swap_ab=True, prefetch_scales=True)),
    (17, 520, 384, fg.GemmConfig(16, 256, 4, 2, swap_ab=True, preload_scales=True)),
    (64, 768, 1024, fg.GemmConfig(64, 384, 8, 2, k_splits=3, swap_ab=True)),
    (32, 256, 1024, fg.GemmConfig(16, 128, 4, 2, k_splits=3, prefetch_scales=True)),
]


def _gemm_operands(m, n, k, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.5, 4.0, size=(m, 1)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    qa, sa = fp8.quantize_activations(jnp.asarray(x, jnp.bfloat16))
    qw = fp8.quantize_weight_blockwise(jnp.asarray(w, jnp.bfloat16))
    return x, w, qa, sa, qw


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


class TestGemmInterpret:
    INTERPRET = True
    TOL = GEMM_TOL

    @pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    @pytest.mark.parametrize("m,n,k,config", GEMM_CASES, ids=lambda v: str(v))
    def test_vs_reference(self, m, n, k, config, out_dtype):
        _, _, qa, sa, qw = _gemm_operands(m, n, k, seed=m * 1000 + n + k)
        got = fg.fp8_gemm(qa, sa, qw.q, qw.scale_inv, out_dtype=out_dtype, config=config,
                          interpret=self.INTERPRET)
        assert got.shape == (m, n) and got.dtype == jnp.dtype(out_dtype)
        want = fg.fp8_gemm_reference(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32)
        err = _rel_err(got, want)
        assert err <= self.TOL[jnp.dtype(out_dtype)], f"rel err {err:.2e}"

    @pytest.mark.parametrize("m,n,k,config", [
        (40, 130, 640, fg.GemmConfig(32, 64, 4, 2)),
        (40, 130, 640, fg.GemmConfig(32, 64, 4, 2, k_splits=2, swap_ab=True, prefetch_scales=True)),
        (40, 130, 640, fg.GemmConfig(32, 64, 4, 2, k_splits=2, swap_ab=True, preload_scales=True)),  # padded rows
    ], ids=lambda v: str(v))
    def test_scales_transposed(self, m, n, k, config):
        # a_scale_t: the activation scales as the quantization kernels write them ([K/128, M]), the same products
        _, _, qa, sa, qw = _gemm_operands(m, n, k, seed=m + n + k + 1)
        want = fg.fp8_gemm(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32, config=config, interpret=self.INTERPRET)
        got = fg.fp8_gemm(qa, jnp.asarray(np.asarray(sa).T), qw.q, qw.scale_inv, out_dtype=jnp.float32,
                          config=config, interpret=self.INTERPRET, a_scale_t=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        ref = fg.fp8_gemm_reference(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32)
        assert _rel_err(got, ref) <= self.TOL[jnp.dtype(jnp.float32)]

    def test_zero_scale_rows(self):
        # Padded tokens quantize to zero codes with unit scales: their output rows are exactly 0.
        m, n, k = 16, 32, 128
        x = np.zeros((m, k), np.float32)
        x[::2] = np.random.default_rng(3).standard_normal((m // 2, k))
        qa, sa = fp8.quantize_activations(jnp.asarray(x))
        qw = fp8.quantize_weight_blockwise(jnp.asarray(np.random.default_rng(4).standard_normal((n, k)), jnp.float32))
        got = np.asarray(fg.fp8_gemm(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32,
                                     config=fg.GemmConfig(16, 16, 4, 2), interpret=self.INTERPRET))
        assert np.all(got[1::2] == 0.0)
        err = _rel_err(got, fg.fp8_gemm_reference(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32))
        assert err <= self.TOL[jnp.dtype(jnp.float32)], f"rel err {err:.2e}"


# On the H200 the FP8 wgmma accumulates each 128-wide K block with reduced
# precision (DeepSeek-V3 reports ~14 bits; measured here: 1.2e-4 to 2.1e-4 of
# max |out| for K = 1024..4096), so float32 output gets a wider bound there.
GEMM_TOL_GPU = {**GEMM_TOL, jnp.dtype(jnp.float32): 1e-3}


@pytest.mark.gpu
class TestGemmGpu(TestGemmInterpret):
    INTERPRET = False
    TOL = GEMM_TOL_GPU

    @pytest.mark.parametrize("m,n,k", [(64, 1024, 4096), (300, 4096, 4096), (2048, 1024, 1024)])
    def test_real_size_all_configs(self, m, n, k):
        _, _, qa, sa, qw = _gemm_operands(m, n, k, seed=m + n + k)
        want = fg.fp8_gemm_reference(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32)
        for cfg in fg.SWEEP_CONFIGS:
            got = fg.fp8_gemm(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32, config=cfg, interpret=False)
            err = _rel_err(got, want)
            assert err <= self.TOL[jnp.dtype(jnp.float32)], f"{cfg}: rel err {err:.2e}"


    @pytest.mark.parametrize("m", [64, 128, 256])
    def test_decode_configs(self, m):
        # the generator's decode sizes, every split-K / swap_ab / preload / prefetch config
        n, k = 1024, 4096
        _, _, qa, sa, qw = _gemm_operands(m, n, k, seed=m + 7)
        want = fg.fp8_gemm_reference(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32)
        for cfg in fg.DECODE_CONFIGS:
            got = fg.fp8_gemm(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32, config=cfg, interpret=False)
            err = _rel_err(got, want)
            assert err <= self.TOL[jnp.dtype(jnp.float32)], f"{cfg}: rel err {err:.2e}"


class TestGemmReference:
    @pytest.mark.parametrize("m,n,k", [(5, 300, 200), (64, 256, 512), (3, 17, 1000)])
    def test_reference_vs_float64(self, m, n, k):
        # The reference equals the exact (float64) product of the dequantized
        # operands within float32 accumulation error: each 128-block dot sums
        # exact products (<= 127 roundings), two scale multiplies, then kb adds,
        # so |err| <= (128 + kb + 2) * 2**-24 * (|A| @ |B|^T) to first order.
        _, _, qa, sa, qw = _gemm_operands(m, n, k, seed=m + n + k)
        a64 = np.asarray(fp8.dequantize_activations(qa, sa, dtype=jnp.float32), np.float64)
        b64 = np.asarray(qw.dequantize(jnp.float32), np.float64)
        exact = a64 @ b64.T
        bound = (128 + -(-k // 128) + 2) * 2.0**-24 * (np.abs(a64) @ np.abs(b64).T)
        got = np.asarray(fg.fp8_gemm_reference(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32), np.float64)
        assert np.all(np.abs(got - exact) <= bound + 1e-30)

    def test_quantization_error_vs_bf16(self):
        # Separately: W8A8 block quantization error against the unquantized
        # product stays at the level of E4M3's 3 mantissa bits (~2**-4 per
        # element, averaging down over K).
        x, w, qa, sa, qw = _gemm_operands(64, 256, 512, seed=11)
        exact = x.astype(np.float64) @ w.astype(np.float64).T
        got = np.asarray(fg.fp8_gemm_reference(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.float32), np.float64)
        rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert rel < 5e-2, rel

    def test_errors(self):
        _, _, qa, sa, qw = _gemm_operands(8, 32, 128, seed=0)
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            fg.fp8_gemm(qa.astype(jnp.bfloat16), sa, qw.q, qw.scale_inv)
        with pytest.raises(ValueError, match="contraction sizes differ"):
            fg.fp8_gemm(qa, sa, qw.q[:, :64], qw.scale_inv)
        with pytest.raises(ValueError, match="a_scale has shape"):
            fg.fp8_gemm(qa, sa[:4], qw.q, qw.scale_inv)
        with pytest.raises(ValueError, match=r"a_scale \(a_scale_t=True\) has shape \(8, 1\), expected"):
            fg.fp8_gemm(qa, sa, qw.q, qw.scale_inv, a_scale_t=True)  # not transposed
        with pytest.raises(ValueError, match="float32"):
            fg.fp8_gemm(qa, sa.T.astype(jnp.bfloat16), qw.q, qw.scale_inv, a_scale_t=True)
        with pytest.raises(ValueError, match="b_scale_inv has shape"):
            fg.fp8_gemm(qa, sa, qw.q, jnp.zeros((2, 1), jnp.float32))
        with pytest.raises(ValueError, match="float32"):
            fg.fp8_gemm(qa, sa.astype(jnp.bfloat16), qw.q, qw.scale_inv)
        with pytest.raises(ValueError, match="out_dtype"):
            fg.fp8_gemm(qa, sa, qw.q, qw.scale_inv, out_dtype=jnp.int32)
        with pytest.raises(ValueError, match="multiple of 16"):
            fg.GemmConfig(block_m=8)
        with pytest.raises(ValueError, match="swap_ab needs block_n dividing 128 or a multiple of it"):
            fg.GemmConfig(block_n=192, swap_ab=True)
        with pytest.raises(ValueError, match="preload_scales must be a bool"):
            fg.GemmConfig(preload_scales=1)

    def test_preload_steps(self):
        # a power of two >= the steps, while the scales fit the register budget; else 0 (per-step loads)
        cfg = fg.GemmConfig(128, 64, 4, 4, k_splits=2, swap_ab=True, preload_scales=True)
        assert [fg.preload_steps(cfg, s) for s in (1, 3, 16, 24, 48)] == [1, 4, 16, 32, 0]
        assert fg.preload_steps(dataclasses.replace(cfg, preload_scales=False), 16) == 0
        wide = dataclasses.replace(cfg, swap_ab=False)  # [P, 128] + [P, 64] scales over 128 threads
        assert [fg.preload_steps(wide, s) for s in (32, 64)] == [32, 0]
        many = fg.GemmConfig(16, 512, 1, 2, swap_ab=True, preload_scales=True)  # [P, 16] + 4 x [P] over 32 threads
        assert [fg.preload_steps(many, s) for s in (64, 65)] == [64, 0]
        assert [fg.preload_steps(dataclasses.replace(many, swap_ab=False), s) for s in (2, 3)] == [2, 0]

    def test_config_specs(self):
        # the command lines' notation (experiments.bench decode_gemms --triton-configs, inspect_triton_codegen --gemm-configs)
        assert fg.GemmConfig.from_spec("64,64,4,4,2,swap,prefetch") == fg.GemmConfig(
            64, 64, 4, 4, k_splits=2, swap_ab=True, prefetch_scales=True)
        assert fg.GemmConfig.from_spec(" 128, 64,8,3,1") == fg.GemmConfig(128, 64, 8, 3)
        for cfg in (*fg.DECODE_CONFIGS, *fg.SWEEP_CONFIGS):
            assert fg.GemmConfig.from_spec(cfg.spec()) == cfg
        for bad in ("64,64,4,4", "64,64,4,4,2,swap,fast", "64,x,4,4,2", ""):
            with pytest.raises(ValueError, match="spec is block_m,block_n"):
                fg.GemmConfig.from_spec(bad)
        with pytest.raises(ValueError, match="multiple of 16"):
            fg.GemmConfig.from_spec("8,64,4,4,1")


# ----------------------------------------------------------------------------
# Lowering to Triton IR for an H200, checked on the CPU (private JAX API: the
# Triton lowering asks the runtime for the GPU's compute capability; we answer
# "H200"). Catches lowering errors before the device run; PTX/SASS generation
# still happens only on the GPU (`pallas_kernels.common.triton_ir_for_sm90`).


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
class TestTritonLowering:
    @pytest.mark.parametrize("config", [fq.DEFAULT_CONFIG, *fq.SWEEP_CONFIGS], ids=str)
    def test_quant_lowers(self, config):
        w = jax.ShapeDtypeStruct((2, 300, 200), jnp.bfloat16)
        with triton_ir_for_sm90():
            text = fq._quantize_stacked.trace(w, config, False).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text

    @pytest.mark.parametrize("config", [fg.DEFAULT_CONFIG, *fg.SWEEP_CONFIGS, *fg.DECODE_CONFIGS, GEMM_CASES[0][3],
                                        fg.GemmConfig(128, 256, 8, 4, swap_ab=True, prefetch_scales=True)], ids=str)
    @pytest.mark.parametrize("mnk", [(5, 300, 200), (256, 512, 1024)], ids=str)
    def test_gemm_lowers(self, config, mnk):
        m, n, k = mnk
        kb = -(-k // 128)
        args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, kb), jnp.float32),
                jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((-(-n // 128), kb), jnp.float32))
        with triton_ir_for_sm90():
            lowered = fg._fp8_gemm.trace(*args, jnp.dtype(jnp.bfloat16), config, False)
            text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def test_configs_are_frozen_and_hashable():
    cfg = fq.QuantConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_n = 256  # type: ignore[misc]
    assert hash(fg.GemmConfig()) == hash(fg.GemmConfig())


def test_benchmark_results_record_where_they_ran(tmp_path):
    """Kernel sweeps (``write_results``) and experiments (``fp8rl_jax.environment``) record the
    device, the versions and the date next to their rows."""
    import datetime
    import json

    import flax

    from experiments.bench.tables import write_results
    from fp8rl_jax.environment import run_environment

    write_results(tmp_path / "r.json", [{"ms": 1.0}])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["results"] == [{"ms": 1.0}] and saved["jax"] == jax.__version__
    assert saved["device"] == jax.devices()[0].device_kind and saved["devices"] == jax.device_count()
    assert datetime.datetime.fromisoformat(saved["date"]).tzinfo is not None
    env = run_environment(run="x")
    assert env["flax"] == flax.__version__ and env["run"] == "x" and env["jaxlib"] == saved["jaxlib"]


@pytest.mark.parametrize("name", ["gemm_tune", "grouped_gemm", "quant_kernels"])
def test_kernel_sweeps_are_runner_suites(name):
    """The FP8 kernels' config sweeps run as benchmark-runner suites: registered under their name, and both
    their default flags and their CPU smoke flags parse (the CI smoke run executes the latter)."""
    import argparse

    from experiments.bench.__main__ import load_suite

    suite = load_suite(name)
    parser = argparse.ArgumentParser()
    suite.add_arguments(parser)
    parser.parse_args([])
    assert suite.SMOKE is not None and parser.parse_args(suite.SMOKE)
