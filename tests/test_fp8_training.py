"""FP8 training (`fp8rl_jax.quant.training`): the three GEMMs of every FP8 linear, and the model.

References are written here in NumPy: the same quantize steps as `fp8rl_jax.numerics.fp8` (float32
``amax / fmt_max``, multiply by the float32 reciprocal, clip, round-to-nearest-even cast with
ml_dtypes), then the GEMMs in float64 on the dequantized operands. Nothing but the function under
test is imported from the module, so a wrong group axis, group length, format or a reused scale
shows up as an error of FP8 size (~1e-2), while the implementation's own float32 accumulation
stays below 1e-6.

FP8 error against the unquantized float32 GEMM (the bound asserted, with its derivation)
-------------------------------------------------------------------------------------------
Round-to-nearest with m mantissa bits has an error uniform in +-ulp/2, ulp = 2^-m * 2^e. For
values spread over a binade (mantissa v in [1, 2)), the relative RMS error is
``2^-m / sqrt(12) * sqrt(mean(1 / v^2)) = 2^-m / sqrt(12) * sqrt(1/2)``:
E4M3 (m = 3): 2.55 %, E5M2 (m = 2): 5.1 %. A GEMM of two independently rounded operands has a
relative Frobenius error of about ``sqrt(e_a^2 + e_b^2)``: 3.6 % for E4M3 x E4M3 and 5.7 % for
E5M2 x E4M3. The tests assert 1.3x that prediction on Gaussian data; measured (seeded) values:
fprop 3.7 %, dgrad 3.7 % (E4M3) / 5.7 % (E5M2), wgrad 3.6 % (E4M3) / 5.6 % (E5M2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from configs.models import tiny_qwen3, tiny_qwen3_moe
from fp8rl_jax.models import DensePolicy, Proj, Site, abstract_params, forward
from fp8rl_jax.quant import Fp8Format, quantize_weight_blockwise
from fp8rl_jax.quant.policy import Kernels, LayerPolicy, W8A8Policy, quantize_params
from fp8rl_jax.quant.training import Fp8TrainPolicy, Fp8TrainRecipe, fp8_linear, fp8_ragged_linear

_NP_FMT = {Fp8Format.E4M3: (ml_dtypes.float8_e4m3fn, 448.0), Fp8Format.E5M2: (ml_dtypes.float8_e5m2, 57344.0)}
_TINY = np.finfo(np.float32).tiny
# Relative RMS rounding error of one operand (see the module docstring).
_E_RMS = {f: 2.0**-m / math.sqrt(12) * math.sqrt(0.5) for f, m in ((Fp8Format.E4M3, 3), (Fp8Format.E5M2, 2))}
_F32 = Fp8TrainRecipe(kernels=Kernels.REFERENCE)


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _fq(a: np.ndarray, group: tuple[int, int], fmt: Fp8Format = Fp8Format.E4M3) -> np.ndarray:
    """float64 dequantization of float32 ``a`` [R, C] quantized in (gr x gc) groups."""
    dt, fmax = _NP_FMT[fmt]
    a = np.asarray(a, np.float32)
    (r, c), (gr, gc) = a.shape, group
    rb, cb = -(-r // gr), -(-c // gc)
    p = np.zeros((rb * gr, cb * gc), np.float32)
    p[:r, :c] = a
    p = p.reshape(rb, gr, cb, gc)
    amax = np.abs(p).max(axis=(1, 3))
    s = np.maximum((amax / np.float32(fmax)).astype(np.float32), np.float32(_TINY))
    s = np.where(amax == 0, np.float32(1.0), s).astype(np.float32)
    inv = (np.float32(1.0) / s).astype(np.float32)[:, None, :, None]
    q = np.clip(p * inv, -fmax, fmax).astype(dt)
    deq = q.astype(np.float64) * s.astype(np.float64)[:, None, :, None]
    return deq.reshape(rb * gr, cb * gc)[:r, :c]


def _rows(a, fmt=Fp8Format.E4M3):  # 1x128 groups along the last axis (per token)
    return _fq(a, (1, 128), fmt)


def _np_linear(x, w, dy, gfmt):
    """float64 y, dx, dW of the recipe: x 1x128 and W 128x128 (E4M3); dgrad dy 1x128 along N;
    wgrad dy and x in 128x1 groups along the tokens."""
    wq = _fq(w, (128, 128))
    y = _rows(x) @ wq.T
    dx = _rows(dy, gfmt) @ wq
    dw = _rows(dy.T, gfmt) @ _rows(x.T).T
    return y, dx, dw


@functools.partial(jax.jit, static_argnames=("recipe", "dtype", "lead"))
def _linear_vjp(x, w, dy, recipe=_F32, dtype="float32", lead=None):
    """y, dx, dW of fp8_linear (x reshaped to ``lead + (K,)`` first, to exercise leading dims)."""
    def f(a, b):
        a = a if lead is None else a.reshape(*lead, a.shape[-1])
        return fp8_linear(a, b, recipe, dtype).reshape(-1, b.shape[0])

    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy.astype(y.dtype)))


@functools.partial(jax.jit, static_argnames=("recipe",))
def _ragged_vjp(x, w, sizes, dy, recipe=_F32):
    y, vjp = jax.vjp(lambda a, b: fp8_ragged_linear(a, b, sizes, recipe, jnp.float32), x, w)
    return (y, *vjp(dy))


def _rand(rng, *shape, zero_rows=()):
    a = rng.standard_normal(shape).astype(np.float32)
    a[list(zero_rows)] = 0.0
    return a


@pytest.mark.parametrize("gfmt", [Fp8Format.E4M3, Fp8Format.E5M2])
def test_dense_three_gemms_match_float64_and_fp8_bound(gfmt):
    """fprop, dgrad, wgrad vs float64 NumPy of the same quantization (partial blocks on every
    axis, 200 tokens = 2 token groups), and vs the unquantized GEMMs within the FP8 bound."""
    rng = np.random.default_rng([11, gfmt is Fp8Format.E5M2])
    x, w = _rand(rng, 200, 288), _rand(rng, 160, 288)
    dy = _rand(rng, 200, 160)
    recipe = dataclasses.replace(_F32, grad_format=gfmt)
    y, dx, dw = _linear_vjp(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), recipe, lead=(2, 100))
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32
    ry, rdx, rdw = _np_linear(x, w, dy, gfmt)
    for name, got, ref in (("y", y.reshape(200, 160), ry), ("dx", dx, rdx), ("dW", dw, rdw)):
        assert rel_err(got, ref) < 2e-6, name
    # against the unquantized float64 GEMMs
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    e4, eg = _E_RMS[Fp8Format.E4M3], _E_RMS[gfmt]
    errs = {"y": rel_err(y.reshape(200, 160), x64 @ w64.T), "dx": rel_err(dx, dy64 @ w64),
            "dW": rel_err(dw, dy64.T @ x64)}
    bounds = {"y": 1.3 * math.hypot(e4, e4), "dx": 1.3 * math.hypot(eg, e4), "dW": 1.3 * math.hypot(eg, e4)}
    print(f"\n{gfmt.name} relative error vs float32 GEMMs: " + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()))
    for k, err in errs.items():
        assert err < bounds[k], (k, err, bounds[k])


def test_bf16_compute_dtypes_and_master_gradient():
    """BF16 compute: y and dx in bfloat16, dW in the float32 master dtype; the weight is cast to
    bfloat16 before quantizing (as the rollout's export), and dW is not rounded to bfloat16."""
    rng = np.random.default_rng(12)
    x, w, dy = _rand(rng, 64, 160), _rand(rng, 96, 160), _rand(rng, 64, 96)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    wb = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
    dyb = np.asarray(jnp.asarray(dy, jnp.bfloat16).astype(jnp.float32))
    y, dx, dw = _linear_vjp(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), jnp.asarray(dy, jnp.bfloat16),
                            dtype="bfloat16")
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    ry, rdx, rdw = _np_linear(xb, wb, dyb, Fp8Format.E4M3)
    assert rel_err(y, ry) < 4e-3 and rel_err(dx, rdx) < 4e-3  # one bfloat16 rounding of the output
    assert rel_err(dw, rdw) < 2e-6
    assert np.any(np.asarray(dw) != np.asarray(jnp.asarray(dw, jnp.bfloat16).astype(jnp.float32)))


