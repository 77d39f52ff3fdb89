"""Paged prefill-attention kernel: interpret mode on the CPU and natively on the GPU (twin classes).

Every case builds a page pool on fresh random inputs with the rows' pages shuffled through it,
poisons every slot that is not a valid key (unused pages, the slots past each row's
``lengths + num_new``) with NaN, fills the unused page-table entries with garbage ids (out of
range, negative, other rows' pages), and checks the kernel against the pure-jnp twin (same math)
and against float64 NumPy causal attention over exactly the keys each real query may see (FP8
pools: the stored E4M3 values times their scale, so the tolerance measures the kernel's compute
error, not quantization). Rows are ragged, chunks continue after existing cache content
(``lengths > 0``: chunked prefill, recompute after preemption), T is not a multiple of the query
block, and a row may have no real token at all.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench.suites import prefill_attention as suite
from fp8rl_jax.models import PagedKVCache
from fp8rl_jax.numerics.fp8 import saturating_cast
from fp8rl_jax.quant.policy import Kernels
from pallas_kernels import prefill_attention as pf

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
F32 = jnp.float32

# max |out - want| / max |want| over the real query rows, keyed by the query (= compute) dtype;
# the GPU's exp and dot orders differ from interpret mode's
TOL_F64 = {F32: 1e-5, BF16: 8e-3}  # vs float64 on the same stored values
TOL_REF = {F32: 1e-5, BF16: 8e-3}  # vs the jnp twin (rounding order only)


def _max_rel(x, want) -> float:
    x, want = np.asarray(x, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(x - want)) / np.max(np.abs(want)))


def make_case(seed, T, lengths, num_new, *, N, K, H, ps, max_pages, pool, q_dtype, spare=3):
    """Returns (kernel args, q64 [B, T, N, H] float64, row_kv: b -> float64 keys, values
    [lengths[b] + num_new[b], K, H] of row b); slots that are not valid keys hold NaN."""
    rng = np.random.default_rng(seed)
    lengths, num_new = np.asarray(lengths, np.int32), np.asarray(num_new, np.int32)
    B = len(lengths)
    ends = lengths + num_new
    need = -(-ends // ps)
    assert need.max() <= max_pages and (num_new <= T).all()
    P = int(need.sum()) + spare
    perm = rng.permutation(P)
    table = rng.choice(np.array([-7, -1, P, P + 5, 2**30, *perm[:4]]), (B, max_pages)).astype(np.int32)
    off = 0
    for b in range(B):
        table[b, : need[b]] = perm[off : off + need[b]]
        off += need[b]
    k32 = rng.standard_normal((P, ps, K, H)).astype(np.float32) * 1.5
    v32 = rng.standard_normal((P, ps, K, H)).astype(np.float32)
    if jnp.dtype(pool) == jnp.dtype(FP8):
        ks, vs = np.abs(k32).max() / 448, np.abs(v32).max() / 448
        kp, vp = saturating_cast(jnp.asarray(k32 / ks)), saturating_cast(jnp.asarray(v32 / vs))
    else:
        ks = vs = 1.0
        kp, vp = jnp.asarray(k32, pool), jnp.asarray(v32, pool)
    valid = np.zeros((P, ps), bool)
    slots = []
    for b in range(B):
        j = np.arange(ends[b])
        slots.append((table[b, j // ps], j % ps))
        valid[slots[b]] = True
    poison = jnp.asarray(valid)[:, :, None, None]
    kp = jnp.where(poison, kp, jnp.asarray(np.nan, F32).astype(kp.dtype))
    vp = jnp.where(poison, vp, jnp.asarray(np.nan, F32).astype(vp.dtype))
    k_f32, v_f32 = np.asarray(kp.astype(F32)), np.asarray(vp.astype(F32))  # the stored values

    def row_kv(b):  # float64 valid keys and values of row b, dequantized
        return (k_f32[slots[b]].astype(np.float64) * np.float64(np.float32(ks)),
                v_f32[slots[b]].astype(np.float64) * np.float64(np.float32(vs)))

    q = jnp.asarray(rng.standard_normal((B, T, N, H)).astype(np.float32), q_dtype)
    args = (q, kp, vp, jnp.float32(ks), jnp.float32(vs), jnp.asarray(table), jnp.asarray(lengths),
            jnp.asarray(num_new))
    return args, np.asarray(q.astype(F32), np.float64), row_kv


def attention_f64(q64, row_kv, lengths, num_new, K, tokens=None):
    """Float64 causal attention of the real queries (or of ``tokens`` only): {(b, t): [N, H]},
    query t of row b seeing keys j <= lengths[b] + t."""
    N, H = q64.shape[2:]
    out = {}
    for b in range(q64.shape[0]):
        keys, vals = row_kv(b)
        for t in range(num_new[b]) if tokens is None else tokens:
            n = lengths[b] + t + 1
            s = np.einsum("kgh,skh->kgs", q64[b, t].reshape(K, N // K, H), keys[:n]) / np.sqrt(H)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, t] = np.einsum("kgs,skh->kgh", p, vals[:n]).reshape(N, H)
    return out


def real_rows(x, num_new) -> np.ndarray:
    x = np.asarray(jnp.asarray(x).astype(F32))
    return np.concatenate([x[b, :n] for b, n in enumerate(num_new)])


CASES = {
    # name: (make_case kwargs, T, lengths, num_new, config)
    "f32-ragged-chunked": (
        {"N": 4, "K": 2, "H": 16, "ps": 4, "max_pages": 12}, 13, [0, 5, 17, 3], [13, 7, 0, 1],
        pf.PrefillAttentionConfig(block_q=8, pages_per_block=2), F32, F32),
    "bf16-G3-Tpad": (
        {"N": 6, "K": 2, "H": 32, "ps": 8, "max_pages": 6}, 20, [0, 9], [20, 11],
        pf.PrefillAttentionConfig(block_q=8, pages_per_block=2), BF16, BF16),
    "fp8-bf16q-G4": (
        {"N": 8, "K": 2, "H": 16, "ps": 16, "max_pages": 5}, 24, [40, 0, 7], [24, 19, 24],
        pf.PrefillAttentionConfig(block_q=16, pages_per_block=1), FP8, BF16),
    "fp8-f32q-mqa-page2": (
        {"N": 4, "K": 1, "H": 16, "ps": 2, "max_pages": 24}, 9, [30, 0], [9, 5],
        pf.PrefillAttentionConfig(block_q=8, pages_per_block=4), FP8, F32),
    "bf16pool-f32q-default": (
        {"N": 4, "K": 2, "H": 16, "ps": 8, "max_pages": 8}, 33, [20, 0], [30, 33], None, BF16, F32),
}


def _case(name, seed=None):
    kw, T, lengths, num_new, cfg, pool, qd = CASES[name]
    args, q64, row_kv = make_case(len(name) if seed is None else seed, T, lengths, num_new, pool=pool, q_dtype=qd,
                                  **kw)
    return args, q64, row_kv, cfg, qd


class TestPrefillAttentionInterpret:
    INTERPRET = True

    @pytest.mark.parametrize("name", list(CASES))
    def test_vs_reference_and_float64(self, name):
        args, q64, row_kv, cfg, qd = _case(name)
        kw, _, lengths, num_new = CASES[name][:4]
        got = pf.prefill_attention(*args, config=cfg, interpret=self.INTERPRET)
        assert got.shape == args[0].shape and got.dtype == args[0].dtype
        g = np.asarray(got.astype(F32))
        assert np.isfinite(g).all(), "poisoned (unwritten) slots reached the output"
        for b, n in enumerate(num_new):
            assert not g[b, n:].any(), f"padded query rows of row {b} are not zero"
        ref = pf.prefill_attention_reference(*args)
        r = np.asarray(ref.astype(F32))
        assert all(not r[b, n:].any() for b, n in enumerate(num_new)), "the twin's padded rows are not zero"
        want_d = attention_f64(q64, row_kv, lengths, num_new, kw["K"])
        want = np.stack([want_d[b, t] for b, n in enumerate(num_new) for t in range(n)])
        assert _max_rel(real_rows(ref, num_new), want) < TOL_F64[qd]
        assert _max_rel(real_rows(got, num_new), want) < TOL_F64[qd], (_max_rel(real_rows(got, num_new), want), name)
        assert _max_rel(got, ref) < TOL_REF[qd], (_max_rel(got, ref), name)

    def test_garbage_and_batch_invariance(self):
        """Other garbage in the unused table entries and slots gives the same bits; a row computed
        in a batch equals the row computed alone (one program per row, block and kv head)."""
        args, _, _, cfg, _ = _case("fp8-bf16q-G4", seed=3)
        got = np.asarray(pf.prefill_attention(*args, config=cfg, interpret=self.INTERPRET).astype(F32))
        q, kp, vp, ks, vs, table, lens, nn = args
        ps = kp.shape[1]
        ends = np.asarray(lens) + np.asarray(nn)
        need = -(-ends // ps)
        used = np.zeros(kp.shape[:2], bool)
        t = np.asarray(table).copy()
        for b, n in enumerate(need):
            j = np.arange(ends[b])
            used[t[b, j // ps], j % ps] = True
            t[b, n:] = 10**6 - b
        fill = jnp.asarray(np.random.default_rng(0).standard_normal(kp.shape) * 100, F32).astype(kp.dtype)
        mask = jnp.asarray(used)[:, :, None, None]
        kp2, vp2 = jnp.where(mask, kp, fill), jnp.where(mask, vp, -fill)
        got2 = pf.prefill_attention(q, kp2, vp2, ks, vs, jnp.asarray(t), lens, nn, config=cfg,
                                    interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(got2.astype(F32)), got)
        b = 0  # the row continuing at 40 keys, alone in a batch of one
        alone = pf.prefill_attention(q[b : b + 1], kp, vp, ks, vs, table[b : b + 1], lens[b : b + 1], nn[b : b + 1],
                                     config=cfg, interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(alone.astype(F32))[0], got[b])

    def test_long_context_fp8_error_flat(self):
        """FP8 KV against float32 KV for a 16-token chunk continuing at 1k and 8k keys: the error
        does not grow with context (needle key aligned with the queries sets the FP8 scale; logits,
        softmax and PV accumulate in float32, so the only FP8 error is storage rounding)."""
        errs = [_needle_fp8_error(ctx, seed=5, N=2, K=1, H=16, interpret=self.INTERPRET, pool_tokens=8192)
                for ctx in (1024, 8192)]
        print(f"FP8 vs f32 KV, prefill kernel output error: {errs[0]:.2e} at 1k, {errs[1]:.2e} at 8k")
        assert errs[0] < 2**-4 and errs[1] < 2**-4
        assert errs[1] < 1.5 * errs[0]

    def test_cache_prefill_uses_kernel(self):
        """PagedKVCache.attend with Kernels.PALLAS for T > 1 == the gather-all reference path on the
        real rows: a first chunk, then a ragged chunk continuing after it (lengths > 0), through an
        FP8 pool (so the cache's scales reach the kernel; other pools: the cases above). AUTO takes
        the kernel exactly on a GPU backend; REFERENCE never."""
        rng = np.random.default_rng(11)
        B, K, G, H, ps, max_pages, T = 3, 2, 2, 16, 4, 8, 11
        auto = PagedKVCache.init(1, 4, ps, K, H, B, max_pages, F32)
        on_gpu = jax.default_backend() == "gpu"
        assert auto._prefill_kernel(2, H) == on_gpu and auto._prefill_kernel(64, H) == on_gpu
        assert not auto._prefill_kernel(1, H) and not auto._prefill_kernel(8, 8)  # decode; head dim 8
        assert not auto.replace(kernels=Kernels.REFERENCE)._prefill_kernel(8, H)
        assert auto.replace(kernels=Kernels.PALLAS)._prefill_kernel(8, H)
        cache = PagedKVCache.init(1, B * max_pages + 2, ps, K, H, B, max_pages, FP8)
        table = rng.permutation(B * max_pages + 2)[: B * max_pages].reshape(B, max_pages)
        cache = cache.replace(page_table=jnp.asarray(table, jnp.int32),
                              k_scale=jnp.array([0.02], F32), v_scale=jnp.array([0.01], F32))
        fn = jax.jit(lambda c, q, k, v, nn: c.attend(0, q, k, v, nn))
        for nn in (np.array([11, 4, 0]), np.array([6, 2, 5])):  # one T for both chunks: one compilation each
            q = jnp.asarray(rng.standard_normal((B, T, K * G, H)), F32)
            k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), F32) for _ in range(2))
            outs, new = {}, {}
            for kern in (Kernels.PALLAS, Kernels.REFERENCE):
                out, new[kern] = fn(cache.replace(kernels=kern), q, k, v, jnp.asarray(nn, jnp.int32))
                outs[kern] = real_rows(out, nn)
            np.testing.assert_array_equal(np.asarray(new[Kernels.PALLAS].k_pages[0].astype(F32)),
                                          np.asarray(new[Kernels.REFERENCE].k_pages[0].astype(F32)))
            err = _max_rel(outs[Kernels.PALLAS], outs[Kernels.REFERENCE])
            assert err < 2e-5, (nn, err)
            cache = new[Kernels.REFERENCE].advance(jnp.asarray(nn, jnp.int32)).replace(kernels=None)
        assert np.asarray(cache.lengths).tolist() == [17, 6, 5]


def _needle_fp8_error(context, *, seed, N, K, H, interpret, T=16, ps=16, bp=16, pool_tokens=None):
    """Relative error of the FP8-pool output against the float32-pool output for a T-token chunk
    whose last query sits at position ``context - 1``. ``pool_tokens`` pads the pool and the page
    table to that many tokens, so several contexts share one compilation."""
    rng = np.random.default_rng(seed)
    G = N // K
    q = rng.standard_normal((1, T, N, H)).astype(np.float32)
    keys = rng.standard_normal((context, K, H)).astype(np.float32) / np.sqrt(H)
    vals = rng.standard_normal((context, K, H)).astype(np.float32)
    direction = q[0].reshape(T, K, G, H).mean((0, 2))
    keys[context // 3] = 30 * direction / np.linalg.norm(direction, axis=-1, keepdims=True)
    n = context // ps
    n_pool = max(n, (pool_tokens or 0) // ps)
    perm = rng.permutation(n_pool)
    kpool = np.zeros((n_pool, ps, K, H), np.float32)
    vpool = np.zeros((n_pool, ps, K, H), np.float32)
    kpool[perm[:n]] = keys.reshape(n, ps, K, H)
    vpool[perm[:n]] = vals.reshape(n, ps, K, H)
    table = jnp.asarray(perm[None], jnp.int32)
    lens, nn = jnp.array([context - T], jnp.int32), jnp.array([T], jnp.int32)
    cfg = pf.PrefillAttentionConfig(block_q=T, pages_per_block=bp)
    one = jnp.float32(1.0)
    ref = pf.prefill_attention(jnp.asarray(q), jnp.asarray(kpool), jnp.asarray(vpool), one, one, table, lens, nn,
                               config=cfg, interpret=interpret)
    ks, vs = np.float32(np.abs(keys).max() / 448), np.float32(np.abs(vals).max() / 448)
    k8, v8 = saturating_cast(jnp.asarray(kpool / ks)), saturating_cast(jnp.asarray(vpool / vs))
    fp8 = pf.prefill_attention(jnp.asarray(q), k8, v8, jnp.float32(ks), jnp.float32(vs), table, lens, nn, config=cfg,
                               interpret=interpret)
    ref, fp8 = np.asarray(ref, np.float64), np.asarray(fp8, np.float64)
    return float(np.linalg.norm(fp8 - ref) / np.linalg.norm(ref))


@pytest.mark.gpu
class TestPrefillAttentionGpu(TestPrefillAttentionInterpret):
    INTERPRET = False


def test_reference_matches_gather_all_path():
    """The twin equals the cache's gather-all read path (every page, dot_attention) on the real rows
    in float32 (no poison: that path reads unwritten slots into masked logits)."""
    kw, T, lengths, num_new, _, _, _ = CASES["f32-ragged-chunked"]
    args, *_ = make_case(1, T, lengths, num_new, pool=F32, q_dtype=F32, **kw)
    kp = jnp.nan_to_num(args[1])
    vp = jnp.nan_to_num(args[2])
    args = (args[0], kp, vp, *args[3:])
    table = jnp.clip(args[5], 0, kp.shape[0] - 1)
    dense = suite.gather_all_attention(*args[:5], table, *args[6:])
    twin = pf.prefill_attention_reference(*args)
    np.testing.assert_allclose(real_rows(twin, num_new), real_rows(dense, num_new), rtol=1e-5, atol=1e-6)


def test_cpu_default_is_the_reference():
    """Off the GPU the default (AUTO) cache runs the gather-all reference for T > 1, bit for bit."""
    if jax.default_backend() == "gpu":
        pytest.skip("AUTO takes the kernel on a GPU")
    rng = np.random.default_rng(2)
    B, K, N, H, ps, max_pages, T = 2, 2, 4, 16, 4, 6, 9
    cache = PagedKVCache.init(1, B * max_pages, ps, K, H, B, max_pages, BF16)
    cache = cache.replace(page_table=jnp.asarray(rng.permutation(B * max_pages).reshape(B, max_pages), jnp.int32),
                          lengths=jnp.array([3, 0], jnp.int32))
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), BF16)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), BF16) for _ in range(2))
    nn = jnp.array([9, 4], jnp.int32)
    fn = jax.jit(lambda c, q, k, v, nn: c.attend(0, q, k, v, nn)[0])
    default = np.asarray(fn(cache, q, k, v, nn).astype(F32))
    reference = np.asarray(fn(cache.replace(kernels=Kernels.REFERENCE), q, k, v, nn).astype(F32))
    np.testing.assert_array_equal(default, reference)
    assert reference[1, 4:].any()  # padded rows: arbitrary here, zero from the kernel (so the check can fail)


def test_validation_errors():
    args, *_ = _case("bf16-G3-Tpad")
    q, kp, vp, ks, vs, table, lens, nn = args
    bad = {
        "q must be bfloat16 or float32": (q.astype(jnp.float16), kp, vp, ks, vs, table, lens, nn),
        "q must be \\[B, T, N, H\\]": (q[:, 0], kp, vp, ks, vs, table, lens, nn),
        "must match": (q, kp, vp.astype(F32), ks, vs, table, lens, nn),
        "multiple of K=2": (q[:, :, :3], kp, vp, ks, vs, table, lens, nn),
        "head dims differ": (q[..., :16], kp, vp, ks, vs, table, lens, nn),
        "page_table must be \\[B=2": (q, kp, vp, ks, vs, table[:1], lens, nn),
        "num_new must be \\[B=2\\]": (q, kp, vp, ks, vs, table, lens, nn[:1]),
        "lengths must be int32": (q, kp, vp, ks, vs, table, lens.astype(F32), nn),
        "num_new must be int32": (q, kp, vp, ks, vs, table, lens, nn.astype(F32)),
        "k_scale must be one float32 scalar": (q, kp, vp, jnp.ones((2,), F32), vs, table, lens, nn),
        "page pools must be one of": (q, kp.astype(jnp.int8), vp.astype(jnp.int8), ks, vs, table, lens, nn),
    }
    for msg, bad_args in bad.items():
        with pytest.raises(ValueError, match=msg):
            pf.prefill_attention(*bad_args, interpret=True)
    with pytest.raises(ValueError, match="head_dim \\(8\\)"):
        pf.prefill_attention(q[..., :8], kp[..., :8], vp[..., :8], ks, vs, table, lens, nn, interpret=True)
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        pf.PrefillAttentionConfig(block_q=24)
    with pytest.raises(ValueError, match="config must be a PrefillAttentionConfig"):
        pf.prefill_attention(*args, config=dataclasses.asdict(pf.DEFAULT_CONFIG), interpret=True)


def test_fit_config_and_flops():
    c = pf.fit_config(pf.DEFAULT_CONFIG, T=1024, G=4, page_size=16, head_dim=128, pool_dtype=BF16)
    assert c == pf.DEFAULT_CONFIG
    assert pf.fit_config(pf.DEFAULT_CONFIG, T=5, G=1, page_size=2, head_dim=16, pool_dtype=BF16).block_q == 16
    assert pf.fit_config(pf.DEFAULT_CONFIG, T=5, G=4, page_size=2, head_dim=16, pool_dtype=BF16).block_q == 8
    assert pf.fit_config(pf.DEFAULT_CONFIG, T=5, G=4, page_size=2, head_dim=16, pool_dtype=BF16).pages_per_block == 8
    big = pf.PrefillAttentionConfig(block_q=64, pages_per_block=16, num_stages=3)
    for pool, qd in ((F32, F32), (BF16, BF16), (FP8, BF16)):  # a float32 pool at H = 128 overflowed in decode
        c = pf.fit_config(big, T=512, G=4, page_size=16, head_dim=128, pool_dtype=pool, q_dtype=qd)
        assert c.pages_per_block < 16 and c.block_q * 4 >= 16 and c.pages_per_block * 16 >= 16
        assert pf.smem_bytes(c.block_q, c.pages_per_block, 4, 16, 128, pool, qd, 3) <= pf._SMEM_BUDGET
        assert pf.smem_bytes(c.block_q * 2, c.pages_per_block * 2, 4, 16, 128, pool, qd, 3) > pf._SMEM_BUDGET
    # 2 rows: 3 new tokens after 2 cached keys (3 + 4 + 5 keys) and 2 from scratch (1 + 2)
    assert suite.attention_flops(np.array([2, 0]), np.array([3, 2]), 1, 1) == 4 * 15


def test_benchmark_suite_smoke():
    """The runner's suite on its CPU smoke flags (interpret mode off the GPU): every config timed, each within the
    twin's tolerance, the gather-all baseline timed, FLOPs as `attention_flops` counts them."""
    parser = argparse.ArgumentParser()
    suite.add_arguments(parser)
    args = parser.parse_args(suite.SMOKE)
    payload = suite.run(args)
    assert payload["results"]
    for row in payload["results"]:
        assert row["flops"] == suite.attention_flops(np.full(row["B"], row["lengths"]), np.full(row["B"], row["T"]),
                                                     *args.heads[::2])
        assert row["configs"] and all("error" not in c and c["ms"] > 0 for c in row["configs"])
        assert row["best"]["max_rel_err"] < TOL_REF[BF16] and row["gather_all_ms"] > 0


@pytest.mark.gpu
class TestFullSizeGpu:
    """Qwen3-8B attention sizes (N=32, K=8, H=128, pages of 16) natively on the GPU."""

    @pytest.mark.parametrize("pool", [BF16, FP8], ids=["bf16", "fp8"])
    @pytest.mark.parametrize("chunked", [False, True], ids=["prompt", "chunk@2k"])
    def test_vs_reference(self, pool, chunked):
        rng = np.random.default_rng(int(chunked))
        B, T = 4, 256
        lengths = rng.integers(1500, 2049, B) if chunked else np.zeros(B, np.int64)
        num_new = rng.integers(1, T + 1, B)
        num_new[0] = T
        kw = {"N": 32, "K": 8, "H": 128, "ps": 16, "max_pages": 147}
        args, q64, row_kv = make_case(B, T, lengths, num_new, pool=pool, q_dtype=BF16, **kw)
        got = pf.prefill_attention(*args, interpret=False)
        assert np.isfinite(np.asarray(got.astype(F32))).all()
        assert _max_rel(got, pf.prefill_attention_reference(*args)) < TOL_REF[BF16]
        idx = [0, 1, T // 2, T - 1]  # float64 on a few queries of row 0 keeps it short
        want = attention_f64(q64[:1], row_kv, lengths[:1], num_new[:1], 8, tokens=idx)
        g = np.asarray(got.astype(F32))[0, idx]
        assert _max_rel(g, np.stack([want[0, t] for t in idx])) < TOL_F64[BF16]

    def test_long_context_fp8_error_flat(self):
        errs = [_needle_fp8_error(ctx, seed=7, N=32, K=8, H=128, T=64, interpret=False, bp=4)
                for ctx in (1024, 8192, 32768)]
        print("FP8 vs f32 KV at 1k/8k/32k:", errs)
        assert max(errs) < 2**-4
        assert errs[1] < 1.5 * errs[0] and errs[2] < 1.5 * errs[0]


@pytest.mark.gpu
def test_engine_prefill_with_kernel_gpu():
    """The rollout engine through both kernels (prefill buckets, preemption with recompute under a
    tiny page budget) samples the same tokens as through the reference read paths: float32 compute
    over an FP8 KV pool."""
    from configs.models import tiny_qwen3
    from fp8rl_jax.models import Fp8Mode, init_params
    from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
    from fp8rl_jax.rollout.sampling import SamplingConfig

    cfg = tiny_qwen3
    ec = EngineConfig(max_slots=3, page_size=4, num_pages=8, max_seq_len=64, steps_per_call=3, prefill_batch=2,
                      prefill_buckets=(8, 16, 32, 64), dtype="float32", precision=Fp8Mode.KV)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    params = jax.tree.map(lambda w: w * 50 / np.sqrt(w.shape[-1]) if w.ndim >= 2 else w, params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in [3, 12, 7, 1, 9]]
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    out = {}
    for kern in (Kernels.REFERENCE, Kernels.PALLAS):
        engine = JaxEngine(cfg, params, ec)
        engine.cache = engine.cache.replace(kernels=kern)
        out[kern] = engine.generate(prompts, sampling)
    assert out[Kernels.PALLAS].preemptions > 0
    assert out[Kernels.PALLAS].token_lists() == out[Kernels.REFERENCE].token_lists()
    np.testing.assert_allclose(out[Kernels.PALLAS].logprobs, out[Kernels.REFERENCE].logprobs, atol=1e-4)
