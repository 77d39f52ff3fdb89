"""pallas_kernels.act_quant: the FP8 linears' input quantization in one pass (SwiGLU + quantization; residual add +
RMSNorm + quantization; plain quantization), each against its jnp twin (the composition the model ran before) and
float64; their use in W8A8Policy (swiglu_dot, norm_dot, dot) and in the generator's fused model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses

from configs.models import tiny_qwen3
from fp8rl_jax.models import forward, init_params
from fp8rl_jax.models.fusion import fuse_params
from fp8rl_jax.models.policy import DensePolicy, Kernels, MatmulPolicy, Proj, Site, rms_norm
from fp8rl_jax.numerics.fp8 import codes_to_float32, quantize_activations, quantize_activations_t
from fp8rl_jax.quant.policy import W8A8Policy, quantize_params, quantize_weight
from pallas_kernels import act_quant as aq
from pallas_kernels.common import triton_ir_for_sm90

SITE = Site(0, Proj.DOWN)


def _gu(m: int, i: int, seed: int, scale: float = 3.0) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), (m, 2 * i), jnp.float32) * scale).astype(jnp.bfloat16)


def _deq64(q, s, scales_t: bool) -> np.ndarray:
    s = np.asarray(s, np.float64)
    s = s.T if scales_t else s
    return np.asarray(codes_to_float32(q), np.float64) * np.repeat(s, aq.GROUP, axis=1)


def _silu_mul64(gu) -> np.ndarray:
    g, u = np.split(np.asarray(gu.astype(jnp.float32), np.float64), 2, axis=1)
    return g / (1.0 + np.exp(-g)) * u


# Interpret mode compiles a program per kernel shape (seconds on the CPU): the interpret twins run the edge cases (one
# row, one group; widths that are not a power of two; both scale layouts; the widest), the GPU twins every case.
SWIGLU_CASES = [(8, 256, True), (24, 384, False), (1, 128, True), (3, 512, False), (40, 1024, True)]
SWIGLU_CASES_INTERPRET = [(24, 384, False), (1, 128, True), (40, 1024, True)]


class TestInterpret:
    """On the CPU the kernel body runs through XLA:CPU, as the reference does: bit for bit."""

    INTERPRET = True

    @pytest.mark.parametrize("m,i,scales_t", SWIGLU_CASES_INTERPRET, ids=str)
    def test_matches_the_composition(self, m, i, scales_t):
        gu = _gu(m, i, seed=m * 7 + i)
        gu = gu.at[0, : aq.GROUP].set(0).at[0, i: i + aq.GROUP].set(0)  # an all-zero group: scale 1
        gu = gu.at[-1, 5].set(3e4).at[-1, i + 5].set(3e4)  # a huge value next to small ones
        q, s = aq.silu_mul_quant(gu, scales_t=scales_t, interpret=self.INTERPRET)
        qr, sr = aq.silu_mul_quant_reference(gu, scales_t=scales_t)
        assert q.dtype == jnp.float8_e4m3fn and q.shape == (m, i)
        assert s.shape == ((i // aq.GROUP, m) if scales_t else (m, i // aq.GROUP)) == sr.shape
        self.check(q, s, qr, sr, gu, scales_t)

    def check(self, q, s, qr, sr, gu, scales_t):
        np.testing.assert_array_equal(np.asarray(codes_to_float32(q)), np.asarray(codes_to_float32(qr)))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))
        # and the product it quantizes is SwiGLU's: E4M3's half-ulp (2^-4) of each group's max, plus bf16 rounding
        x, ref = _deq64(q, s, scales_t), _silu_mul64(gu)
        bound = 2.0 ** -4 * np.repeat(np.asarray(s, np.float64).T if scales_t else np.asarray(s, np.float64),
                                      aq.GROUP, axis=1) * 448 + 2.0 ** -7 * np.abs(ref)
        assert np.all(np.abs(x - ref) <= bound)


@pytest.mark.gpu
class TestGpu(TestInterpret):
    """On the GPU the exponential and the reference's divisions are each implementation's own (module note): an
    element of x may round to the neighbouring bf16 value. On the H200 0.08-0.16% of the codes differ from
    XLA:GPU's. So: at most 0.5% of the codes differ, each by one E4M3 step; scales agree within a
    bf16 ulp; and against float64 the kernel is as accurate as the reference."""

    INTERPRET = False

    @pytest.mark.parametrize("m,i,scales_t", SWIGLU_CASES, ids=str)
    def test_matches_the_composition(self, m, i, scales_t):
        super().test_matches_the_composition(m, i, scales_t)

    def check(self, q, s, qr, sr, gu, scales_t):
        a, b = np.asarray(codes_to_float32(q)), np.asarray(codes_to_float32(qr))
        diff = a != b
        assert np.mean(diff) <= 5e-3, np.mean(diff)
        step = np.maximum(np.maximum(np.abs(a), np.abs(b)) * 2.0 ** -3, 2.0 ** -9)  # E4M3: 3 mantissa bits
        assert np.all(np.abs(a - b)[diff] <= step[diff])
        np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=2.0 ** -7)
        x64 = _silu_mul64(gu)
        err = np.mean(np.abs(_deq64(q, s, scales_t) - x64))
        err_ref = np.mean(np.abs(_deq64(qr, sr, scales_t) - x64))
        assert err <= 1.02 * err_ref, (err, err_ref)

    def test_decode_size(self):
        gu = _gu(256, 12288, seed=3)
        q, s = aq.silu_mul_quant(gu, interpret=False)
        self.check(q, s, *aq.silu_mul_quant_reference(gu), gu, True)


def test_validation():
    with pytest.raises(ValueError, match="bfloat16"):
        aq.silu_mul_quant(jnp.zeros((4, 256), jnp.float32))
    with pytest.raises(ValueError, match="multiple of 128"):
        aq.silu_mul_quant(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match="power of two"):
        aq.ActQuantConfig(block_m=12)
    assert aq.supports((256, 24576)) and not aq.supports((256, 300)) and not aq.supports((2, 3, 256))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("scales_t", [True, False])
def test_lowers_to_triton_for_h200(scales_t):
    gu = jax.ShapeDtypeStruct((256, 24576), jnp.bfloat16)
    with triton_ir_for_sm90():
        text = aq._call.trace(gu, scales_t, aq.DEFAULT_CONFIG, False).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_policy_swiglu_dot_runs_the_kernel_and_equals_the_composition(monkeypatch):
    """W8A8Policy.swiglu_dot with the kernels (interpret mode here) gives dot(silu(g) * u) bit for bit and goes
    through silu_mul_quant; a BF16 weight, an unsupported width or the reference kernels take dot's path."""
    i, n = 256, 128
    gu = _gu(6, i, seed=1)
    w = quantize_weight(jax.random.normal(jax.random.key(2), (n, i), jnp.float32) * 0.05, kernels=Kernels.REFERENCE)
    calls = []
    real = aq.silu_mul_quant
    monkeypatch.setattr(aq, "silu_mul_quant", lambda *a, **k: calls.append(1) or real(*a, **k))
    pol = W8A8Policy("bfloat16", kernels=Kernels.PALLAS)
    g, u = jnp.split(gu, 2, axis=-1)
    got = pol.swiglu_dot(gu[None], w, SITE)
    assert calls and got.shape == (1, 6, n)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                  np.asarray(pol.dot(jax.nn.silu(g) * u, w, SITE), np.float32))
    calls.clear()
    ref = W8A8Policy("bfloat16", kernels=Kernels.REFERENCE)
    np.testing.assert_array_equal(np.asarray(ref.swiglu_dot(gu, w, SITE), np.float32),
                                  np.asarray(ref.dot(jax.nn.silu(g) * u, w, SITE), np.float32))
    wd = jax.random.normal(jax.random.key(3), (n, i), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(pol.swiglu_dot(gu, wd, SITE), np.float32),
                                  np.asarray(DensePolicy("bfloat16").dot(jax.nn.silu(g) * u, wd, SITE), np.float32))
    gu3 = _gu(6, 192, seed=4)  # I = 192: not whole quantization groups, the kernel does not take it
    w3 = quantize_weight(jax.random.normal(jax.random.key(5), (n, 192), jnp.float32) * 0.05, kernels=Kernels.REFERENCE)
    g3, u3 = jnp.split(gu3, 2, axis=-1)
    np.testing.assert_array_equal(np.asarray(pol.swiglu_dot(gu3, w3, SITE), np.float32),
                                  np.asarray(pol.dot(jax.nn.silu(g3) * u3, w3, SITE), np.float32))
    assert not calls