def _np_ragged(x, w, sizes, dy, gfmt):
    m, n = dy.shape
    y, dx, dw = np.zeros((m, n)), np.zeros(x.shape), np.zeros(w.shape)
    start = 0
    for e, s in enumerate(sizes):
        r = slice(start, start + s)
        wq = _fq(w[e], (128, 128))
        y[r] = _rows(x[r]) @ wq.T
        dx[r] = _rows(dy[r], gfmt) @ wq
        if s:  # token groups restart at each expert: quantize the expert's own rows
            dw[e] = _rows(dy[r].T, gfmt) @ _rows(x[r].T).T
        start += s
    return y, dx, dw


@pytest.mark.parametrize("gfmt", [Fp8Format.E4M3, Fp8Format.E5M2])
def test_moe_ragged_three_gemms_match_float64(gfmt):
    """Grouped experts: an empty expert, experts longer than one token group, groups not
    multiples of 128, and tail rows past sum(group_sizes) (zero output and gradient)."""
    rng = np.random.default_rng([13, gfmt is Fp8Format.E5M2])
    sizes = np.array([130, 0, int(rng.integers(60, 120)), int(rng.integers(1, 40))], np.int32)
    m = int(sizes.sum()) + 7
    x, w, dy = _rand(rng, m, 160), _rand(rng, 4, 144, 160), _rand(rng, m, 144)
    recipe = dataclasses.replace(_F32, grad_format=gfmt)
    y, dx, dw = _ragged_vjp(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), jnp.asarray(dy), recipe)
    ry, rdx, rdw = _np_ragged(x, w, sizes, dy, gfmt)
    for name, got, ref in (("y", y, ry), ("dx", dx, rdx), ("dW", dw, rdw)):
        assert rel_err(got, ref) < 2e-6, name
    assert not np.any(np.asarray(y)[-7:]) and not np.any(np.asarray(dx)[-7:]) and not np.any(np.asarray(dw)[1])
    # vs unquantized
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    ends = np.cumsum(sizes)
    dw_exact = np.stack([dy64[e0:e1].T @ x64[e0:e1] for e0, e1 in zip(ends - sizes, ends, strict=True)])
    err = rel_err(dw, dw_exact)
    print(f"\nMoE {gfmt.name} wgrad relative error vs float32: {err:.4f}")
    assert err < 1.3 * math.hypot(_E_RMS[gfmt], _E_RMS[Fp8Format.E4M3])


