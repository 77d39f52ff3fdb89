"""FP8 grouped (MoE) GEMM (`pallas_kernels.fp8_grouped_gemm`): kernel, reference, policy dispatch.

`TestGroupedInterpret` runs the kernel in Pallas interpret mode on the CPU; `TestGroupedGpu` is its
``@pytest.mark.gpu`` twin (``INTERPRET = False``) plus Qwen3-30B-A3B expert sizes. Operands are
quantized from fresh random data with the project's quantizers, so kernel vs reference measures
kernel error only; the reference is checked separately against float64 NumPy, and the FP8 error
against the unquantized product in its own test.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3_moe
from fp8rl_jax.models import Proj, Site, forward, init_params
from fp8rl_jax.numerics import fp8
from fp8rl_jax.quant.policy import Kernels, LayerPolicy, W8A8Policy, quantize_params
from experiments.bench.suites import grouped_gemm as bench
from pallas_kernels import fp8_grouped_gemm as gg
from pallas_kernels.common import triton_ir_for_sm90
from pallas_kernels.fp8_grouped_gemm import GroupedGemmConfig as Cfg

# max |out - ref| / max |ref| keyed by out dtype. f32: kernel and reference sum the same exact fp8
# products in another order (~1e-7). bf16 / f16: one output rounding (2**-8 / 2**-11) on top.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}
# On the H200 the FP8 wgmma accumulates each 128-wide K block with reduced precision (measured
# 1.2e-4 .. 2.1e-4 of max |out| for the dense sibling), hence a wider float32 bound there.
TOL_GPU = {**TOL, jnp.dtype(jnp.float32): 1e-3}

CASES = {
    # name: (M, N, K, group_sizes, config)
    # empty group, sizes not multiples of the tile, tiles straddling groups, rows past the sum
    # (zeros), partial N and K blocks.
    "ragged_tail_partial_nk": (50, 200, 300, [10, 0, 17, 3, 15], Cfg(16, 64, 4, 2)),
    # every token in one expert; M not a multiple of the tile; N, K aligned (unmasked loads);
    # the other launch order (work items fastest).
    "one_expert": (40, 64, 256, [0, 0, 40, 0], Cfg(16, 32, 4, 2, n_fastest=False)),
    # groups aligned to tiles, M/N/K aligned: the unmasked path everywhere, one trailing empty group.
    "aligned": (64, 128, 128, [16, 16, 32, 0], Cfg(16, 128, 4, 2)),
    # BN > 128: two weight scale blocks per tile; M smaller than one tile holding five groups.
    "bn256_one_tile_many_groups": (24, 256, 200, [5, 7, 0, 3, 9], Cfg(32, 256, 4, 2)),
    # no rows routed at all: the whole output is the zero tail.
    "all_empty": (20, 48, 130, [0, 0, 0], Cfg(16, 16, 4, 2)),
    # swap_ab (tiles computed transposed, one weight scale per K step): the ragged case; the other
    # launch order with a tile narrower than a scale block; two N tiles per 128-row scale block.
    "swap_ragged_tail_partial_nk": (50, 200, 300, [10, 0, 17, 3, 15], Cfg(16, 64, 4, 2, swap_ab=True)),
    "swap_one_expert_items_fastest": (40, 96, 256, [0, 0, 40, 0], Cfg(16, 32, 4, 2, n_fastest=False, swap_ab=True)),
    "swap_aligned_bn128": (64, 256, 128, [16, 16, 32, 0], Cfg(32, 128, 4, 2, swap_ab=True)),
}


def _operands(m, n, k, sizes, seed):
    rng = np.random.default_rng(seed)
    e = len(sizes)
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.5, 4.0, size=(m, 1)).astype(np.float32)
    # experts of different magnitude, so a wrong expert or block scale shows
    w = (rng.standard_normal((e, n, k)) * rng.uniform(0.01, 0.2, size=(e, 1, 1))).astype(np.float32)
    qa, sa = fp8.quantize_activations(jnp.asarray(x, jnp.bfloat16))
    qw = fp8.quantize_weight_blockwise(jnp.asarray(w, jnp.bfloat16))
    return x, w, qa, sa, qw, jnp.asarray(sizes, jnp.int32)


def _exact(qa, sa, qw, sizes) -> np.ndarray:
    """float64 NumPy: row r of group g times dequantized expert g; rows past the sum are 0."""
    a = np.asarray(fp8.dequantize_activations(qa, sa, dtype=jnp.float32), np.float64)
    b = np.asarray(qw.dequantize(jnp.float32), np.float64)
    out = np.zeros((a.shape[0], b.shape[1]))
    start = 0
    for g, s in enumerate(np.asarray(sizes)):
        out[start:start + s] = a[start:start + s] @ b[g].T
        start += s
    return out


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


# Interpret mode compiles a program per shape and config (seconds on the CPU): the interpret twin leaves out
# "aligned" (its unmasked loads are one_expert's, its trailing empty group ragged_tail's) and checks the preloaded
# scales on the ragged swap_ab case only; the GPU twin runs every case.
INTERPRET_CASES = [c for c in CASES if c != "aligned"]
SWAP_CASES = [c for c in CASES if CASES[c][4].swap_ab]


class TestGroupedInterpret:
    INTERPRET = True
    TOL = TOL

    @pytest.mark.parametrize("case", INTERPRET_CASES)
    def test_vs_reference_and_float64(self, case):
        m, n, k, sizes, config = CASES[case]
        _, _, qa, sa, qw, gs = _operands(m, n, k, sizes, seed=m * 1000 + n + k)
        got = gg.fp8_grouped_gemm(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32, config=config,
                                  interpret=self.INTERPRET)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        got = np.asarray(got)
        tail = int(np.sum(sizes))
        assert np.all(got[tail:] == 0.0), "rows past sum(group_sizes) must be exactly 0"
        if tail == 0:
            return
        want = gg.fp8_grouped_gemm_reference(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32)
        tol = self.TOL[jnp.dtype(jnp.float32)]
        assert (err := _rel_err(got, want)) <= tol, f"vs reference: rel err {err:.2e}"
        assert (err := _rel_err(got, _exact(qa, sa, qw, sizes))) <= tol, f"vs float64: rel err {err:.2e}"

    @pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
    def test_out_dtypes(self, out_dtype):
        m, n, k, sizes, config = CASES["ragged_tail_partial_nk"]
        _, _, qa, sa, qw, gs = _operands(m, n, k, sizes, seed=5)
        got = gg.fp8_grouped_gemm(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=out_dtype, config=config,
                                  interpret=self.INTERPRET)
        assert got.dtype == jnp.dtype(out_dtype)
        want = gg.fp8_grouped_gemm_reference(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32)
        assert (err := _rel_err(got, want)) <= self.TOL[jnp.dtype(out_dtype)], f"rel err {err:.2e}"


    @pytest.mark.parametrize("case", ["swap_ragged_tail_partial_nk"])
    def test_preloaded_scales_bit_identical(self, case):
        """Scales of every K step loaded before the K loop (the default) give the very bits of scales
        loaded inside it: each step's pick is a one-hot sum, and the padded steps never run."""
        m, n, k, sizes, config = CASES[case]
        _, _, qa, sa, qw, gs = _operands(m, n, k, sizes, seed=7)
        assert gg.preload_scales(config, -(-k // 128))
        got = [np.asarray(gg.fp8_grouped_gemm(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32,
                                              config=dataclasses.replace(config, preload_scales=p),
                                              interpret=self.INTERPRET)) for p in (True, False)]
        np.testing.assert_array_equal(got[0], got[1])


    @pytest.mark.parametrize("case", ["swap_ragged_tail_partial_nk", "ragged_tail_partial_nk"])
    def test_transposed_activation_scales(self, case):
        """``a_scale_t``: the scales in the kernel's [K/128, M] order (what `quantize_activations_t` writes,
        the W8A8 policy's call) give the very bits of the [M, K/128] call."""
        m, n, k, sizes, config = CASES[case]
        x, _, qa, sa, qw, gs = _operands(m, n, k, sizes, seed=11)
        qa_t, sa_t = fp8.quantize_activations_t(jnp.asarray(x, jnp.bfloat16))
        np.testing.assert_array_equal(np.asarray(sa_t), np.asarray(sa).T)
        got = [np.asarray(gg.fp8_grouped_gemm(a, s_, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32, config=config,
                                              interpret=self.INTERPRET, a_scale_t=t))
               for a, s_, t in ((qa, sa, False), (qa_t, sa_t, True))]
        np.testing.assert_array_equal(got[0], got[1])
        with pytest.raises(ValueError, match=r"a_scale \(a_scale_t=True\) has shape"):
            gg.fp8_grouped_gemm(qa, sa, qw.q, qw.scale_inv, gs, config=config, interpret=self.INTERPRET, a_scale_t=True)


@pytest.mark.gpu
class TestGroupedGpu(TestGroupedInterpret):
    INTERPRET = False
    TOL = TOL_GPU

    @pytest.mark.parametrize("case", list(CASES))
    def test_vs_reference_and_float64(self, case):
        super().test_vs_reference_and_float64(case)

    @pytest.mark.parametrize("case", SWAP_CASES)
    def test_preloaded_scales_bit_identical(self, case):
        super().test_preloaded_scales_bit_identical(case)

    # Each sweep config once, on a Qwen3-30B-A3B expert shape (gate/up or down, 128 experts,
    # top-8 routing), alternating uniform and skewed routing and decode / prefill token counts.
    @pytest.mark.parametrize("i", range(len(gg.SWEEP_CONFIGS)))
    def test_qwen3_30b_experts(self, i):
        cfg = gg.SWEEP_CONFIGS[i]
        (n, k), tokens = ((768, 2048), (2048, 768))[i % 2], (32, 512, 1000)[i % 3]
        gs = bench.route(jax.random.key(i), tokens, bench.ROUTINGS[(i // 2) % 2])
        m = tokens * bench.BENCH_TOP_K
        rng = np.random.default_rng(i)
        qa, sa = fp8.quantize_activations(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16))
        qw = fp8.quantize_weight_blockwise(jax.random.normal(jax.random.key(n), (bench.BENCH_E, n, k), jnp.bfloat16))
        want = gg.fp8_grouped_gemm_reference(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32)
        got = gg.fp8_grouped_gemm(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32, config=cfg, interpret=False)
        assert (err := _rel_err(got, want)) <= self.TOL[jnp.dtype(jnp.float32)], f"{cfg}: rel err {err:.2e}"


def _expected_items(sizes, m, bm):
    """Plain-Python list of (group, tile, lo, hi, steps>0) work items, tail group E last."""
    e = len(sizes)
    bounds, start = [], 0
    for s in sizes:
        end = min(start + max(s, 0), m)
        bounds.append((start, end))
        start = end
    bounds.append((start, m))
    items = []
    for g, (lo, hi) in enumerate(bounds):
        for t in range(m // bm + 1):
            r0, r1 = max(lo, t * bm), min(hi, (t + 1) * bm)
            if r0 < r1:
                items.append((min(g, e - 1), t, r0, r1, g < e))
    return items


class TestGroupedReference:
    @pytest.mark.parametrize("seed", range(6))
    def test_work_items_cover_each_row_once(self, seed):
        rng = np.random.default_rng(seed)
        e, bm = int(rng.integers(1, 9)), int(rng.choice([16, 32, 64]))
        m = int(rng.integers(1, 200))
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.full(e, 0.3))).tolist()
        # jitted: one compile per shape instead of an eager dispatch (and compile) per op
        meta = np.asarray(jax.jit(gg.work_items, static_argnums=(1, 2, 3))(jnp.asarray(sizes, jnp.int32), m, bm, 3))
        assert meta.shape == (5, gg.num_work_items(m, e, bm))
        want = _expected_items(sizes, m, bm)
        got = [(int(g), int(t), int(lo), int(hi), bool(st)) for g, t, lo, hi, st in meta.T if hi > lo]
        assert got == want
        assert set(meta[4].tolist()) <= {0, 3}, "K steps are all or nothing"
        assert np.all(meta[4][meta[3] <= meta[2]] == 0), "padding items must run no K steps"
        covered = np.zeros(m, int)
        for _, _, lo, hi, _ in got:
            covered[lo:hi] += 1
        assert np.all(covered == 1)

    def test_work_items_have_no_loop(self):
        """The work items are a few fusions, no while loop: ``searchsorted``'s default method is a loop
        of ~log2(E) tiny steps, which the GPU would run three times per MoE layer at every decode step."""
        hlo = jax.jit(lambda gs: gg.work_items(gs, 2048, 16, 16)).lower(jnp.zeros(128, jnp.int32)).compile().as_text()
        assert "while" not in hlo

    @pytest.mark.parametrize("m,n,k,sizes", [(30, 70, 300, [7, 0, 20]), (9, 17, 1000, [2, 3, 0, 1])], ids=str)
    def test_reference_vs_float64(self, m, n, k, sizes):
        # Each 128-block dot sums exact fp8 products (<= 127 roundings), two scale multiplies,
        # then kb adds: |err| <= (128 + kb + 2) * 2**-24 * (|A| @ |B_g|^T) to first order.
        _, _, qa, sa, qw, gs = _operands(m, n, k, sizes, seed=m + n + k)
        a = np.asarray(fp8.dequantize_activations(qa, sa, dtype=jnp.float32), np.float64)
        b = np.asarray(qw.dequantize(jnp.float32), np.float64)
        gid = np.repeat(np.arange(len(sizes)), sizes)
        absprod = np.zeros((m, n))
        for r, g in enumerate(gid):
            absprod[r] = np.abs(b[g]) @ np.abs(a[r])
        bound = (128 + -(-k // 128) + 2) * 2.0**-24 * absprod
        got = np.asarray(gg.fp8_grouped_gemm_reference(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32))
        exact = _exact(qa, sa, qw, sizes)
        assert np.all(np.abs(got - exact) <= bound + 1e-30)
        assert np.all(got[len(gid):] == 0.0)

    def test_quantization_error_vs_unquantized(self):
        # W8A8 block quantization error against the float64 product of the unquantized inputs:
        # E4M3's 3 mantissa bits (~2**-4 per element), averaging down over K.
        sizes = [20, 0, 30, 14]
        x, w, qa, sa, qw, gs = _operands(64, 256, 512, sizes, seed=11)
        xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
        wb = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)
        gid = np.repeat(np.arange(len(sizes)), sizes)
        exact = np.stack([wb[g] @ xb[r] for r, g in enumerate(gid)])
        got = np.asarray(gg.fp8_grouped_gemm_reference(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.float32))
        rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert rel < 5e-2, rel

    def test_errors(self):
        _, _, qa, sa, qw, gs = _operands(8, 32, 128, [3, 5], seed=0)
        call = gg.fp8_grouped_gemm
        with pytest.raises(ValueError, match="a must be float8_e4m3fn"):
            call(qa.astype(jnp.bfloat16), sa, qw.q, qw.scale_inv, gs)
        with pytest.raises(ValueError, match="b must have rank 3"):
            call(qa, sa, qw.q[0], qw.scale_inv, gs)
        with pytest.raises(ValueError, match="contraction sizes differ"):
            call(qa, sa, qw.q[:, :, :64], qw.scale_inv, gs)
        with pytest.raises(ValueError, match="group_sizes has shape"):
            call(qa, sa, qw.q, qw.scale_inv, gs[:1])
        with pytest.raises(ValueError, match="group_sizes must be an integer"):
            call(qa, sa, qw.q, qw.scale_inv, gs.astype(jnp.float32))
        with pytest.raises(ValueError, match="a_scale has shape"):
            call(qa, sa[:4], qw.q, qw.scale_inv, gs)
        with pytest.raises(ValueError, match="b_scale_inv has shape"):
            call(qa, sa, qw.q, qw.scale_inv[:, :, :0], gs)
        with pytest.raises(ValueError, match="b_scale_inv must be float32"):
            call(qa, sa, qw.q, qw.scale_inv.astype(jnp.bfloat16), gs)
        with pytest.raises(ValueError, match="out_dtype"):
            call(qa, sa, qw.q, qw.scale_inv, gs, out_dtype=jnp.int32)
        with pytest.raises(ValueError, match="GroupedGemmConfig or None"):
            call(qa, sa, qw.q, qw.scale_inv, gs, config=(16, 16))
        with pytest.raises(ValueError, match="multiple of 16"):
            Cfg(block_m=8)
        with pytest.raises(ValueError, match="positive int"):
            Cfg(num_warps=0)
        with pytest.raises(ValueError, match="n_fastest must be a bool"):
            Cfg(n_fastest=1)
        with pytest.raises(ValueError, match="swap_ab must be a bool"):
            Cfg(swap_ab=1)
        with pytest.raises(ValueError, match="swap_ab with FP8 operands needs block_n dividing 128"):
            call(qa, sa, qw.q, qw.scale_inv, gs, config=Cfg(16, 256, swap_ab=True))
        cfg = Cfg()
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.block_m = 32  # type: ignore[misc]

    def test_route(self):
        uniform, skewed = (np.asarray(bench.route(jax.random.key(2), 512, r)) for r in bench.ROUTINGS)
        for gs in (uniform, skewed):  # top-k experts are distinct: at most one row per token per expert
            assert gs.shape == (bench.BENCH_E,) and gs.sum() == 512 * bench.BENCH_TOP_K and gs.max() <= 512
        assert skewed.max() > 2 * uniform.max()


# ----------------------------------------------------------------------------
# Lowering to Triton IR for an H200 on the CPU (private JAX API; see test_pallas_kernels.py):
# catches lowering errors before the device run (`pallas_kernels.common.triton_ir_for_sm90`).


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("config", [gg.DEFAULT_CONFIG, *gg.SWEEP_CONFIGS], ids=str)
def test_triton_lowering(config):
    for m, n, k, e in ((50, 200, 300, 5), (512, 768, 2048, 128)):
        kb = -(-k // 128)
        args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m, kb), jnp.float32),
                jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((e, -(-n // 128), kb), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.int32))
        with triton_ir_for_sm90():
            lowered = gg._fp8_grouped_gemm.trace(*args, jnp.dtype(jnp.bfloat16), config, False)
            text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.skipif(os.environ.get("FP8RL_TRITON_FP8_MMAV2", "") not in ("", "0"),
                    reason="FP8RL_TRITON_FP8_MMAV2 keeps Triton's mma.sync fallback")
def test_fp8_dots_may_use_wgmma():
    """`enable_fp8_wgmma`: FP8 dots reach Triton with ``maxNumImpreciseAcc`` = their K (128 here), so
    Hopper runs them on wgmma (without it Triton takes the float16 mma.sync fallback); float dots
    are built as before (no attribute)."""
    from jax._src.pallas.triton import lowering

    from pallas_kernels import common

    assert common.enable_fp8_wgmma() and common.enable_fp8_wgmma()  # installed once, idempotent
    assert lowering.tt_dialect.dot.__wrapped__ is not None
    S = jax.ShapeDtypeStruct
    m, n, k, e = 64, 256, 256, 4
    fp8_args = (S((m, k), jnp.float8_e4m3fn), S((m, 2), jnp.float32), S((e, n, k), jnp.float8_e4m3fn),
                S((e, 2, 2), jnp.float32), S((e,), jnp.int32))
    with triton_ir_for_sm90() as captured:
        gg._fp8_grouped_gemm.trace(*fp8_args, jnp.dtype(jnp.bfloat16), Cfg(16, 64, swap_ab=True), False).lower(
            lowering_platforms=("cuda",))
        gg._grouped_gemm.trace(S((m, k), jnp.bfloat16), S((e, n, k), jnp.bfloat16), S((e,), jnp.int32),
                               jnp.dtype(jnp.bfloat16), Cfg(16, 64), False).lower(lowering_platforms=("cuda",))
    fp8_ir, bf16_ir = captured
    assert re.search(r"tt\.dot .*maxNumImpreciseAcc = 128 : i32.*f8E4M3FN", fp8_ir), fp8_ir[-2000:]
    assert "tt.dot" in bf16_ir and "maxNumImpreciseAcc" not in bf16_ir


def test_preload_scales_only_where_they_fit():
    """Preloaded scales (swap_ab tiles only) take registers for the whole K loop: [kb, block_m] activation
    scales plus kb weight scales, kb padded to a power of two, at most `_PRELOAD_REGS` per thread."""
    assert gg.preload_scales(Cfg(16, 128, 4, 4, swap_ab=True), 16)  # 30B-A3B gate/up: 16 x 17 floats
    assert gg.preload_scales(Cfg(16, 64, 4, 4, swap_ab=True), 96)  # K = 12288: 128 x 17 over 128 threads
    assert not gg.preload_scales(Cfg(64, 128, 4, 4, swap_ab=True), 96)  # 128 x 65
    assert not gg.preload_scales(Cfg(64, 128, 4, 3), 16)  # no swap_ab: in the loop (measured faster)
    assert not gg.preload_scales(Cfg(16, 64, 4, 4, swap_ab=True, preload_scales=False), 16)
    assert [gg._next_pow2(x) for x in (1, 2, 3, 6, 16, 17)] == [1, 2, 4, 8, 16, 32]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_preloaded_scales_leave_the_k_loop():
    """The Triton IR of the K loop: with preloaded scales its only loads are the A and B tiles (Triton
    pipelines them as cp.async); with scales loaded inside it, two more plain global loads per K step,
    which Triton does not pipeline (the TTGIR places them after the wgmma wait, before the next cp.async)."""
    S = jax.ShapeDtypeStruct
    m, n, k, e = 384, 768, 2048, 128  # a shape no other test lowers (a cached lowering captures no IR)
    args = (S((m, k), jnp.float8_e4m3fn), S((m, k // 128), jnp.float32), S((e, n, k), jnp.float8_e4m3fn),
            S((e, n // 128, k // 128), jnp.float32), S((e,), jnp.int32))
    loads = []
    for preload in (True, False):
        cfg = Cfg(16, 128, 4, 4, swap_ab=True, preload_scales=preload)
        with triton_ir_for_sm90() as captured:
            gg._fp8_grouped_gemm.trace(*args, jnp.dtype(jnp.bfloat16), cfg, False).lower(lowering_platforms=("cuda",))
        loop = captured[0].split("scf.for", 1)[1].split("scf.yield", 1)[0]
        loads.append(len(re.findall(r"tt\.load", loop)))
    assert loads == [2, 4], loads


def test_tuning_table_lookup(tmp_path, monkeypatch):
    """`default_config` (the policy's choice) takes a measured entry for this device kind and (M bucket,
    N, K), and only that; a swap_ab entry whose block_n does not divide 128 is not used; without one,
    decode sizes get `DECODE_CONFIG`, larger M `DEFAULT_CONFIG`."""
    import json

    entry = {"device_kind": "TestGPU", "m_bucket": 2048, "n": 768, "k": 2048,
             "config": dataclasses.asdict(Cfg(16, 64, 4, 4, swap_ab=True))}
    bad = dict(entry, n=2048, k=768, config=dataclasses.asdict(Cfg(16, 256, 4, 4, swap_ab=True)))
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": [entry, bad, dict(entry, device_kind="OtherGPU", n=1536)]}))
    monkeypatch.setattr(gg, "TUNING_FILE", path)
    monkeypatch.setattr(gg, "_device_kind", lambda: "TestGPU")
    gg._tuning.cache_clear()
    try:
        assert gg.default_config(2000, 768, 2048) == Cfg(16, 64, 4, 4, swap_ab=True)  # bucket 2048
        assert gg.default_config(2049, 768, 2048) == gg.DEFAULT_CONFIG  # bucket 4096: no entry
        assert gg.default_config(4096, 1536, 2048) == gg.DEFAULT_CONFIG  # measured on another device kind
        assert gg.default_config(4096, 2048, 768) == gg.DEFAULT_CONFIG  # unusable entry
        # no usable entry at decode sizes: the decode default (swap_ab 16-row tiles), not the 64-row one
        assert gg.default_config(2048, 1536, 2048) == gg.default_config(2048, 2048, 768) == gg.DECODE_CONFIG
        assert gg.DECODE_CONFIG.swap_ab and gg.preload_scales(gg.DECODE_CONFIG, 16)
    finally:
        gg._tuning.cache_clear()


# ----------------------------------------------------------------------------
# The policy's dispatch


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the policy's calls into the grouped kernel (so a test sees the dispatch happen)."""
    calls = []
    real = gg.fp8_grouped_gemm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gg, "fp8_grouped_gemm", spy)
    return calls


def test_policy_ragged_dot_pallas_matches_reference_path(kernel_calls):
    """W8A8Policy.ragged_dot with Kernels.PALLAS (interpret mode here) runs the grouped kernel and
    equals the reference path."""
    rng = np.random.default_rng(21)
    sizes = jnp.asarray([3, 0, 9, 1, 0, 7, 4, 0], jnp.int32)  # tiny MoE: 8 experts, M = 24
    x = jnp.asarray(rng.standard_normal((24, 64)), jnp.float32)
    qw = fp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((8, 32, 64)) * 0.1, jnp.float32))
    site = Site(0, Proj.EXPERT_UP)
    tol_f32 = (TOL_GPU if jax.default_backend() == "gpu" else TOL)[jnp.dtype(jnp.float32)]  # native there
    for dtype, tol in (("float32", tol_f32), ("bfloat16", 1e-2)):
        ref = W8A8Policy(dtype, kernels=Kernels.REFERENCE).ragged_dot(x, qw, sizes, site)
        assert not kernel_calls
        pal = W8A8Policy(dtype, kernels=Kernels.PALLAS).ragged_dot(x, qw, sizes, site)
        assert kernel_calls.pop() == (24, 64)
        assert pal.dtype == ref.dtype == jnp.dtype(dtype)
        assert (err := _rel_err(pal, ref)) <= tol, f"{dtype}: rel err {err:.2e}"


def test_tiny_moe_forward_pallas_matches_reference(kernel_calls):
    """Whole tiny Qwen3-MoE forward: router-built group sizes through the grouped kernel (only the
    experts quantized, so the dense Pallas GEMM's interpret-mode cost stays out of this test)."""
    cfg = dataclasses.replace(tiny_qwen3_moe, num_layers=1)
    experts_only = LayerPolicy(projs=frozenset({Proj.EXPERT_GATE, Proj.EXPERT_UP, Proj.EXPERT_DOWN}))
    params = jax.jit(lambda key: quantize_params(init_params(cfg, key, jnp.float32), cfg, experts_only,
                                                 kernels=Kernels.REFERENCE))(jax.random.key(3))
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)

    def logits(kernels):  # jitted: one compile instead of an eager dispatch per op
        policy = W8A8Policy("float32", kernels=kernels)
        return jax.jit(lambda p, t: forward(p, t, config=cfg, policy=policy)[0])(params, tokens)

    ref = logits(Kernels.REFERENCE)
    assert not kernel_calls
    pal = logits(Kernels.PALLAS)
    assert len(kernel_calls) == 3 * cfg.num_layers  # gate, up, down per MoE layer
    tol = (TOL_GPU if jax.default_backend() == "gpu" else TOL)[jnp.dtype(jnp.float32)]
    assert (err := _rel_err(pal, ref)) <= tol, f"rel err {err:.2e}"
