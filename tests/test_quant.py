"""Reference tests for fp8rl_jax.quant (CPU, always run).

Every case draws fresh random inputs and compares the module with an
independent NumPy reference written here (nothing is imported from the module
except the function under test).

Error bound (golden numbers and their derivation)
-------------------------------------------------
A format with m explicit mantissa bits and minimum normal exponent e_min
(E4M3: m = 3, e_min = -6; E5M2: m = 2, e_min = -14) rounds a value y to
nearest even with

  |RNE(y) - y| <= 2^-(m+1) * 2^floor(log2|y|) <= 2^-(m+1) * |y|  if |y| >= 2^e_min,
  |RNE(y) - y| <= 1/2 * 2^(e_min - m)                             otherwise,

(half a step; the subnormal step is 2^-9 for E4M3 and 2^-16 for E5M2). Both
cases are covered by the sum  2^-(m+1)|y| + 2^(e_min-m-1).  With y = x / s and
dequant = q * s:

  |x - dequant| <= 2^-(m+1) |x| + 2^(e_min-m-1) s          (+ float32 slack)
  E4M3: 2^-4 |x| + 2^-10 s          E5M2: 2^-3 |x| + 2^-17 s

The slack, 2^-20 |x|, covers the float32 steps: y is formed as
f32(x * f32(1/s)) (two roundings of 2^-24 relative), the amax element may be
clipped from fmt_max * (1 + 2^-23) to fmt_max, and q * s is rounded once more.

Bit patterns
------------
The module computes q = RNE_fp8(f32(x * f32(1/s))) (see its design note). Two
references:
  * `_ref_codes_f32` repeats those float32 steps in NumPy and casts with
    ml_dtypes -> must be bit-identical everywhere;
  * `_rne_fp8_f64` rounds the exact quotient x / s (float64) with a hand-written
    round-half-even -> may differ, by one fp8 code, exactly where the float32
    product is itself an fp8 rounding midpoint (double rounding: the tie goes
    to the even code, the exact quotient was a hair to one side). We assert
    every difference is such a tie and adjacent. With float32 inputs these are
    ~1e-7 of codes; with bf16 inputs ~1e-3, because x / amax is then often a
    short binary fraction and x / s lands within float32 rounding of a
    midpoint. Dividing in float32 (x / s) instead of multiplying by 1/s would
    round twice as well; only the infinitely precise quotient avoids it.
We do not cast float64 -> fp8 with ml_dtypes: ml_dtypes goes through float32
for that (e.g. 1.0625 + 2^-30 becomes 1.0, not 1.125), which is the very
double rounding we want the exact reference to avoid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8rl_jax.quant import (
    E4M3_MAX,
    E5M2_MAX,
    Fp8Format,
    QuantizedWeight,
    ScaleRounding,
    count_nonfinite,
    dequantize_activations,
    dequantize_weight,
    quantize_activations,
    quantize_activations_t,
    quantize_weight_blockwise,
    quantize_weight_checked,
    saturating_cast,
)

# ---------------------------------------------------------------------------
# Independent reference

_NP_FP8 = {Fp8Format.E4M3: ml_dtypes.float8_e4m3fn, Fp8Format.E5M2: ml_dtypes.float8_e5m2}


class _Spec:
    """Format facts taken from ml_dtypes, not from the module."""

    def __init__(self, fmt: Fp8Format):
        fi = ml_dtypes.finfo(_NP_FP8[fmt])
        self.np_dtype = _NP_FP8[fmt]
        self.max = float(fi.max)
        self.mant = int(fi.nmant)
        self.emin = int(np.log2(float(fi.smallest_normal)))
        self.half_sub_step = float(fi.smallest_subnormal) / 2
        self.rel = 2.0 ** -(self.mant + 1)


SPECS = {f: _Spec(f) for f in Fp8Format}
F32_TINY = float(np.finfo(np.float32).tiny)


def _ref_scale(amax64: np.ndarray, fmt_max: float, pow2: bool = False) -> np.ndarray:
    """float32 scale: amax/fmt_max rounded once to float32; zero -> 1; floor at FLT_MIN."""
    s = np.maximum(amax64 / fmt_max, F32_TINY)
    if pow2:
        s = 2.0 ** np.ceil(np.log2(s.astype(np.float32).astype(np.float64)))
    s = np.where(amax64 == 0, 1.0, s)
    return s.astype(np.float32)


def _ref_block_amax(x64: np.ndarray, bn: int, bk: int) -> np.ndarray:
    *lead, n, k = x64.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = np.zeros((*lead, nb * bn, kb * bk))
    padded[..., :n, :k] = np.abs(x64)
    return padded.reshape(*lead, nb, bn, kb, bk).max(axis=(-3, -1))


def _expand_blocks(s: np.ndarray, bn: int, bk: int, n: int, k: int) -> np.ndarray:
    return np.repeat(np.repeat(s, bn, axis=-2), bk, axis=-1)[..., :n, :k]


def _rne_fp8_f64(y: np.ndarray, spec: _Spec) -> np.ndarray:
    """Exact round-half-even of float64 `y` to the fp8 grid (after clipping), as float64."""
    y = np.clip(y, -spec.max, spec.max)
    _, e = np.frexp(np.abs(y))  # |y| = m * 2^e, m in [0.5, 1)
    exp = np.maximum(e - 1, spec.emin)
    quantum = np.ldexp(1.0, exp - spec.mant)
    return np.round(y / quantum) * quantum  # np.round is half-to-even; y/quantum is exact


def _ref_codes_f32(x32: np.ndarray, scale_full32: np.ndarray, spec: _Spec) -> np.ndarray:
    """The module's float32 steps in NumPy: clip(f32(x * f32(1/s))) cast by ml_dtypes."""
    inv = (np.float32(1.0) / scale_full32).astype(np.float32)
    y = (x32 * inv).astype(np.float32)
    return np.clip(y, -spec.max, spec.max).astype(spec.np_dtype)


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _check_codes(q, x32, scale_full32, spec: _Spec) -> None:
    """Bit-exact vs the float32-steps reference; vs the exact quotient only at ties."""
    q = np.asarray(q)
    np.testing.assert_array_equal(_bits(q), _bits(_ref_codes_f32(x32, scale_full32, spec)))
    exact = _rne_fp8_f64(x32.astype(np.float64) / scale_full32.astype(np.float64), spec)
    got = q.astype(np.float64)
    diff = got != exact
    if diff.any():
        # Double rounding: the float32 product x * f32(1/s) landed exactly on the
        # midpoint between two fp8 codes (round-half-even then picks the even one),
        # while the exact quotient was a hair to one side. Low-precision (bf16)
        # inputs make this common (~1e-3 of codes): x/amax is then often a short
        # binary fraction, so x/s sits within float32 rounding of an fp8 midpoint.
        inv = (np.float32(1.0) / scale_full32).astype(np.float32)
        y32 = np.clip((x32 * inv).astype(np.float32), -spec.max, spec.max)[diff].astype(np.float64)
        np.testing.assert_array_equal(y32, (got[diff] + exact[diff]) / 2)
        a = _bits(q)[diff].astype(int)
        b = _bits(exact[diff].astype(spec.np_dtype)).astype(int)  # exact values: lossless cast
        assert np.all((a & 0x80) == (b & 0x80)) and np.all(np.abs((a & 0x7F) - (b & 0x7F)) == 1)
    assert diff.mean() < 5e-3, f"{diff.sum()} of {diff.size} codes differ from exact RNE"