# --- add_rms_norm_quant and quantize_1x128 ---------------------------------------------------------------------------


def _rows(m: int, d: int, seed: int, scale: float = 2.0) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), (m, d), jnp.float32) * scale).astype(jnp.bfloat16)


def _norm_inputs(m: int, d: int, seed: int, residual: bool):
    x = _rows(m, d, seed)
    x = x.at[-1, 3].set(2e4)  # one huge element: its row's other groups quantize near zero
    r = _rows(m, d, seed + 1, 0.5) if residual else None
    w = (1.0 + 0.2 * jax.random.normal(jax.random.key(seed + 2), (d,), jnp.float32)).astype(jnp.bfloat16)
    w = w.at[: aq.GROUP].set(0)  # a zero weight group: an all-zero group, scale 1
    return x, r, w


def _norm64(x, r, w, eps) -> np.ndarray:
    h = np.asarray(x.astype(jnp.float32), np.float64)
    if r is not None:
        h = np.asarray((x + r).astype(jnp.float32), np.float64)  # the stream is bf16, as the model keeps it
    return np.asarray(w.astype(jnp.float32), np.float64) * h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + eps)


NORM_CASES = [(8, 256, True, True), (3, 512, False, False), (16, 1024, True, False), (5, 128, False, True),
              (32, 4096, True, True)]