def test_zero_rows_and_zero_tensors_give_exact_zeros_and_no_nan():
    """Padded tokens (zero rows of x and dy) and all-zero tensors: unit scales, zero codes, so
    outputs and gradients are exact zeros where they must be and finite everywhere."""
    rng = np.random.default_rng(14)
    x = _rand(rng, 150, 160, zero_rows=range(100, 150))  # tokens 128..149 form an all-zero group
    w = _rand(rng, 144, 160)
    dy = _rand(rng, 150, 144, zero_rows=(0, 1, 2, *range(100, 150)))
    y, dx, dw = map(np.asarray, _linear_vjp(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
    assert not np.any(y[100:]) and not np.any(dx[[0, 1, 2]]) and not np.any(dx[100:])
    ry, rdx, rdw = _np_linear(x, w, dy, Fp8Format.E4M3)
    assert rel_err(dw, rdw) < 2e-6 and rel_err(y, ry) < 2e-6 and rel_err(dx, rdx) < 2e-6
    # all-zero x: y = 0 and dW = 0 exactly; all-zero W: y = 0 and dx = 0 exactly
    x0, w0, dy0 = np.zeros_like(x), np.zeros_like(w), _rand(rng, 150, 144)
    for xi, wi, zero_out in ((x0, w, ("y", "dW")), (x, w0, ("y", "dx"))):
        out = dict(zip(("y", "dx", "dW"), map(np.asarray, _linear_vjp(jnp.asarray(xi), jnp.asarray(wi),
                                                                      jnp.asarray(dy0))), strict=True))
        assert all(np.all(np.isfinite(t)) for t in out.values())
        assert not any(np.any(out[k]) for k in zero_out) and all(np.any(out[k]) for k in out if k not in zero_out)
    # grouped: expert 0's rows are all zero (x), expert 1 gets no gradient (dy)
    sizes = jnp.array([50, 30], jnp.int32)
    xe = jnp.asarray(x[:80]).at[:50].set(0.0)
    dye = jnp.zeros((80, 144)).at[:50].set(1.0)
    out, gx, gw = map(np.asarray, _ragged_vjp(xe, jnp.asarray(rng.standard_normal((2, 144, 160)), jnp.float32),
                                              sizes, dye))
    assert all(np.all(np.isfinite(t)) for t in (out, gx, gw))
    assert not np.any(out[:50]) and not np.any(gx[50:]) and not np.any(gw) and np.any(gx[:50])


def test_layer_selection_and_clear_errors():
    rng = np.random.default_rng(15)
    x, w = jnp.asarray(rng.standard_normal((4, 160)), jnp.float32), jnp.asarray(rng.standard_normal((96, 160)),
                                                                              jnp.float32)
    pol = Fp8TrainPolicy("float32", _F32, LayerPolicy(bf16_first_layers=1, bf16_last_layers=1), num_layers=4)
    dense = DensePolicy("float32")
    fp8 = np.asarray(fp8_linear(x, w, _F32, jnp.float32))
    for site, is_fp8 in ((Site(0, Proj.Q), False), (Site(1, Proj.DOWN), True), (Site(2, Proj.O), True),
                         (Site(3, Proj.UP), False), (Site(None, Proj.LM_HEAD), False), (Site(1, Proj.ROUTER), False)):
        assert pol.is_fp8(site) == is_fp8, site
        want = fp8 if is_fp8 else np.asarray(dense.dot(x, w, site))
        np.testing.assert_array_equal(np.asarray(pol.dot(x, w, site)), want)
    assert rel_err(fp8, np.asarray(dense.dot(x, w, Site(0, Proj.Q)))) > 1e-2  # FP8 is really on
    with pytest.raises(ValueError, match="needs num_layers"):
        Fp8TrainPolicy(layer_policy=LayerPolicy(bf16_last_layers=2))
    assert Fp8TrainPolicy.for_model(tiny_qwen3, layer_policy=LayerPolicy(bf16_last_layers=1)).num_layers == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        Fp8TrainPolicy("float16")
    with pytest.raises(ValueError, match="grad_format must be an Fp8Format"):
        Fp8TrainRecipe(grad_format="e5m2")
    with pytest.raises(ValueError, match="differs from layer_policy.block_size"):
        Fp8TrainPolicy(recipe=Fp8TrainRecipe(block_size=(64, 64)))
    with pytest.raises(TypeError, match="QuantizedWeight"):
        pol.dot(x, quantize_weight_blockwise(w), Site(1, Proj.Q))
    with pytest.raises(ValueError, match="does not contract"):
        fp8_linear(x, w.T)
    hash(pol)  # a static argument of jit


# ---------------------------------------------------------------------------- the model

_TOKENS = (4, 16)  # one batch shape for every model test, so jitted gradients are shared


def _lm_loss(params, tokens, cfg, policy):
    logits, _ = forward(params, tokens, config=cfg, policy=policy)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


_grad = jax.jit(jax.value_and_grad(_lm_loss), static_argnums=(2, 3))


def _init(cfg, seed):
    """float32 master weights as init_params draws them (normal(0, 0.02), norms at one), built in
    NumPy on the abstract parameter tree: init_params would compile a jitted init per call."""
    rng = np.random.default_rng(seed)
    leaves = []
    for path, var in nnx.to_flat_state(abstract_params(cfg, jnp.float32)):
        shape = var.get_value().shape
        norm = "norm" in str(path[-2]) or path[0] == "norm"
        value = np.ones(shape, np.float32) if norm else (0.02 * rng.standard_normal(shape)).astype(np.float32)
        leaves.append((path, var.replace(jnp.asarray(value))))
    return nnx.from_flat_state(leaves)


@pytest.fixture(scope="module")
def dense_params():
    return _init(tiny_qwen3, 3)


def _flat(tree):
    return {"/".join(map(str, p)): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(tree)}


def _cosines(got, ref):
    return {k: float(np.dot(got[k].ravel(), ref[k].ravel()) / (np.linalg.norm(got[k]) * np.linalg.norm(ref[k])))
            for k in ref}


# RMSNorm gains (q/k norms of 16 elements, layer norms of 64) have gradients that are reductions
# over all tokens (and heads) of products that largely cancel at a fresh, near-uniform
# initialization, so a few-percent perturbation moves them by 10-15 %. Most of it is the FP8
# *forward*, i.e. the rollout's own numerics: with FP8 forward and an exact float32 backward the
# q/k gains already drop to ~0.99. They get a looser bound than the matmul weights. Survey of 10
# seeds of the dense test (tiny_qwen3, (4, 16) tokens, BF16 compute): matmul weights and
# embeddings min 0.9922, q/k norm gains min 0.984, other norm gains min 0.988, all parameters
# min 0.9968; BF16 dense for comparison min 0.9996 over every leaf.
def _check_cosines(name, got, ref, weight_bound=0.99, norm_bound=0.975, total_bound=0.995):
    assert all(np.all(np.isfinite(g)) for g in got.values())
    cos = _cosines(got, ref)
    mats = {k: c for k, c in cos.items() if "norm" not in k}
    norms = {k: c for k, c in cos.items() if "norm" in k}
    worst_mat, worst_norm = min(mats, key=mats.get), min(norms, key=norms.get)
    flat_got, flat_ref = (np.concatenate([t[k].ravel() for k in sorted(ref)]) for t in (got, ref))
    total = float(flat_got @ flat_ref / (np.linalg.norm(flat_got) * np.linalg.norm(flat_ref)))
    print(f"\n{name}: all-parameter cosine {total:.5f}; matmul weights and embeddings min {mats[worst_mat]:.5f} "
          f"({worst_mat}); norm gains min {norms[worst_norm]:.5f} ({worst_norm}); median "
          f"{np.median(list(cos.values())):.5f} over {len(cos)} leaves")
    assert total > total_bound
    assert mats[worst_mat] > weight_bound, (worst_mat, mats[worst_mat])
    assert norms[worst_norm] > norm_bound, (worst_norm, norms[worst_norm])


def test_dense_model_gradient_cosine_vs_float32(dense_params):
    """Gradients of the tiny dense model under Fp8TrainPolicy (BF16 compute, every default FP8
    projection) vs the float32 dense ones: cosine > 0.99 for every matmul weight and the
    embeddings, > 0.975 for the RMSNorm gains (see above), > 0.995 for all parameters together."""
    cfg, params = tiny_qwen3, dense_params
    tokens = jax.random.randint(jax.random.key(4), _TOKENS, 0, cfg.vocab_size)
    ref = _flat(_grad(params, tokens, cfg, DensePolicy("float32"))[1])
    got = _flat(_grad(params, tokens, cfg, Fp8TrainPolicy("bfloat16"))[1])
    _check_cosines("dense FP8 vs float32", got, ref)


def _routing_loss(params, tokens, routes, cfg, policy):
    """The LM loss with top-k routing recorded (routes None) or replayed (routes given): the
    test's stand-in for MoE routing replay. It patches jax.lax.top_k while the loss is traced."""
    it, seen = iter(routes or ()), []

    def top_k(probs, k):
        idx = jax.lax.stop_gradient(next(it)) if routes else real_top_k(probs, k)[1]
        seen.append(idx)
        return jnp.take_along_axis(probs, idx, axis=-1), idx

    real_top_k = jax.lax.top_k
    with mock.patch.object(jax.lax, "top_k", top_k):
        return _lm_loss(params, tokens, cfg, policy), seen


def test_moe_model_gradient_cosine_vs_float32_with_replayed_routing():
    """Tiny MoE model (one layer), default Fp8TrainPolicy (BF16 compute), with the float32 run's
    expert choices replayed: the bounds of the dense test (measured here: all parameters 0.9985,
    matmul weights and experts min 0.996, norm gains min 0.995).

    Without replay the comparison measures routing flips, not the GEMMs: FP8 attention moves the
    router inputs by ~4 %, the near-uniform router of a fresh model flips some top-2 choices, and
    whole token contributions move between experts. Measured without replay on the 2-layer
    preset: FP8 min cosine 0.94-0.97 (expert and router leaves), and BF16 itself 0.979 on a
    (2, 24) batch. With only the experts in FP8 (router inputs unperturbed) no replay is needed:
    min 0.997."""
    cfg = dataclasses.replace(tiny_qwen3_moe, num_layers=1)  # one MoE layer: the dense test covers depth
    params = _init(cfg, 4)
    tokens = jax.random.randint(jax.random.key(4), _TOKENS, 0, cfg.vocab_size)
    rec = jax.jit(jax.value_and_grad(_routing_loss, has_aux=True), static_argnums=(2, 3, 4))
    (_, routes), ref = rec(params, tokens, None, cfg, DensePolicy("float32"))
    assert len(routes) == cfg.num_layers and routes[0].shape == (_TOKENS[0] * _TOKENS[1], cfg.num_experts_per_tok)
    replay = jax.jit(jax.value_and_grad(_routing_loss, has_aux=True), static_argnums=(3, 4))
    (_, replayed), got = replay(params, tokens, routes, cfg, Fp8TrainPolicy("bfloat16"))
    assert all(np.array_equal(a, b) for a, b in zip(routes, replayed, strict=True))
    _check_cosines("MoE FP8 vs float32 (replayed routing)", _flat(got), _flat(ref))


def test_forward_matches_the_rollout_w8a8(dense_params):
    """The trainer's FP8 forward uses the rollout's codes and scales: its logits equal those of
    W8A8Policy on quantize_params of the same weights (float32 compute: same GEMM math)."""
    params = dense_params
    tokens = jax.random.randint(jax.random.key(6), _TOKENS, 0, tiny_qwen3.vocab_size)
    fwd = jax.jit(lambda p, t, pol: forward(p, t, config=tiny_qwen3, policy=pol)[0], static_argnums=2)
    train = fwd(params, tokens, Fp8TrainPolicy("float32", _F32))
    qparams = jax.jit(lambda p: quantize_params(p, tiny_qwen3, kernels=Kernels.REFERENCE))(params)
    roll = fwd(qparams, tokens, W8A8Policy("float32", kernels=Kernels.REFERENCE))
    assert rel_err(train, roll) < 1e-5


def test_scan_microbatches_under_checkpoint_equal_separate_grads():
    """A dense FP8 linear feeding grouped FP8 experts: micro-batch gradient accumulation with
    lax.scan over a jax.checkpoint-ed loss (jitted) equals the sum of separately computed
    gradients (custom VJPs under scan and remat)."""
    rng = np.random.default_rng(17)
    params = {"w": jnp.asarray(rng.standard_normal((160, 96)) / 10, jnp.float32),
              "e": jnp.asarray(rng.standard_normal((3, 64, 160)) / 10, jnp.float32)}
    micro = jnp.asarray(rng.standard_normal((3, 40, 96)), jnp.bfloat16)
    sizes = jnp.array([15, 0, 25], jnp.int32)
    recipe = Fp8TrainRecipe(kernels=Kernels.REFERENCE)

    def loss(p, x):
        h = jax.nn.silu(fp8_linear(x, p["w"], recipe))
        return jnp.sum(fp8_ragged_linear(h, p["e"], sizes, recipe).astype(jnp.float32) ** 2)

    @jax.jit
    def accumulated(p, micro):
        g_fn = jax.grad(jax.checkpoint(loss))

        def body(acc, x):
            return jax.tree.map(jnp.add, acc, g_fn(p, x)), None

        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), micro)[0]

    one = jax.jit(jax.grad(loss))
    separate = jax.tree.map(lambda *g: sum(g), *[one(params, micro[i]) for i in range(3)])
    got = accumulated(params, micro)
    for k in params:
        assert got[k].dtype == jnp.float32 and np.any(np.asarray(got[k]))
        assert rel_err(got[k], separate[k]) < 1e-6, k