def _check_error_bound(x64, deq64, scale_full64, spec: _Spec) -> None:
    err = np.abs(x64 - deq64)
    bound = spec.rel * np.abs(x64) + spec.half_sub_step * scale_full64 + 2.0**-20 * np.abs(x64)
    worst = np.max(err - bound)
    assert worst <= 0, f"error bound exceeded by {worst}"


def _random(rng, shape, dtype) -> np.ndarray:
    """Normal values times a log-uniform magnitude over ~6 decades, so many blocks
    contain elements in the fp8 subnormal range after scaling."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-8.0, 6.0, size=shape))
    return x.astype(np.dtype(dtype)).astype(np.float32)  # values exactly representable in `dtype`


# ---------------------------------------------------------------------------
# Weights

WEIGHT_SHAPES = [(256, 384), (300, 200), (3, 130, 257)]


def test_format_constants_match_ml_dtypes():
    assert E4M3_MAX == SPECS[Fp8Format.E4M3].max == Fp8Format.E4M3.max == 448.0
    assert E5M2_MAX == SPECS[Fp8Format.E5M2].max == Fp8Format.E5M2.max == 57344.0
    assert Fp8Format.E4M3.dtype == jnp.float8_e4m3fn
    assert Fp8Format.E5M2.dtype == jnp.float8_e5m2
    assert (SPECS[Fp8Format.E4M3].rel, SPECS[Fp8Format.E4M3].half_sub_step) == (2.0**-4, 2.0**-10)
    assert (SPECS[Fp8Format.E5M2].rel, SPECS[Fp8Format.E5M2].half_sub_step) == (2.0**-3, 2.0**-17)


def test_exact_reference_agrees_with_ml_dtypes_on_float32():
    # Validates _rne_fp8_f64 where ml_dtypes rounds once (float32 input).
    rng = np.random.default_rng(0)
    y = (rng.standard_normal(200_000) * np.exp(rng.uniform(-14, 6, 200_000))).astype(np.float32)
    for spec in SPECS.values():
        ref = np.clip(y, -spec.max, spec.max).astype(spec.np_dtype).astype(np.float64)
        np.testing.assert_array_equal(_rne_fp8_f64(y.astype(np.float64), spec), ref)


@pytest.mark.parametrize("shape", WEIGHT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fmt", list(Fp8Format), ids=lambda f: f.name)
def test_weight_matches_float64_reference(shape, dtype, fmt):
    rng = np.random.default_rng(1)
    spec = SPECS[fmt]
    x32 = _random(rng, shape, dtype)
    w = jnp.asarray(x32, dtype=dtype)

    qw = jax.jit(lambda w: quantize_weight_blockwise(w, fmt=fmt))(w)
    assert isinstance(qw, QuantizedWeight)
    n, k = shape[-2:]
    ref_scale = _ref_scale(_ref_block_amax(x32.astype(np.float64), 128, 128), spec.max)
    assert qw.q.shape == shape and qw.q.dtype == fmt.dtype and qw.shape == shape
    assert qw.scale_inv.dtype == jnp.float32 and qw.block_size == (128, 128)
    np.testing.assert_array_equal(np.asarray(qw.scale_inv), ref_scale)

    scale_full = _expand_blocks(ref_scale, 128, 128, n, k)
    _check_codes(qw.q, x32, scale_full, spec)

    deq = np.asarray(jax.jit(lambda qw: qw.dequantize(jnp.float32))(qw)).astype(np.float64)
    _check_error_bound(x32.astype(np.float64), deq, scale_full.astype(np.float64), spec)
    # The bound is tight: some normal-range element gets close to half an ulp.
    normal = np.abs(x32) > 2.0 ** (spec.emin + 1) * scale_full
    rel = np.abs(x32 - deq)[normal] / np.abs(x32[normal])
    assert rel.max() > 0.8 * spec.rel


def test_weight_non_default_block_and_bf16_output():
    rng = np.random.default_rng(2)
    x32 = _random(rng, (2, 100, 70), jnp.float32)
    qw = quantize_weight_blockwise(jnp.asarray(x32), block_size=(64, 32))
    ref_scale = _ref_scale(_ref_block_amax(x32.astype(np.float64), 64, 32), 448.0)
    assert qw.block_size == (64, 32) and qw.scale_inv.shape == (2, 2, 3)
    np.testing.assert_array_equal(np.asarray(qw.scale_inv), ref_scale)
    _check_codes(qw.q, x32, _expand_blocks(ref_scale, 64, 32, 100, 70), SPECS[Fp8Format.E4M3])
    deq_bf16 = dequantize_weight(qw)
    assert deq_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(deq_bf16), np.asarray(qw.dequantize(jnp.float32).astype(jnp.bfloat16))
    )


# ---------------------------------------------------------------------------
# Activations


@pytest.mark.parametrize("shape", [(16, 256), (7, 200), (2, 5, 300), (3, 1, 64)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_activations_match_float64_reference(shape, dtype):
    rng = np.random.default_rng(3)
    spec = SPECS[Fp8Format.E4M3]
    x32 = _random(rng, shape, dtype)
    q, scale = jax.jit(quantize_activations)(jnp.asarray(x32, dtype=dtype))

    *lead, k = shape
    g = -(-k // 128)
    padded = np.zeros((*lead, g * 128))
    padded[..., :k] = np.abs(x32)
    ref_scale = _ref_scale(padded.reshape(*lead, g, 128).max(axis=-1), spec.max)
    assert q.shape == shape and q.dtype == jnp.float8_e4m3fn and scale.shape == (*lead, g)
    np.testing.assert_array_equal(np.asarray(scale), ref_scale)

    scale_full = np.repeat(ref_scale, 128, axis=-1)[..., :k]
    _check_codes(q, x32, scale_full, spec)
    deq = jax.jit(lambda q, s: dequantize_activations(q, s, dtype=jnp.float32))(q, scale)
    x64, deq64 = x32.astype(np.float64), np.asarray(deq, np.float64)
    _check_error_bound(x64, deq64, scale_full.astype(np.float64), spec)


def test_activations_e5m2_and_group_size():
    rng = np.random.default_rng(4)
    spec = SPECS[Fp8Format.E5M2]
    x32 = _random(rng, (4, 96), jnp.float32)
    q, scale = quantize_activations(jnp.asarray(x32), group_size=32, fmt=Fp8Format.E5M2)
    ref_scale = _ref_scale(np.abs(x32.astype(np.float64)).reshape(4, 3, 32).max(-1), spec.max)
    np.testing.assert_array_equal(np.asarray(scale), ref_scale)
    _check_codes(q, x32, np.repeat(ref_scale, 32, axis=-1), spec)


@pytest.mark.parametrize("shape", [(16, 256), (7, 200), (1, 4096)], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_activations_with_transposed_scales_are_the_same_quantization(shape, dtype):
    """`quantize_activations_t` (the scales in cuBLASLt's [K/128, M] order): the float64 reference's scales,
    transposed, and the codes of `quantize_activations`, bit for bit, zero groups included, jitted."""
    rng = np.random.default_rng()
    x32 = _random(rng, shape, dtype)
    x32[rng.integers(0, shape[0])] = 0.0  # a zero row: unit scales, zero codes
    m, k = shape
    g = -(-k // 128)
    padded = np.zeros((m, g * 128))
    padded[:, :k] = np.abs(x32)
    ref_scale = _ref_scale(padded.reshape(m, g, 128).max(axis=-1), SPECS[Fp8Format.E4M3].max)
    q_t, scale_t = jax.jit(quantize_activations_t)(jnp.asarray(x32, dtype=dtype))
    q, _ = jax.jit(quantize_activations)(jnp.asarray(x32, dtype=dtype))
    assert scale_t.shape == (g, m) and q_t.shape == shape and q_t.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(scale_t), ref_scale.T)
    np.testing.assert_array_equal(_bits(q_t), _bits(q))
    with pytest.raises(ValueError, match="matrix"):
        quantize_activations_t(jnp.ones((2, 3, 128)))


# ---------------------------------------------------------------------------
# Special values


def test_zero_blocks_give_unit_scale_and_exact_zeros():
    rng = np.random.default_rng(5)
    x32 = _random(rng, (256, 300), jnp.float32)
    x32[128:256, 0:128] = 0.0  # one full zero block
    x32[:, 256:] = 0.0  # the partial edge column of blocks
    qw = quantize_weight_blockwise(jnp.asarray(x32))
    s = np.asarray(qw.scale_inv)
    assert np.all(np.isfinite(s)) and np.all(s > 0)
    assert s[1, 0] == 1.0 and np.all(s[:, 2] == 1.0)
    np.testing.assert_array_equal(_bits(qw.q)[128:, :128], 0)
    np.testing.assert_array_equal(np.asarray(qw.dequantize(jnp.float32))[x32 == 0], 0.0)
    ref = _ref_scale(_ref_block_amax(x32.astype(np.float64), 128, 128), 448.0)
    np.testing.assert_array_equal(s[0, :2], ref[0, :2])  # other blocks unaffected

    zeros = quantize_weight_blockwise(jnp.zeros((3, 130, 257), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(zeros.scale_inv), 1.0)
    np.testing.assert_array_equal(_bits(zeros.q), 0)
    np.testing.assert_array_equal(np.asarray(zeros.dequantize()), 0.0)

    xa = np.ones((3, 200), np.float32)
    xa[1] = 0.0  # a padding token
    q, scale = quantize_activations(jnp.asarray(xa))
    np.testing.assert_array_equal(np.asarray(scale)[1], 1.0)
    deq = dequantize_activations(q, scale, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(deq), xa)


def test_saturating_cast_never_produces_inf_or_nan():
    x = jnp.asarray([447.9, 449.0, 464.0, 465.0, 1e6, np.inf, -np.inf, -1e30], jnp.float32)
    # A plain cast is not enough: E4M3 has no Inf, so 465 and up become NaN.
    assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float32)[3])
    got = np.asarray(jax.jit(saturating_cast)(x), np.float32)
    np.testing.assert_array_equal(got, [448, 448, 448, 448, 448, 448, -448, -448])
    got = np.asarray(saturating_cast(x * 200, Fp8Format.E5M2), np.float32)
    np.testing.assert_array_equal(got, [57344] * 6 + [-57344] * 2)


def test_amax_element_that_overshoots_fmt_max_is_clipped():
    # Find amax values whose float32 product amax * f32(1/(amax/448)) exceeds 448;
    # the module must clip them to 448 (plain rounding would also give 448 here,
    # but it shows the clip path is exercised and exact).
    rng = np.random.default_rng(6)
    a = rng.uniform(1e-3, 1e3, 20_000).astype(np.float32)
    s = (a / np.float32(448)).astype(np.float32)
    over = a[(a * (np.float32(1) / s)).astype(np.float32) > 448][:64]
    assert over.size > 0
    x = np.zeros((over.size, 128), np.float32)
    x[:, 0] = over
    x[:, 1] = -over
    q, scale = quantize_activations(jnp.asarray(x))
    qf = np.asarray(q, np.float32)
    np.testing.assert_array_equal(qf[:, 0], 448.0)
    np.testing.assert_array_equal(qf[:, 1], -448.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fmt", list(Fp8Format), ids=lambda f: f.name)
def test_huge_values_saturate_without_inf(dtype, fmt):
    big = float(jnp.finfo(dtype).max)
    x = np.random.default_rng(7).standard_normal((130, 200)).astype(np.float32)
    x[0, 0], x[5, 7], x[129, 199] = big, -big, big / 3
    qw = quantize_weight_blockwise(jnp.asarray(x, dtype), fmt=fmt)
    qf = np.asarray(qw.q, np.float32)
    assert np.all(np.isfinite(qf)) and np.abs(qf).max() == fmt.max
    assert qf[0, 0] == fmt.max and qf[5, 7] == -fmt.max
    assert np.all(np.isfinite(np.asarray(qw.scale_inv)))
    deq = np.asarray(qw.dequantize(jnp.float32))
    assert np.all(np.isfinite(deq))
    assert abs(deq[0, 0] / np.float32(jnp.asarray(big, dtype)) - 1) <= 1e-6


@pytest.mark.parametrize("fmt", list(Fp8Format), ids=lambda f: f.name)
def test_pow2_scales(fmt):
    rng = np.random.default_rng(8)
    spec = SPECS[fmt]
    x32 = _random(rng, (3, 130, 257), jnp.float32)
    blk = x32[0, :128, :128]
    blk *= np.float32(spec.max * 2.0**-3) / np.abs(blk).max()  # this block's scale is exactly 2^-3
    w = jnp.asarray(x32)
    fp32 = np.asarray(quantize_weight_blockwise(w, fmt=fmt).scale_inv, np.float64)
    qw = jax.jit(lambda w: quantize_weight_blockwise(w, fmt=fmt, rounding=ScaleRounding.POW2))(w)
    p2 = np.asarray(qw.scale_inv, np.float64)
    mant, _ = np.frexp(p2)
    assert np.all(mant == 0.5), "not powers of two"
    assert np.all(p2 >= fp32) and np.all(p2 < 2 * fp32)
    assert p2[0, 0, 0] == fp32[0, 0, 0] == 2.0**-3
    amax = _ref_block_amax(x32.astype(np.float64), 128, 128)
    np.testing.assert_array_equal(p2, _ref_scale(amax, spec.max, pow2=True))
    scale_full = _expand_blocks(p2, 128, 128, 130, 257)
    _check_codes(qw.q, x32, scale_full.astype(np.float32), spec)
    deq = np.asarray(qw.dequantize(jnp.float32), np.float64)
    _check_error_bound(x32.astype(np.float64), deq, scale_full, spec)

    q, s = quantize_activations(w, rounding=ScaleRounding.POW2, fmt=fmt)
    assert np.all(np.frexp(np.asarray(s, np.float64))[0] == 0.5)


def test_nonfinite_input_is_refused_with_the_tensor_name():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 130, 257)).astype(np.float32)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, 9, replace=False)
    flat[idx[:4]] = np.nan
    flat[idx[4:7]] = np.inf
    flat[idx[7:]] = -np.inf
    count = jax.jit(count_nonfinite)
    for dtype in (jnp.float32, jnp.bfloat16):
        n = count(jnp.asarray(x, dtype))
        assert n.dtype == jnp.int32 and n.shape == () and int(n) == 9
    assert int(count(jnp.asarray(rng.standard_normal((5, 5)), jnp.float32))) == 0

    name = "model.layers.3.mlp.experts.down_proj"
    pattern = r"model\.layers\.3\.mlp\.experts\.down_proj.*9 non-finite.*4 NaN, 5 Inf"
    with pytest.raises(ValueError, match=pattern):
        quantize_weight_checked(jnp.asarray(x, jnp.bfloat16), name=name)
    only_nan = np.ones((4, 4), np.float32)
    only_nan[1, 2] = np.nan
    with pytest.raises(ValueError, match="q_proj"):
        quantize_weight_checked(only_nan, "q_proj", block_size=(2, 2))

    # Unchecked quantization does not hide NaN: the block's scale is NaN, others are fine.
    qw = quantize_weight_blockwise(jnp.asarray(only_nan), block_size=(2, 2))
    s = np.asarray(qw.scale_inv)
    assert np.isnan(s[0, 1]) and np.all(np.isfinite(np.delete(s.reshape(-1), 1)))

    clean = rng.standard_normal((130, 257)).astype(np.float32)
    got = quantize_weight_checked(clean, "w", block_size=[64, 64], fmt=Fp8Format.E5M2)
    want = quantize_weight_blockwise(jnp.asarray(clean), block_size=(64, 64), fmt=Fp8Format.E5M2)
    assert got.block_size == (64, 64)
    np.testing.assert_array_equal(_bits(got.q), _bits(want.q))
    np.testing.assert_array_equal(np.asarray(got.scale_inv), np.asarray(want.scale_inv))


# ---------------------------------------------------------------------------
# jit, pytrees, shapes, validation


def test_eager_and_jit_are_bit_identical():
    rng = np.random.default_rng(10)
    w = jnp.asarray(_random(rng, (3, 130, 257), jnp.bfloat16), jnp.bfloat16)
    eager = quantize_weight_blockwise(w)
    static = ("block_size", "fmt", "rounding")
    jitted = jax.jit(quantize_weight_blockwise, static_argnames=static)(w)
    np.testing.assert_array_equal(_bits(eager.q), _bits(jitted.q))
    np.testing.assert_array_equal(np.asarray(eager.scale_inv), np.asarray(jitted.scale_inv))
    np.testing.assert_array_equal(
        np.asarray(dequantize_weight(eager, jnp.float32)),
        np.asarray(jax.jit(dequantize_weight, static_argnums=1)(jitted, jnp.float32)),
    )
    qe, se = quantize_activations(w)
    qj, sj = jax.jit(quantize_activations)(w)
    np.testing.assert_array_equal(_bits(qe), _bits(qj))
    np.testing.assert_array_equal(np.asarray(se), np.asarray(sj))


def test_quantized_weight_is_a_pytree():
    qw = quantize_weight_blockwise(jnp.ones((4, 6), jnp.float32), block_size=(2, 3))
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 2
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.block_size == (2, 3) and rebuilt.fmt is Fp8Format.E4M3
    out = jax.jit(lambda qw: qw.dequantize(jnp.float32))(qw)
    np.testing.assert_array_equal(np.asarray(out), 1.0)


def test_full_size_shapes_with_eval_shape():
    # Qwen3-30B-A3B expert stack: E=128 experts, F=768, D=2048; activations [B, T, D].
    w = jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16)
    qw = jax.eval_shape(quantize_weight_blockwise, w)
    assert qw.q.shape == (128, 768, 2048) and qw.q.dtype == jnp.float8_e4m3fn
    assert qw.scale_inv.shape == (128, 6, 16) and qw.scale_inv.dtype == jnp.float32
    x = jax.ShapeDtypeStruct((8, 4096, 2048), jnp.bfloat16)
    q, s = jax.eval_shape(quantize_activations, x)
    assert q.shape == (8, 4096, 2048) and s.shape == (8, 4096, 16)
    out = jax.eval_shape(dequantize_weight, qw)
    assert out.shape == (128, 768, 2048) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("block_size", [(0, 128), (128,), (128, 128, 1), (1.5, 2), (True, 2), 128])
def test_bad_block_size_raises(block_size):
    with pytest.raises(ValueError, match="block_size"):
        quantize_weight_blockwise(jnp.ones((4, 4)), block_size=block_size)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="rank >= 2"):
        quantize_weight_blockwise(jnp.ones((8,)))
    with pytest.raises(ValueError, match="group_size"):
        quantize_activations(jnp.ones((2, 8)), group_size=0)
    with pytest.raises(ValueError, match="Fp8Format"):
        quantize_weight_blockwise(jnp.ones((4, 4)), fmt="e4m3")
    with pytest.raises(AssertionError):  # chex: integer input
        quantize_weight_blockwise(jnp.ones((4, 4), jnp.int32))
    q, s = quantize_activations(jnp.ones((2, 200)))
    with pytest.raises(ValueError, match="expected"):
        dequantize_activations(q, s[:, :1])
    with pytest.raises(ValueError, match="float8"):
        dequantize_activations(q.astype(jnp.float32), s)
    qw = quantize_weight_blockwise(jnp.ones((4, 6)), block_size=(2, 3))
    with pytest.raises(ValueError, match="scale_inv has shape"):
        dequantize_weight(qw.replace(scale_inv=qw.scale_inv[:1]))