# the interpret twin of the quantizing norm: one group, both residual and scale layouts, exact and wide rows
NORM_CASES_INTERPRET = [(16, 1024, True, False), (5, 128, False, True), (32, 4096, True, True)]


def _close_codes(q, s, qr, sr, y64, scales_t):
    """The kernel's codes against the composition's where the row's float32 sum of squares may round differently
    (another summation order, another ``rsqrt``) or the other side's division is not IEEE (XLA:GPU): at most 0.5% of
    the codes move (or 16 in a small array: 11 of 3 x 384 do on the H200), each by one E4M3 step;
    scales within a bf16 ulp; no less accurate against float64."""
    a, b = np.asarray(codes_to_float32(q)), np.asarray(codes_to_float32(qr))
    diff = a != b
    assert np.sum(diff) <= max(5e-3 * diff.size, 16), np.mean(diff)
    step = np.maximum(np.maximum(np.abs(a), np.abs(b)) * 2.0 ** -3, 2.0 ** -9)  # E4M3: 3 mantissa bits
    assert np.all(np.abs(a - b)[diff] <= step[diff])
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=2.0 ** -7)
    err = np.mean(np.abs(_deq64(q, s, scales_t) - y64))
    err_ref = np.mean(np.abs(_deq64(qr, sr, scales_t) - y64))
    assert err <= 1.02 * err_ref, (err, err_ref)