def test_adam_steps_reduce_loss_like_bf16(dense_params):
    """15 Adam steps on a fixed LM batch: the FP8 run's loss falls like the BF16 run's."""
    cfg, params = tiny_qwen3, dense_params
    tokens = jax.random.randint(jax.random.key(10), _TOKENS, 0, cfg.vocab_size)
    opt = optax.adam(1e-2)

    @jax.jit
    def update(g, s, p):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def run(policy):
        p, s, losses = params, opt.init(params), []
        for _ in range(15):
            loss, g = _grad(p, tokens, cfg, policy)
            p, s = update(g, s, p)
            losses.append(float(loss))
        return np.array(losses)

    bf16, fp8 = run(DensePolicy("bfloat16")), run(Fp8TrainPolicy("bfloat16"))
    drop_bf16, drop_fp8 = bf16[0] - bf16[-1], fp8[0] - fp8[-1]
    print(f"\nloss bf16 {bf16[0]:.4f} -> {bf16[-1]:.4f}, fp8 {fp8[0]:.4f} -> {fp8[-1]:.4f}")
    assert abs(bf16[0] - fp8[0]) < 0.01 * bf16[0]
    assert drop_bf16 > 1.0 and 0.9 < drop_fp8 / drop_bf16 < 1.1


def test_pallas_path_matches_reference():
    """Kernels.PALLAS (interpret mode here, native on a GPU): fprop and dgrad through
    pallas_kernels.fp8_gemm (K = 136: masked edges) or fp8_gemm_mgpu (K = 256, 512), weight
    quantization through fp8_quant; same values as the reference. The wgrad multiplies the FP8
    codes dequantized to BF16 there: within BF16's 2^-9 rounding of the reference."""
    # Interpret mode computes the wgmma in float32: the reference's values to 1e-6. Natively the
    # Mosaic kernel's FP8 wgmma accumulates each 128-wide K block at Hopper's reduced precision
    # (1.3e-4 on the H200; float32 promotion between blocks keeps it from
    # growing with K), the bound of tests/test_fp8_gemm_mgpu.py's GPU class.
    tol = 1e-3 if jax.default_backend() == "gpu" else 1e-6
    rng = np.random.default_rng(16)
    for m, k, n in ((24, 136, 136), (256, 256, 128), (128, 512, 128)):
        x, w, dy = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((m, k), (n, k), (m, n)))
        out = {kk: _linear_vjp(x, w, dy, Fp8TrainRecipe(kernels=kk)) for kk in (Kernels.PALLAS, Kernels.REFERENCE)}
        for name, a, b in zip(("y", "dx", "dW"), out[Kernels.PALLAS], out[Kernels.REFERENCE], strict=True):
            assert rel_err(a, b) < (4e-3 if name == "dW" else tol), (m, k, n, name, rel_err(a, b))
        assert rel_err(out[Kernels.PALLAS][2], out[Kernels.REFERENCE][2]) > 0  # the BF16 wgrad path ran
