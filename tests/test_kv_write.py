"""Decode-step KV write kernel: interpret mode on the CPU and natively on the GPU (twin classes),
bitwise against the scatter it replaces, on fresh random inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_write as kw

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32


def _case(seed, pool_dtype, *, P=9, ps=4, K=2, H=16, B=6):
    rng = np.random.default_rng(seed)
    pools = [jnp.asarray(rng.standard_normal((P, ps, K, H)) * 3, F32).astype(pool_dtype) for _ in range(2)]
    k = jnp.asarray(rng.standard_normal((B, K, H)) * 200, jnp.bfloat16)  # some saturate at FP8's 448
    v = jnp.asarray(rng.standard_normal((B, K, H)), jnp.bfloat16)
    # distinct (page, slot) targets, plus rows that must not write: -1, P, a huge id
    targets = rng.choice(P * ps, B, replace=False)
    page, slot = (targets // ps).astype(np.int32), (targets % ps).astype(np.int32)
    page[[1, 3]] = [-1, P]
    if B > 4:
        page[4] = 2**30
    scales = (jnp.float32(rng.uniform(0.01, 0.5)), jnp.float32(rng.uniform(0.01, 0.5)))
    return (k, v, *pools, jnp.asarray(page), jnp.asarray(slot), *scales)


class TestKvWriteInterpret:
    INTERPRET = True

    @pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, FP8, F32])
    def test_bitwise_reference(self, pool_dtype):
        args = _case(int(np.random.default_rng().integers(1 << 30)), pool_dtype)
        before = [np.asarray(x.astype(F32)) for x in args[2:4]]
        want = kw.kv_write_reference(*args)
        got = kw.kv_write(*args, interpret=self.INTERPRET)
        for g, w, b in zip(got, want, before, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(w.astype(F32)))
            changed = np.any(np.asarray(g.astype(F32)) != b, axis=(2, 3))
            assert changed.sum() <= 3  # only the three rows with an in-range page wrote
        if pool_dtype == FP8:  # saturated, never NaN/Inf
            assert np.isfinite(np.asarray(got[0].astype(F32))).all()
            assert np.abs(np.asarray(got[0].astype(F32))).max() == 448.0

    def test_validation(self):
        k, v, kp, vp, page, slot, ks, vs = _case(0, jnp.bfloat16)
        with pytest.raises(ValueError, match="powers of two"):
            kw.kv_write(k[:, :, :12], v[:, :, :12], kp[..., :12], vp[..., :12], page, slot, ks, vs)
        with pytest.raises(ValueError, match="int32"):
            kw.kv_write(k, v, kp, vp, page.astype(jnp.int16), slot, ks, vs)
        with pytest.raises(ValueError, match="per token"):
            kw.kv_write(k, v, kp[:, :, :1], vp[:, :, :1], page, slot, ks, vs)


@pytest.mark.gpu
class TestKvWriteGpu(TestKvWriteInterpret):
    INTERPRET = False


# --- the q/k/v epilogue + KV write in one kernel (`qkv_rope_write`) ---

def _qkv_case(seed, pool_dtype, dtype, *, N=6, K=2, H=32, P=9, ps=4, B=5):
    """A fused q/k/v GEMM output with rows of very different magnitudes (the norms divide them out), rotary
    tables at random positions, norm weights away from 1, and rows that must not write (pages -1 and P)."""
    from fp8rl_jax.models.attention import rope_cos_sin

    rng = np.random.default_rng(seed)
    W = (N + 2 * K) * H
    qkv = jnp.asarray(rng.standard_normal((B, W)) * rng.uniform(0.05, 40, (B, W)), F32).astype(dtype)
    q_norm = jnp.asarray(rng.uniform(0.2, 3, (H,)), F32).astype(dtype)
    k_norm = jnp.asarray(rng.uniform(0.2, 3, (H,)), F32).astype(dtype)
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 40000, (B, 1)), jnp.int32), H, 1e6)
    pools = [jnp.asarray(rng.standard_normal((P, ps, K, H)), F32).astype(pool_dtype) for _ in range(2)]
    targets = rng.choice(P * ps, B, replace=False)
    page, slot = (targets // ps).astype(np.int32), (targets % ps).astype(np.int32)
    page[[1, 3]] = [-1, P]
    scales = (jnp.float32(rng.uniform(0.003, 0.01)), jnp.float32(rng.uniform(0.01, 0.1)))  # some k saturate
    return (qkv, q_norm, k_norm, cos[:, 0], sin[:, 0], *pools, jnp.asarray(page), jnp.asarray(slot), *scales)


def _gpu_close(got, want, dtype) -> None:
    """The GPU twin's bound against XLA:GPU's composition (which fuses it with excess precision, its own rsqrt and
    sum order). FP8 pools: at most one E4M3 step at the element's magnitude, on at most 2% of the elements.
    Otherwise: within 4 rounding steps of the head's largest value, per head (RoPE's sum of two products cancels,
    so an element-relative bound would measure the cancellation, not the kernel)."""
    g, w = np.asarray(got.astype(F32), np.float64), np.asarray(want.astype(F32), np.float64)
    if jnp.dtype(dtype) == jnp.dtype(FP8):
        step = np.exp2(np.floor(np.log2(np.maximum(np.abs(w), 2.0 ** -6))) - 3)
        steps = np.abs(g - w) / step
        assert steps.max() <= 1.0 and (steps > 0).mean() <= 0.02, (steps.max(), (steps > 0).mean())
        return
    mant = 7 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 23
    scale = np.maximum(np.abs(w).max(axis=-1, keepdims=True), 1e-30) * 2.0 ** -mant
    err = np.abs(g - w) / scale
    assert err.max() <= 4.0, err.max()


QKV_DTYPES = [(jnp.bfloat16, jnp.bfloat16), (FP8, jnp.bfloat16), (F32, F32), (FP8, F32)]
QKV_CASES = [(pool, dtype, n) for pool, dtype in QKV_DTYPES for n in (6, 8)]
# interpret mode compiles a program per case (seconds on the CPU): there every dtype pair once, the query heads
# alternating between 6 and 8; the GPU twin runs every pair with both
QKV_CASES_INTERPRET = [(pool, dtype, (6, 8)[i % 2]) for i, (pool, dtype) in enumerate(QKV_DTYPES)]


class TestQkvInterpret:
    INTERPRET = True

    def _check(self, got, want, before, pool_dtype, dtype):
        """Interpret mode: bit for bit, on the CPU (on a GPU backend XLA:GPU compiles both sides with its own
        reassociations: the GPU twin checks the native kernel there); the GPU twin: `_gpu_close`."""
        import jax

        if self.INTERPRET and jax.default_backend() == "gpu":
            pytest.skip("interpret mode is compared bit for bit on the CPU; TestQkvGpu runs the kernel here")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == w.dtype and g.shape == w.shape
            if self.INTERPRET:
                np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(w.astype(F32)))
            else:
                _gpu_close(g, w, dtype if i == 0 else pool_dtype)
        for g, b in zip(got[1:], before, strict=True):  # only the three rows with an in-range page wrote
            assert np.any(np.asarray(g.astype(F32)) != b, axis=(2, 3)).sum() <= 3

    @pytest.mark.parametrize("pool_dtype,dtype,N", QKV_CASES_INTERPRET)
    def test_matches_the_model_ops(self, pool_dtype, dtype, N):
        """q normalized and rotated, k and v written: the model's split / rms_norm / apply_rope and the scatter,
        for query heads that are (8) or are not (6) a power of two."""
        args = _qkv_case(int(np.random.default_rng().integers(1 << 30)), pool_dtype, dtype, N=N)
        before = [np.asarray(x.astype(F32)) for x in args[5:7]]
        kw_ = dict(num_heads=N, q_eps=1e-6, k_eps=1e-5)
        want = kw.qkv_rope_write_reference(*args, **kw_)
        got = kw.qkv_rope_write(*args, **kw_, interpret=self.INTERPRET)
        self._check(got, want, before, pool_dtype, dtype)
        if pool_dtype == FP8:  # saturated keys, never NaN/Inf
            assert np.isfinite(np.asarray(got[1].astype(F32))).all()

    def test_qwen3_8b_shape(self):
        """32 query heads, 8 kv heads of 128 (Qwen3-8B), an FP8 pool of 16-token pages."""
        args = _qkv_case(int(np.random.default_rng().integers(1 << 30)), FP8, jnp.bfloat16, N=32, K=8, H=128,
                         P=12, ps=16, B=4)
        before = [np.asarray(x.astype(F32)) for x in args[5:7]]
        want = kw.qkv_rope_write_reference(*args, num_heads=32, q_eps=1e-6, k_eps=1e-6)
        got = kw.qkv_rope_write(*args, num_heads=32, q_eps=1e-6, k_eps=1e-6, interpret=self.INTERPRET)
        self._check(got, want, before, FP8, jnp.bfloat16)

    def test_validation(self):
        args = _qkv_case(0, jnp.bfloat16, jnp.bfloat16)
        qkv, qn, kn, cos, sin, kp, vp, page, slot, ks, vs = args
        call = lambda *a, n=6: kw.qkv_rope_write(*a, num_heads=n, q_eps=1e-6, k_eps=1e-6)  # noqa: E731
        with pytest.raises(ValueError, match=r"\(N \+ 2K\) \* H"):
            call(qkv[:, :-32], *args[1:])
        with pytest.raises(ValueError, match="unsupported attention shape"):
            call(jnp.zeros((5, (5 + 4) * 32), jnp.bfloat16), *args[1:], n=5)
        with pytest.raises(ValueError, match="cos must be"):
            call(qkv, qn, kn, cos[:, :16], sin, kp, vp, page, slot, ks, vs)
        with pytest.raises(ValueError, match="k_norm must be"):
            call(qkv, qn, kn[:16], cos, sin, kp, vp, page, slot, ks, vs)
        with pytest.raises(ValueError, match="int32"):
            call(qkv, qn, kn, cos, sin, kp, vp, page.astype(jnp.int16), slot, ks, vs)


@pytest.mark.gpu
class TestQkvGpu(TestQkvInterpret):
    INTERPRET = False

    @pytest.mark.parametrize("pool_dtype,dtype,N", QKV_CASES)
    def test_matches_the_model_ops(self, pool_dtype, dtype, N):
        super().test_matches_the_model_ops(pool_dtype, dtype, N)


@pytest.mark.parametrize("pool_dtype,dtype", [(FP8, jnp.bfloat16), (F32, F32)])
def test_qkv_reference_is_the_model_ops(pool_dtype, dtype):
    """The kernel's twin is the model's decode epilogue bit for bit: split, `rms_norm`, `apply_rope` on
    ``[B, 1, heads, H]``, then the scatter (`kv_write_reference`)."""
    import jax

    from fp8rl_jax.models.attention import apply_rope
    from fp8rl_jax.models.policy import rms_norm

    N, q_eps, k_eps = 6, 1e-6, 1e-5
    args = _qkv_case(int(np.random.default_rng().integers(1 << 30)), pool_dtype, dtype, N=N)
    qkv, qn, kn, cos, sin, kp, vp, page, slot, ks, vs = args
    K, H = kp.shape[2:]

    @jax.jit
    def model_ops(qkv, qn, kn, cos, sin, kp, vp, page, slot, ks, vs):
        B = qkv.shape[0]
        q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
        q = apply_rope(rms_norm(q.reshape(B, 1, N, H), qn, q_eps), cos[:, None], sin[:, None])[:, 0]
        k = apply_rope(rms_norm(k.reshape(B, 1, K, H), kn, k_eps), cos[:, None], sin[:, None])[:, 0]
        return (q, *kw.kv_write_reference(k, v.reshape(B, K, H), kp, vp, page, slot, ks, vs))

    want = model_ops(*args)
    got = kw.qkv_rope_write_reference(*args, num_heads=N, q_eps=q_eps, k_eps=k_eps)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(w.astype(F32)))


def test_benchmark_suite_smoke():
    """The runner's suite on its CPU smoke flags: the composition and the kernel per warp count run in interpret
    mode (no GPU time off the GPU)."""
    import argparse

    import jax

    from experiments.bench.suites import kv_write as suite

    parser = argparse.ArgumentParser()
    suite.add_arguments(parser)
    args = parser.parse_args(suite.SMOKE)
    rows = suite.run(args)["results"]
    impls = [("composition", None)] + [("kernel", w) for w in args.warps]
    assert [(r["impl"], r["num_warps"]) for r in rows] == impls * len(args.pools) * len(args.rows)
    if jax.default_backend() != "gpu":
        assert all(r["gpu_us"] is None for r in rows)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, FP8])
def test_qkv_lowers_to_triton_for_h200(pool_dtype):
    """The Qwen3-8B shape and a query-head count that is not a power of two (40, Qwen3-14B) lower for sm_90."""
    import jax

    from pallas_kernels.common import triton_ir_for_sm90

    S = jax.ShapeDtypeStruct
    B, K, H, P, ps = 256, 8, 128, 1000, 16
    for N in (32, 40):
        with triton_ir_for_sm90() as ir:
            text = kw._qkv_rope_write.trace(
                S((B, (N + 2 * K) * H), jnp.bfloat16), S((B, H), F32), S((B, H), F32), S((H,), jnp.bfloat16),
                S((H,), jnp.bfloat16), S((P, ps, K, H), pool_dtype), S((P, ps, K, H), pool_dtype), S((B,), jnp.int32),
                S((B,), jnp.int32), S((2,), F32), num_heads=N, q_eps=1e-6, k_eps=1e-6, num_warps=4,
                interpret=False).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and len(ir) == 1


def test_cache_attend_qkv_equals_the_separate_ops():
    """PagedKVCache.attend_qkv (one kernel, then the decode kernel) == the model's norms and RoPE followed by
    attend: the same output bits and pools (an FP8 pool with its scales; the kernel's other pool dtypes are checked
    above), a row that does not write."""
    pool_dtype = FP8
    import jax

    from fp8rl_jax.models import PagedKVCache
    from fp8rl_jax.models.attention import apply_rope
    from fp8rl_jax.models.policy import rms_norm
    from fp8rl_jax.quant.policy import Kernels

    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    B, N, K, H, ps, max_pages = 3, 4, 2, 16, 4, 6
    cache = PagedKVCache.init(1, B * max_pages + 2, ps, K, H, B, max_pages, pool_dtype, kernels=Kernels.PALLAS)
    table = rng.permutation(B * max_pages + 2)[: B * max_pages].reshape(B, max_pages)
    cache = cache.replace(page_table=jnp.asarray(table, jnp.int32), k_scale=jnp.array([0.05], F32),
                          v_scale=jnp.array([0.02], F32))
    assert cache.qkv_kernel(1, N, H) and not cache.qkv_kernel(2, N, H)
    assert not cache.replace(kernels=Kernels.REFERENCE).qkv_kernel(1, N, H)
    # the prefill jitted: eagerly each of its ops would compile on its own
    _, cache = jax.jit(lambda c, q, k, v, n: c.attend(0, q, k, v, n))(
        cache, jnp.zeros((B, 9, N, H), F32), *(jnp.asarray(rng.standard_normal((B, 9, K, H)), F32) for _ in range(2)),
        jnp.array([3, 9, 5]))
    cache = cache.advance(jnp.array([3, 9, 5]))
    qkv = jnp.asarray(rng.standard_normal((B, 1, (N + 2 * K) * H)) * 5, F32)
    qn, kn = (jnp.asarray(rng.uniform(0.5, 2, (H,)), F32) for _ in range(2))
    from fp8rl_jax.models.attention import rope_cos_sin

    cos, sin = rope_cos_sin(cache.lengths[:, None], H, 1e6)
    num_new = jnp.array([1, 0, 1])

    def separate(c, qkv):
        q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
        q = apply_rope(rms_norm(q.reshape(B, 1, N, H), qn, 1e-6), cos, sin)
        k = apply_rope(rms_norm(k.reshape(B, 1, K, H), kn, 1e-6), cos, sin)
        return c.attend(0, q, k, v.reshape(B, 1, K, H), num_new)

    fused = jax.jit(lambda c, qkv: c.attend_qkv(0, qkv, qn, kn, (1e-6, 1e-6), cos, sin, num_new, N))
    (o1, c1), (o2, c2) = fused(cache, qkv), jax.jit(separate)(cache, qkv)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    for a, b in ((c1.k_pages[0], c2.k_pages[0]), (c1.v_pages[0], c2.v_pages[0])):
        np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))
    assert np.any(np.asarray(c1.k_pages[0].astype(F32)) != np.asarray(cache.k_pages[0].astype(F32)))


def test_model_decode_step_takes_the_kernel(monkeypatch):
    """The generator's layout (fused q/k/v) decoding over a paged cache with the kernels: the decode step's norms,
    RoPE and KV write run as `qkv_rope_write`, and its logits and pools equal those of the separate ops bit for
    bit (float32; a prefill first, then a step where one row does not advance)."""
    import dataclasses

    import jax

    from configs.models import tiny_qwen3
    from fp8rl_jax.models import PagedKVCache, forward, init_params
    from fp8rl_jax.models.fusion import fuse_params
    from fp8rl_jax.quant.policy import Kernels

    # 6 query heads: two kernel tiles; one layer (every layer's attention is the same code; compiles dominate)
    cfg = dataclasses.replace(tiny_qwen3, num_heads=6, num_kv_heads=2, num_layers=1)
    params = fuse_params(init_params(cfg, jax.random.key(int(np.random.default_rng().integers(1 << 30))), F32))
    B, ps, max_pages = 2, 4, 4
    cache = PagedKVCache.init(cfg.num_layers, B * max_pages, ps, cfg.num_kv_heads, cfg.head_dim, B, max_pages, F32,
                              kernels=Kernels.PALLAS)
    cache = cache.replace(page_table=jnp.asarray(np.random.default_rng(0).permutation(B * max_pages).reshape(
        B, max_pages), jnp.int32))
    prompt = jax.random.randint(jax.random.key(3), (B, 5), 0, cfg.vocab_size)
    run = lambda c, t, n: forward(params, t, config=cfg, cache=c, num_new=n)  # noqa: E731
    _, cache = jax.jit(run)(cache, prompt, jnp.array([5, 3], jnp.int32))
    calls, real = [], kw.qkv_rope_write
    monkeypatch.setattr(kw, "qkv_rope_write", lambda *a, **k: calls.append(1) or real(*a, **k))
    step = jnp.array([[7], [9]], jnp.int32)
    got, c1 = jax.jit(run)(cache, step, jnp.array([1, 0], jnp.int32))
    assert len(calls) == cfg.num_layers
    monkeypatch.setattr(PagedKVCache, "qkv_kernel", lambda self, *a: False)
    want, c2 = jax.jit(run)(cache, step, jnp.array([1, 0], jnp.int32))
    assert len(calls) == cfg.num_layers
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(c1.k_pages + c1.v_pages, c2.k_pages + c2.v_pages, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