class TestNormInterpret:
    """The residual add + RMSNorm + quantization kernel on the CPU. XLA:CPU sums a row of up to 1024 in the same
    order whether it reduces the kernel's block or the whole matrix, and then the codes are the composition's bit for
    bit; wider rows (2048+) are vectorized into another order, and the float32 mean of squares can differ in its last
    bit (a few codes then move one step, as on the GPU)."""

    INTERPRET = True

    @pytest.mark.parametrize("m,d,residual,scales_t", NORM_CASES_INTERPRET, ids=str)
    def test_matches_the_composition(self, m, d, residual, scales_t):
        x, r, w = _norm_inputs(m, d, seed=m + d, residual=residual)
        eps = 1e-6
        got = aq.add_rms_norm_quant(x, w, eps, residual=r, scales_t=scales_t, interpret=self.INTERPRET)
        ref = aq.add_rms_norm_quant_reference(x, w, eps, residual=r, scales_t=scales_t)
        assert len(got) == (3 if residual else 2) == len(ref)
        if residual:  # the residual stream: exact on every path (one bf16 add)
            assert got[0].dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32))
        q, s = got[-2:]
        assert q.dtype == jnp.float8_e4m3fn and q.shape == (m, d)
        assert s.shape == ((d // aq.GROUP, m) if scales_t else (m, d // aq.GROUP)) == ref[-1].shape
        y64 = _norm64(x, r, w, eps)
        self.check(q, s, *ref[-2:], y64, scales_t, exact=d <= 1024)
        # and what it quantizes is the norm: E4M3's half-ulp of each group's max, plus bf16 roundings
        s64 = np.asarray(s, np.float64)
        bound = 2.0 ** -4 * np.repeat(s64.T if scales_t else s64, aq.GROUP, axis=1) * 448 + 2.0 ** -6 * np.abs(y64)
        assert np.all(np.abs(_deq64(q, s, scales_t) - y64) <= bound)

    def check(self, q, s, qr, sr, y64, scales_t, exact):
        if not exact:
            return _close_codes(q, s, qr, sr, y64, scales_t)
        np.testing.assert_array_equal(np.asarray(codes_to_float32(q)), np.asarray(codes_to_float32(qr)))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))

    @pytest.mark.parametrize("m,k,scales_t", [(8, 256, True), (3, 384, False), (64, 4096, True)], ids=str)
    def test_plain_is_quantize_activations(self, m, k, scales_t):
        x = _rows(m, k, seed=k).at[0, : aq.GROUP].set(0).at[-1, 7].set(-3e4)
        q, s = aq.quantize_1x128(x, scales_t=scales_t, interpret=self.INTERPRET)
        qr, sr = (quantize_activations_t if scales_t else quantize_activations)(x)
        np.testing.assert_array_equal(np.asarray(codes_to_float32(q)), np.asarray(codes_to_float32(qr)))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))


@pytest.mark.gpu
class TestNormGpu(TestNormInterpret):
    """On the GPU ``rsqrt`` and the row sum's order are the kernel's own (module note): every size is checked as
    `_close_codes` says."""

    INTERPRET = False

    @pytest.mark.parametrize("m,d,residual,scales_t", NORM_CASES, ids=str)
    def test_matches_the_composition(self, m, d, residual, scales_t):
        super().test_matches_the_composition(m, d, residual, scales_t)

    def check(self, q, s, qr, sr, y64, scales_t, exact):
        _close_codes(q, s, qr, sr, y64, scales_t)

    @pytest.mark.parametrize("m,k,scales_t", [(8, 256, True), (3, 384, False), (64, 4096, True)], ids=str)
    def test_plain_is_quantize_activations(self, m, k, scales_t):
        """XLA:GPU's float32 division is not the IEEE one the kernel (and the CPU) uses: on the H200 60% of its
        scales are an ulp or two off, and 0.17% of the codes at 64 x 4096 one step. So: scales within
        4 ulps, codes as `_close_codes` says."""
        x = _rows(m, k, seed=k).at[0, : aq.GROUP].set(0).at[-1, 7].set(-3e4)
        q, s = aq.quantize_1x128(x, scales_t=scales_t, interpret=False)
        qr, sr = (quantize_activations_t if scales_t else quantize_activations)(x)
        np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=2.0 ** -21, atol=0)
        _close_codes(q, s, qr, sr, np.asarray(x.astype(jnp.float32), np.float64), scales_t)

    def test_decode_size(self):
        x, r, w = _norm_inputs(256, 4096, seed=9, residual=True)
        got = aq.add_rms_norm_quant(x, w, 1e-6, residual=r, interpret=False)
        ref = aq.add_rms_norm_quant_reference(x, w, 1e-6, residual=r)
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32))
        _close_codes(*got[1:], *ref[1:], _norm64(x, r, w, 1e-6), True)


def test_norm_and_plain_validation():
    x = jnp.zeros((4, 256), jnp.bfloat16)
    w = jnp.ones((256,), jnp.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        aq.add_rms_norm_quant(x.astype(jnp.float32), w, 1e-6)
    with pytest.raises(ValueError, match="bfloat16"):
        aq.add_rms_norm_quant(x, w, 1e-6, residual=x.astype(jnp.float32))
    with pytest.raises(ValueError, match="power of two"):
        aq.add_rms_norm_quant(jnp.zeros((4, 384), jnp.bfloat16), jnp.ones((384,)), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        aq.add_rms_norm_quant(x, w, 1e-6, residual=jnp.zeros((2, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match="norm weight shape"):
        aq.add_rms_norm_quant(x, jnp.ones((128,)), 1e-6)
    with pytest.raises(ValueError, match="multiple of 128"):
        aq.quantize_1x128(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        aq.quantize_1x128(jnp.zeros((4, 256), jnp.float32))
    with pytest.raises(ValueError, match="power of two"):
        aq.NormQuantConfig(block_m=3)
    assert aq.supports_norm((256, 4096)) and not aq.supports_norm((256, 2560)) and not aq.supports_norm((2, 64))
    assert aq.supports_plain((256, 384)) and not aq.supports_plain((256, 200)) and not aq.supports_plain((2, 3, 128))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("scales_t", [True, False])
def test_norm_and_plain_lower_to_triton_for_h200(scales_t):
    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    with triton_ir_for_sm90():
        for res in (x, None):
            text = aq._norm_call.trace(x, res, w, 1e-6, scales_t, aq.DEFAULT_NORM_CONFIG, False).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text
        text = aq._plain_call.trace(x, scales_t, aq.DEFAULT_CONFIG, False).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def _counting(monkeypatch, name: str) -> list:
    calls, real = [], getattr(aq, name)
    monkeypatch.setattr(aq, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_policy_norm_dot_runs_the_kernel_and_equals_the_composition(monkeypatch):
    """W8A8Policy.norm_dot with the kernels (interpret mode) returns the composition's ``(h, y)`` bit for bit, with
    and without a residual, through add_rms_norm_quant; a width that is not a power of two, a BF16 weight or the
    reference kernels take the composition."""
    calls = _counting(monkeypatch, "add_rms_norm_quant")
    pol, site = W8A8Policy("bfloat16", kernels=Kernels.PALLAS), Site(0, Proj.Q)
    for d, expect_kernel in ((256, True), (384, False)):
        x, r, wn = _norm_inputs(6, d, seed=d, residual=True)
        x, r = x.reshape(2, 3, d), r.reshape(2, 3, d)
        w = quantize_weight(jax.random.normal(jax.random.key(d), (128, d), jnp.float32) * 0.05,
                            kernels=Kernels.REFERENCE)
        for res in (r, None):
            calls.clear()
            h, y = pol.norm_dot(x, wn, 1e-6, w, site, res)
            want_h = x if res is None else x + res
            assert bool(calls) == expect_kernel and h.shape == x.shape and y.shape == (2, 3, 128)
            np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
            np.testing.assert_array_equal(np.asarray(y, np.float32),
                                          np.asarray(pol.dot(rms_norm(want_h, wn, 1e-6), w, site), np.float32))
    calls.clear()
    wd = jax.random.normal(jax.random.key(7), (128, 256), jnp.bfloat16)
    x, r, wn = _norm_inputs(4, 256, seed=1, residual=True)
    for p, wt in ((pol, wd), (W8A8Policy("bfloat16", kernels=Kernels.REFERENCE), w_ := quantize_weight(
            jax.random.normal(jax.random.key(8), (128, 256), jnp.float32) * 0.05, kernels=Kernels.REFERENCE))):
        h, y = p.norm_dot(x, wn, 1e-6, wt, site, r)
        np.testing.assert_array_equal(np.asarray(y, np.float32),
                                      np.asarray(p.dot(rms_norm(x + r, wn, 1e-6), wt, site), np.float32))
    assert not calls and w_ is not None


def test_policy_dot_quantizes_in_one_kernel(monkeypatch):
    """W8A8Policy.dot with the kernels quantizes a bf16 activation through quantize_1x128, and gets what the same
    GEMM gives with XLA's quantization, bit for bit (interpret mode here); a width that is not whole groups does
    not take the kernel."""
    calls = _counting(monkeypatch, "quantize_1x128")
    pol, site = W8A8Policy("bfloat16", kernels=Kernels.PALLAS), Site(0, Proj.O)
    x = _rows(10, 256, seed=4).reshape(2, 5, 256)
    w = quantize_weight(jax.random.normal(jax.random.key(5), (128, 256), jnp.float32) * 0.05, kernels=Kernels.REFERENCE)
    got = pol.dot(x, w, site)
    assert calls and got.shape == (2, 5, 128)
    monkeypatch.setattr(aq, "quantize_1x128", _composition_quantize)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(pol.dot(x, w, site), np.float32))
    assert not aq.supports_plain((10, 200))


def _composition_quantize(x, scales_t, **_):
    return (quantize_activations_t if scales_t else quantize_activations)(x)


class _Composition(W8A8Policy):
    """The W8A8 kernels' GEMMs with every activation quantized by the jnp composition (the model before the one-pass
    kernels): norm_dot and swiglu_dot as MatmulPolicy composes them, dot's quantization by XLA."""

    def norm_dot(self, x, weight, eps, w, site, residual=None):
        return MatmulPolicy.norm_dot(self, x, weight, eps, w, site, residual)

    def swiglu_dot(self, gu, w, site):
        return MatmulPolicy.swiglu_dot(self, gu, w, site)


def test_generator_model_equals_the_composition(monkeypatch):
    """The generator's layout (fused q/k/v and gate/up, FP8 weights, bf16) through W8A8Policy with the kernels: the
    residual adds deferred into the next layer's norm kernel, SwiGLU and o_proj's input quantized in one pass each,
    and the logits equal the composition's bit for bit (interpret mode; both compiled without XLA's excess
    precision, which lets fused bf16 ops skip their roundings), every one-pass kernel having run."""
    config = dataclasses.replace(tiny_qwen3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                 intermediate_size=384, num_layers=2)
    params = fuse_params(quantize_params(init_params(config, jax.random.key(1), jnp.bfloat16), config))
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, config.vocab_size)
    counts = {name: _counting(monkeypatch, name) for name in ("add_rms_norm_quant", "silu_mul_quant", "quantize_1x128")}
    def logits(policy):  # traced afresh per call (a new function object): the counts are per trace
        fn = jax.jit(lambda p, t: forward(p, t, config=config, policy=policy)[0])
        # without excess precision: XLA otherwise keeps the composition's fused bf16 intermediates in float32
        # (the kernels round every op to bf16, as the model's ops say and as torch does)
        return fn.lower(params, tokens).compile(compiler_options={"xla_allow_excess_precision": False})(params, tokens)

    got = logits(W8A8Policy("bfloat16", kernels=Kernels.PALLAS))
    assert {k: len(v) for k, v in counts.items()} == {"add_rms_norm_quant": 4, "silu_mul_quant": 2,
                                                      "quantize_1x128": 2}
    monkeypatch.setattr(aq, "quantize_1x128", _composition_quantize)
    want = logits(_Composition("bfloat16", kernels=Kernels.PALLAS))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- residual add + RMSNorm without the quantization (the BF16 linears' input) ---

class TestBf16NormInterpret:
    """`add_rms_norm`: the residual stream exact, the norm bit for bit the composition's on the CPU (rows of up to
    1024; wider ones XLA:CPU sums in another order, checked as on the GPU)."""

    INTERPRET = True

    @pytest.mark.parametrize("m,d,residual,scales_t", NORM_CASES, ids=str)
    def test_matches_the_composition(self, m, d, residual, scales_t):
        del scales_t
        x, r, w = _norm_inputs(m, d, seed=m + d + 7, residual=residual)
        got = aq.add_rms_norm(x, w, 1e-6, residual=r, interpret=self.INTERPRET)
        ref = aq.add_rms_norm_reference(x, w, 1e-6, residual=r)
        assert len(got) == (2 if residual else 1) == len(ref)
        for g, e in zip(got, ref, strict=True):
            assert g.dtype == jnp.bfloat16 and g.shape == (m, d)
        if residual:
            np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32))
        self.check(got[-1], ref[-1], _norm64(x, r, w, 1e-6), exact=d <= 1024)

    def check(self, y, yr, y64, exact):
        if exact:
            return np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(yr, np.float32))
        _close_bf16(y, yr, y64)


def _close_bf16(y, yr, y64):
    """Another rsqrt and sum order: at most 1% of the elements one bf16 step off, and no less accurate against
    float64 than the composition."""
    a, b = np.asarray(y, np.float64), np.asarray(yr, np.float64)
    diff = a != b
    assert np.mean(diff) <= 0.01, np.mean(diff)
    step = np.maximum(np.maximum(np.abs(a), np.abs(b)) * 2.0 ** -7, 2.0 ** -133)
    assert np.all(np.abs(a - b)[diff] <= step[diff])
    assert np.mean(np.abs(a - y64)) <= 1.02 * np.mean(np.abs(b - y64))


@pytest.mark.gpu
class TestBf16NormGpu(TestBf16NormInterpret):
    INTERPRET = False

    def check(self, y, yr, y64, exact):
        _close_bf16(y, yr, y64)


def test_bf16_norm_validation_and_lowering():
    x = jnp.zeros((4, 256), jnp.bfloat16)
    w = jnp.ones((256,), jnp.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        aq.add_rms_norm(x.astype(jnp.float32), w, 1e-6)
    with pytest.raises(ValueError, match="power of two"):
        aq.add_rms_norm(jnp.zeros((4, 384), jnp.bfloat16), jnp.ones((384,), jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        aq.add_rms_norm(x, w, 1e-6, residual=x[:2])
    s = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
    with triton_ir_for_sm90():
        for res in (s, None):
            text = aq._plain_norm_call.trace(s, res, jax.ShapeDtypeStruct((4096,), jnp.bfloat16), 1e-6,
                                             aq.DEFAULT_NORM_CONFIG, False).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text


def test_dense_policy_norm_dot_runs_the_kernel_and_equals_the_composition(monkeypatch):
    """DensePolicy(norm_kernels=PALLAS).norm_dot == the composition bit for bit (bf16, with and without a residual)
    through add_rms_norm; float32, a width the kernel does not take, and the default policy (the trainer's) take the
    composition; and the generator's BF16 layout gives the default policy's logits bit for bit."""
    calls = _counting(monkeypatch, "add_rms_norm")
    site = Site(0, Proj.Q)
    on, off = DensePolicy("bfloat16", norm_kernels=Kernels.PALLAS), DensePolicy("bfloat16")
    for d, expect in ((256, True), (384, False)):
        x, r, wn = _norm_inputs(6, d, seed=d + 3, residual=True)
        x, r = x.reshape(2, 3, d), r.reshape(2, 3, d)
        w = (jax.random.normal(jax.random.key(d), (128, d), jnp.float32) * 0.05).astype(jnp.bfloat16)
        for res in (r, None):
            calls.clear()
            got, want = on.norm_dot(x, wn, 1e-6, w, site, res), off.norm_dot(x, wn, 1e-6, w, site, res)
            assert bool(calls) == expect
            for g, e in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    calls.clear()
    x, r, wn = _norm_inputs(4, 256, seed=5, residual=True)
    f32 = DensePolicy("float32", norm_kernels=Kernels.PALLAS)
    f32.norm_dot(x.astype(jnp.float32), wn, 1e-6, jnp.ones((8, 256), jnp.float32), site, r.astype(jnp.float32))
    off.norm_dot(x, wn, 1e-6, jnp.ones((8, 256), jnp.bfloat16), site, r)
    assert not calls

    config = dataclasses.replace(tiny_qwen3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                 intermediate_size=384, num_layers=2)
    params = fuse_params(init_params(config, jax.random.key(4), jnp.bfloat16))
    tokens = jax.random.randint(jax.random.key(5), (2, 7), 0, config.vocab_size)

    def logits(policy):
        fn = jax.jit(lambda p, t: forward(p, t, config=config, policy=policy)[0])
        return fn.lower(params, tokens).compile(compiler_options={"xla_allow_excess_precision": False})(params, tokens)

    got = logits(on)
    assert len(calls) == 4  # two layers, two norms each
    np.testing.assert_array_equal(np.asarray(got), np.asarray(logits(off)))
