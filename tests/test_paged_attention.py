"""Paged-attention decode kernel: interpret mode on the CPU and natively on the GPU (twin classes).

Every case builds a page pool on fresh random inputs with the rows' pages shuffled through it,
poisons every slot that is not a valid key (unused pages, the tail of each last page) with NaN,
fills the unused page-table entries with garbage ids (out of range, negative, other rows'
pages), and checks the kernel against the pure-jnp twin (same math) and against float64 NumPy
attention over exactly the keys below each row's length (FP8 pools: the stored E4M3 values times
their scale, so the tolerance measures the kernel's compute error, not quantization).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench.suites import paged_attention as suite
from fp8rl_jax.models import PagedKVCache
from fp8rl_jax.models.attention import dot_attention
from fp8rl_jax.numerics.fp8 import saturating_cast
from fp8rl_jax.quant.policy import Kernels
from pallas_kernels import paged_attention as pa

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
F32 = jnp.float32

# max |out - want| / max |want|, keyed by the query (= compute) dtype
# (measured in interpret mode: f32 <= 3e-7, bf16 <= 2e-3; the GPU's exp and dot orders differ)
TOL_F64 = {F32: 1e-5, BF16: 8e-3}  # vs float64 on the same stored values
TOL_REF = {F32: 1e-5, BF16: 8e-3}  # vs the jnp twin (rounding order only)


def _max_rel(x, want) -> float:
    x, want = np.asarray(x, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(x - want)) / np.max(np.abs(want)))


def make_case(seed, lengths, *, N, K, H, ps, max_pages, pool, q_dtype, spare=3, poison=True):
    """Returns (args for the kernel, q64 [B, N, H] float64, row_kv: b -> float64 keys, values
    [len_b, K, H] of row b)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    B = len(lengths)
    need = -(-lengths // ps)
    assert need.max() <= max_pages
    P = int(need.sum()) + spare
    perm = rng.permutation(P)
    # garbage in the unused entries: out of range both ways, huge, and real pages of other rows
    table = rng.choice(np.array([-7, -1, P, P + 5, 2**30, *perm[:4]]), (B, max_pages)).astype(np.int32)
    off = 0
    for b in range(B):
        table[b, : need[b]] = perm[off : off + need[b]]
        off += need[b]
    k32 = rng.standard_normal((P, ps, K, H)).astype(np.float32) * 1.5
    v32 = rng.standard_normal((P, ps, K, H)).astype(np.float32)
    if jnp.dtype(pool) == jnp.dtype(FP8):
        ks, vs = np.abs(k32).max() / 448, np.abs(v32).max() / 448
        kp = saturating_cast(jnp.asarray(k32 / ks))
        vp = saturating_cast(jnp.asarray(v32 / vs))
    else:
        ks = vs = 1.0
        kp, vp = jnp.asarray(k32, pool), jnp.asarray(v32, pool)
    k_f32, v_f32 = np.asarray(kp.astype(F32)), np.asarray(vp.astype(F32))  # the stored values
    valid = np.zeros((P, ps), bool)
    slots = []
    for b in range(B):
        j = np.arange(lengths[b])
        slots.append((table[b, j // ps], j % ps))
        valid[slots[b]] = True

    def row_kv(b):  # float64 keys and values below row b's length, dequantized
        return (k_f32[slots[b]].astype(np.float64) * np.float64(np.float32(ks)),
                v_f32[slots[b]].astype(np.float64) * np.float64(np.float32(vs)))

    q = jnp.asarray(rng.standard_normal((B, N, H)).astype(np.float32), q_dtype)
    args = (q, kp, vp, jnp.float32(ks), jnp.float32(vs), jnp.asarray(table), jnp.asarray(lengths))
    return args, np.asarray(q.astype(F32), np.float64), row_kv


def attention_f64(q64, row_kv, K, rows=None):
    """Float64 softmax attention of rows ``rows`` (default all) -> [len(rows), N, H]."""
    rows = range(q64.shape[0]) if rows is None else rows
    N, H = q64.shape[1:]
    out = []
    for b in rows:
        keys, vals = row_kv(b)
        s = np.einsum("kgh,skh->kgs", q64[b].reshape(K, N // K, H), keys) / np.sqrt(H)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("kgs,skh->kgh", p, vals).reshape(N, H))
    return np.stack(out)


def _pallas_grid(fn, *args) -> tuple:
    """The grid of the (first) pallas_call that ``fn(*args)`` traces to."""
    def find(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                return e.params["grid_mapping"].grid
            for sub in jex.core.jaxprs_in_params(e.params):
                if (g := find(sub)) is not None:
                    return g
        return None

    return find(jax.make_jaxpr(fn)(*args).jaxpr)


CASES = {
    # name: (make_case kwargs, lengths, config); lengths cover 1, partial last pages, many pages
    "f32-split4-ragged": (
        {"N": 4, "K": 2, "H": 16, "ps": 4, "max_pages": 12, "pool": F32, "q_dtype": F32}, [1, 5, 13, 37],
        pa.PagedAttentionConfig(pages_per_block=2, pages_per_split=3, max_splits=4)),
    "bf16-nosplit": (
        {"N": 4, "K": 2, "H": 16, "ps": 4, "max_pages": 12, "pool": BF16, "q_dtype": BF16}, [37, 1, 4, 17],
        pa.PagedAttentionConfig(pages_per_block=4, pages_per_split=64)),
    "fp8-bf16q-G3-split": (
        {"N": 6, "K": 2, "H": 32, "ps": 8, "max_pages": 10, "pool": FP8, "q_dtype": BF16}, [9, 64, 1],
        pa.PagedAttentionConfig(pages_per_block=2, pages_per_split=2, max_splits=3)),
    "fp8-bf16q-f16dots-split": (
        {"N": 8, "K": 2, "H": 32, "ps": 4, "max_pages": 12, "pool": FP8, "q_dtype": BF16}, [45, 3, 16],
        pa.PagedAttentionConfig(pages_per_block=2, pages_per_split=4, max_splits=3, fp8_dot_dtype="float16")),
    "fp8-bf16q-f16dots-words": (
        {"N": 8, "K": 2, "H": 64, "ps": 4, "max_pages": 12, "pool": FP8, "q_dtype": BF16}, [45, 3, 16],
        pa.PagedAttentionConfig(pages_per_block=2, pages_per_split=4, max_splits=3, fp8_dot_dtype="float16",
                                fp8_word_gather=True)),
    "fp8-bf16q-f16dots-words-nosplit": (
        {"N": 4, "K": 1, "H": 128, "ps": 16, "max_pages": 6, "pool": FP8, "q_dtype": BF16}, [70, 16, 1],
        pa.PagedAttentionConfig(pages_per_block=1, pages_per_split=64, num_warps=1, fp8_dot_dtype="float16",
                                fp8_word_gather=True)),
    "fp8-f32q-mqa-G8": (
        {"N": 8, "K": 1, "H": 16, "ps": 16, "max_pages": 8, "pool": FP8, "q_dtype": F32}, [17, 100],
        pa.PagedAttentionConfig(pages_per_block=1, pages_per_split=4, max_splits=2)),
    "bf16pool-f32q-page2": (
        {"N": 2, "K": 1, "H": 16, "ps": 2, "max_pages": 20, "pool": BF16, "q_dtype": F32}, [39, 2, 3],
        pa.PagedAttentionConfig(pages_per_block=8, pages_per_split=8)),
}


# Interpret mode compiles a large program per kernel shape and config (seconds each on the CPU): the interpret twin
# runs the cases below, one of each config class; the GPU twin runs every case.
# (fp8-bf16q-f16dots-split: its float16 dots and splits are fp8-bf16q-f16dots-words' too)
INTERPRET_CASES = [name for name in CASES if name != "fp8-bf16q-f16dots-split"]
# kv_heads_per_program > 1: all of K=2 heads (f32, bf16 HND, fp8 with 4 asked), and 2 of K=4 (fp8 word gathers, HND)
SEVERAL_HEADS = [("f32-split4-ragged", 2, pa.KvLayout.NHD), ("bf16-nosplit", 2, pa.KvLayout.HND),
                 ("fp8-bf16q-G3-split", 4, pa.KvLayout.NHD), ("fp8-kv4", 2, pa.KvLayout.HND)]
SEVERAL_HEADS_GPU = SEVERAL_HEADS + [("fp8-bf16q-f16dots-words", 2, pa.KvLayout.HND), ("fp8-kv4", 4, pa.KvLayout.NHD)]
# heads-fastest grids: word gathers (one head per program), and several heads per program with splits, HND
HEADS_FASTEST = [("fp8-bf16q-f16dots-words", 1, pa.KvLayout.NHD), ("fp8-bf16q-G3-split", 2, pa.KvLayout.HND)]
HEADS_FASTEST_GPU = HEADS_FASTEST + [("f32-split4-ragged", 1, pa.KvLayout.NHD), ("bf16-nosplit", 1, pa.KvLayout.NHD)]


class TestPagedAttentionInterpret:
    INTERPRET = True

    @pytest.mark.parametrize("name", INTERPRET_CASES)
    def test_vs_reference_and_float64(self, name):
        kw, lengths, cfg = CASES[name]
        args, q64, row_kv = make_case(len(name), lengths, **kw)
        got = pa.paged_attention(*args, config=cfg, interpret=self.INTERPRET)
        assert got.shape == args[0].shape and got.dtype == args[0].dtype
        assert np.isfinite(np.asarray(got.astype(F32))).all(), "poisoned (unused) slots reached the output"
        ref = pa.paged_attention_reference(*args, config=cfg)
        want = attention_f64(q64, row_kv, kw["K"])
        qd = kw["q_dtype"]
        assert _max_rel(ref, want) < TOL_F64[qd]
        assert _max_rel(got, want) < TOL_F64[qd], (_max_rel(got, want), name)
        assert _max_rel(got, ref) < TOL_REF[qd], (_max_rel(got, ref), name)

    def test_f16_dots_clamp_huge_queries(self):
        """float16 dots of an FP8 pool: a bfloat16 query beyond float16's range is clamped to it (no
        inf, no NaN); the result equals the twin's, which clamps the same way."""
        kw = {"N": 4, "K": 1, "H": 16, "ps": 4, "max_pages": 6, "pool": FP8, "q_dtype": BF16}
        args, _, _ = make_case(5, [7, 22], **kw)
        q = args[0].at[0, 1, 3].set(1e6).at[1, 0, 0].set(-3e5)
        args = (q, *args[1:])
        cfg = pa.PagedAttentionConfig(pages_per_block=4, pages_per_split=64, fp8_dot_dtype="float16")
        got = np.asarray(pa.paged_attention(*args, config=cfg, interpret=self.INTERPRET).astype(F32))
        ref = np.asarray(pa.paged_attention_reference(*args, config=cfg).astype(F32))
        assert np.isfinite(got).all()
        assert _max_rel(got, ref) < TOL_REF[BF16]

    def test_garbage_and_batch_invariance(self):
        """Different garbage in unused entries and slots gives the same bits; a row computed in a
        batch equals the row computed alone (its split depends on its length only)."""
        kw, lengths, cfg = CASES["fp8-bf16q-G3-split"]
        args, *_ = make_case(3, lengths, **kw)
        got = np.asarray(pa.paged_attention(*args, config=cfg, interpret=self.INTERPRET).astype(F32))
        q, kp, vp, ks, vs, table, lens = args
        ps = kp.shape[1]
        need = -(-np.asarray(lens) // ps)
        used = np.zeros(kp.shape[:2], bool)
        t = np.asarray(table).copy()
        for b, n in enumerate(need):
            used[t[b, :n]] = True
            t[b, n:] = 10**6 - b  # other garbage ids
        for b, L in enumerate(np.asarray(lens)):
            if L % ps:
                used[t[b, need[b] - 1], L % ps :] = False
        fill = jnp.asarray(np.random.default_rng(0).standard_normal(kp.shape) * 100, F32).astype(kp.dtype)
        mask = jnp.asarray(used)[:, :, None, None]
        kp2, vp2 = jnp.where(mask, kp, fill), jnp.where(mask, vp, -fill)
        got2 = pa.paged_attention(q, kp2, vp2, ks, vs, jnp.asarray(t), lens, config=cfg, interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(got2.astype(F32)), got)
        b = 1  # the longest row (split 3 ways), alone in a batch of one
        alone = pa.paged_attention(q[b : b + 1], kp, vp, ks, vs, table[b : b + 1], lens[b : b + 1], config=cfg,
                                   interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(alone.astype(F32))[0], got[b])

    @pytest.mark.parametrize("name", ["fp8-bf16q-G3-split", "f32-split4-ragged"])
    def test_hnd_layout_equals_nhd(self, name):
        """The same pages stored head-major ([P, K, page_size, H]) give the same bits."""
        kw, lengths, cfg = CASES[name]
        args, *_ = make_case(11, lengths, **kw)
        q, kp, vp, ks, vs, table, lens = args
        nhd = pa.paged_attention(*args, config=cfg, interpret=self.INTERPRET)
        hnd = pa.paged_attention(q, jnp.transpose(kp, (0, 2, 1, 3)), jnp.transpose(vp, (0, 2, 1, 3)), ks, vs,
                                 table, lens, config=cfg, interpret=self.INTERPRET, layout=pa.KvLayout.HND)
        np.testing.assert_array_equal(np.asarray(hnd.astype(F32)), np.asarray(nhd.astype(F32)))

    @pytest.mark.parametrize("name,heads,layout", SEVERAL_HEADS)
    def test_several_kv_heads_per_program_give_the_same_bits(self, name, heads, layout):
        """kv_heads_per_program > 1 (the heads share a block loop and its page ids, each with its own
        softmax state) gives the bits of one head per program, splits and word gathers included; where
        it does not divide the kv heads (4 of 2), the largest power of two that does is used."""
        kw, lengths, cfg = CASES[name] if name in CASES else (
            {"N": 8, "K": 4, "H": 64, "ps": 4, "max_pages": 12, "pool": FP8, "q_dtype": BF16}, [45, 3, 16, 30],
            pa.PagedAttentionConfig(pages_per_block=2, pages_per_split=4, max_splits=3, fp8_dot_dtype="float16",
                                    fp8_word_gather=True))
        args, q64, row_kv = make_case(len(name) + heads, lengths, **kw)
        q, kp, vp, ks, vs, table, lens = args
        if layout is pa.KvLayout.HND:
            kp, vp = jnp.transpose(kp, (0, 2, 1, 3)), jnp.transpose(vp, (0, 2, 1, 3))
        one = pa.paged_attention(q, kp, vp, ks, vs, table, lens, config=cfg, interpret=self.INTERPRET, layout=layout)
        many_cfg = dataclasses.replace(cfg, kv_heads_per_program=heads)
        assert pa.kv_heads_per_program(many_cfg, kw["K"]) == min(heads, kw["K"])
        many = pa.paged_attention(q, kp, vp, ks, vs, table, lens, config=many_cfg, interpret=self.INTERPRET,
                                  layout=layout)
        np.testing.assert_array_equal(np.asarray(many.astype(F32)), np.asarray(one.astype(F32)))
        assert _max_rel(many, attention_f64(q64, row_kv, kw["K"])) < TOL_F64[kw["q_dtype"]]

    @pytest.mark.parametrize("name,heads,layout", HEADS_FASTEST)
    def test_heads_fastest_launch_order_gives_the_same_bits(self, name, heads, layout):
        """The (kv heads, rows, splits) grid computes every program as the (rows, kv heads, splits) one
        does: the same bits, splits, word gathers and several heads per program included."""
        kw, lengths, cfg = CASES[name]
        cfg = dataclasses.replace(cfg, kv_heads_per_program=heads)
        args, q64, row_kv = make_case(len(name) + 7, lengths, **kw)
        q, kp, vp, ks, vs, table, lens = args
        if layout is pa.KvLayout.HND:
            kp, vp = jnp.transpose(kp, (0, 2, 1, 3)), jnp.transpose(vp, (0, 2, 1, 3))
        rows = pa.paged_attention(q, kp, vp, ks, vs, table, lens, config=cfg, interpret=self.INTERPRET, layout=layout)
        heads_cfg = dataclasses.replace(cfg, heads_fastest=True)
        got = pa.paged_attention(q, kp, vp, ks, vs, table, lens, config=heads_cfg, interpret=self.INTERPRET,
                                 layout=layout)
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(rows.astype(F32)))
        assert _max_rel(got, attention_f64(q64, row_kv, kw["K"])) < TOL_F64[kw["q_dtype"]]
        B, K = q.shape[0], kw["K"] // pa.kv_heads_per_program(cfg, kw["K"])
        grids = [_pallas_grid(lambda *a, c=c: pa.paged_attention(*a, config=c, interpret=True, layout=layout),
                              q, kp, vp, ks, vs, table, lens) for c in (cfg, heads_cfg)]
        assert [g[:2] for g in grids] == [(B, K), (K, B)]

    def test_long_context_fp8_error_flat(self):
        """FP8 KV against float32 KV at 1k and 8k keys: the error does not grow with context.

        One query per kv head, keys of norm ~1 plus a needle key aligned with the query (it sets
        the FP8 scale, so the haystack keeps fewer bits). Logits, softmax and PV accumulate in
        float32, so the only FP8 error is storage rounding (<= 2^-4 relative per element), not
        an accumulation growing with the number of keys. Small heads keep interpret mode fast;
        the GPU twin runs the same check, and `TestFullSizeGpu` at Qwen3-8B head sizes.
        """
        errs = [_needle_fp8_error(ctx, seed=5, N=2, K=1, H=16, interpret=self.INTERPRET) for ctx in (1024, 8192)]
        print(f"FP8 vs f32 KV, kernel output error: {errs[0]:.2e} at 1k, {errs[1]:.2e} at 8k")
        assert errs[0] < 2**-4 and errs[1] < 2**-4
        assert errs[1] < 1.5 * errs[0]

    def test_cache_decode_uses_kernel(self):
        """PagedKVCache.attend with Kernels.PALLAS (decode) == the reference path, f32 and FP8 pools
        (scaled); AUTO (the default) takes the kernel exactly on a GPU backend, for decode only."""
        rng = np.random.default_rng(9)
        B, K, G, H, ps, max_pages = 3, 2, 2, 16, 4, 6
        auto = PagedKVCache.init(1, 4, ps, K, H, B, max_pages, F32)
        assert auto.kernels is None and not auto._decode_kernel(2, H) and not auto._decode_kernel(1, 8)
        assert auto._decode_kernel(1, H) == (jax.default_backend() == "gpu")
        assert not auto.replace(kernels=Kernels.REFERENCE)._decode_kernel(1, H)
        for dtype in (F32, FP8):
            cache = PagedKVCache.init(1, B * max_pages + 2, ps, K, H, B, max_pages, dtype)
            table = rng.permutation(B * max_pages + 2)[: B * max_pages].reshape(B, max_pages)
            cache = cache.replace(page_table=jnp.asarray(table, jnp.int32),
                                  k_scale=jnp.array([0.02], F32), v_scale=jnp.array([0.01], F32))
            T0 = 17
            kv = lambda T: jnp.asarray(rng.standard_normal((B, T, K, H)), F32)
            # the prefill jitted: eagerly each of its ops would compile on its own
            _, cache = jax.jit(lambda c, q, k, v, n: c.attend(0, q, k, v, n))(
                cache, jnp.zeros((B, T0, K * G, H), F32), kv(T0), kv(T0), jnp.array([3, 17, 9]))
            cache = cache.advance(jnp.array([3, 17, 9]))
            q, k1, v1 = jnp.asarray(rng.standard_normal((B, 1, K * G, H)), F32), kv(1), kv(1)
            outs = {}
            for kern in (Kernels.PALLAS, Kernels.REFERENCE):
                fn = jax.jit(lambda c, q, k, v: c.attend(0, q, k, v, jnp.array([1, 1, 0])))
                out, new = fn(cache.replace(kernels=kern), q, k1, v1)
                outs[kern] = np.asarray(out)
                np.testing.assert_array_equal(np.asarray(new.k_pages[0].astype(F32)),
                                              np.asarray(outs.setdefault("pages", new.k_pages[0]).astype(F32)))
            tol = 2e-5 if dtype == F32 else 2e-3  # FP8: the reference rounds k8 * scale to f32 first
            assert _max_rel(outs[Kernels.PALLAS], outs[Kernels.REFERENCE]) < tol


def _needle_fp8_error(context, *, seed, N, K, H, interpret, ps=16, bp=16):
    rng = np.random.default_rng(seed)
    G = N // K
    q = rng.standard_normal((1, N, H)).astype(np.float32)
    keys = rng.standard_normal((context, K, H)).astype(np.float32) / np.sqrt(H)
    vals = rng.standard_normal((context, K, H)).astype(np.float32)
    direction = q[0].reshape(K, G, H).mean(1)
    keys[context // 3] = 30 * direction / np.linalg.norm(direction, axis=-1, keepdims=True)
    n = context // ps
    perm = rng.permutation(n)
    kpool = np.zeros((n, ps, K, H), np.float32)
    vpool = np.zeros((n, ps, K, H), np.float32)
    kpool[perm] = keys.reshape(n, ps, K, H)
    vpool[perm] = vals.reshape(n, ps, K, H)
    table, lens = jnp.asarray(perm[None], jnp.int32), jnp.array([context], jnp.int32)
    cfg = pa.PagedAttentionConfig(pages_per_block=bp, pages_per_split=64)
    one = jnp.float32(1.0)
    ref = pa.paged_attention(jnp.asarray(q), jnp.asarray(kpool), jnp.asarray(vpool), one, one, table, lens,
                             config=cfg, interpret=interpret)
    ks, vs = np.float32(np.abs(keys).max() / 448), np.float32(np.abs(vals).max() / 448)
    k8, v8 = saturating_cast(jnp.asarray(kpool / ks)), saturating_cast(jnp.asarray(vpool / vs))
    fp8 = pa.paged_attention(jnp.asarray(q), k8, v8, jnp.float32(ks), jnp.float32(vs), table, lens, config=cfg,
                             interpret=interpret)
    ref, fp8 = np.asarray(ref, np.float64), np.asarray(fp8, np.float64)
    return float(np.linalg.norm(fp8 - ref) / np.linalg.norm(ref))


@pytest.mark.gpu
class TestPagedAttentionGpu(TestPagedAttentionInterpret):
    """Every case natively (the interpret twin runs a subset: see INTERPRET_CASES)."""

    INTERPRET = False

    @pytest.mark.parametrize("name", list(CASES))
    def test_vs_reference_and_float64(self, name):
        super().test_vs_reference_and_float64(name)

    @pytest.mark.parametrize("name,heads,layout", SEVERAL_HEADS_GPU)
    def test_several_kv_heads_per_program_give_the_same_bits(self, name, heads, layout):
        super().test_several_kv_heads_per_program_give_the_same_bits(name, heads, layout)

    @pytest.mark.parametrize("name,heads,layout", HEADS_FASTEST_GPU)
    def test_heads_fastest_launch_order_gives_the_same_bits(self, name, heads, layout):
        super().test_heads_fastest_launch_order_gives_the_same_bits(name, heads, layout)


def test_reference_matches_dense_path():
    """The twin equals the cache's old read path (gather every page, dot_attention) in float32."""
    kw, lengths, _ = CASES["f32-split4-ragged"]
    args, *_ = make_case(1, lengths, **kw, poison=False)
    q, kp, vp, _, _, table, lens = args
    B, _, H = q.shape
    ps, K = kp.shape[1], kp.shape[2]
    S = table.shape[1] * ps
    kg = kp[jnp.clip(table, 0, kp.shape[0] - 1)].reshape(B, S, K, H)
    vg = vp[jnp.clip(table, 0, kp.shape[0] - 1)].reshape(B, S, K, H)
    mask = (jnp.arange(S)[None, :] < lens[:, None])[:, None]
    dense = dot_attention(q[:, None], kg, vg, mask)[:, 0]
    np.testing.assert_allclose(np.asarray(pa.paged_attention_reference(*args)), np.asarray(dense), rtol=1e-5,
                               atol=1e-6)


def test_validation_errors():
    kw, lengths, _ = CASES["bf16-nosplit"]
    args, *_ = make_case(0, lengths, **kw)
    q, kp, vp, ks, vs, table, lens = args
    bad = {
        "q must be bfloat16 or float32": (q.astype(jnp.float16), kp, vp, ks, vs, table, lens),
        "q must be \\[B, N, H\\]": (q[:, None], kp, vp, ks, vs, table, lens),
        "must match": (q, kp, vp.astype(F32), ks, vs, table, lens),
        "multiple of K=2": (q[:, :3], kp, vp, ks, vs, table, lens),
        "head dims differ": (q[..., :8], kp, vp, ks, vs, table, lens),
        "page_table must be \\[B=4": (q, kp, vp, ks, vs, table[:2], lens),
        "lengths must be int32": (q, kp, vp, ks, vs, table, lens.astype(F32)),
        "k_scale must be one float32 scalar": (q, kp, vp, jnp.ones((2,), F32), vs, table, lens),
        "page pools must be one of": (q, kp.astype(jnp.int8), vp.astype(jnp.int8), ks, vs, table, lens),
    }
    for msg, bad_args in bad.items():
        with pytest.raises(ValueError, match=msg):
            pa.paged_attention(*bad_args, interpret=True)
    with pytest.raises(ValueError, match="head_dim \\(8\\)"):
        pa.paged_attention(q[..., :8], kp[..., :8], vp[..., :8], ks, vs, table, lens, interpret=True)
    with pytest.raises(ValueError, match="pages_per_block must be a power of two"):
        pa.PagedAttentionConfig(pages_per_block=3)
    with pytest.raises(ValueError, match="config must be a PagedAttentionConfig"):
        pa.paged_attention(*args, config=dataclasses.asdict(pa.DEFAULT_CONFIG), interpret=True)
    with pytest.raises(ValueError, match="fp8_dot_dtype must be one of"):
        pa.PagedAttentionConfig(fp8_dot_dtype="float8_e4m3fn")


def test_default_config_reads_the_tuning_table_of_this_device_kind(tmp_path, monkeypatch):
    """An entry measured on another device kind is never used; a matching one is, per pool dtype."""
    fp8_cfg = pa.PagedAttentionConfig(pages_per_block=2, num_warps=1, num_stages=7, fp8_dot_dtype="float16")
    table = {"entries": [
        {"device_kind": "NVIDIA H200", "pool": "float8_e4m3fn", "config": dataclasses.asdict(fp8_cfg)},
        {"device_kind": "other", "pool": "bfloat16", "config": dataclasses.asdict(pa.PagedAttentionConfig(
            pages_per_block=16))},
    ]}
    path = tmp_path / "tuning.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setattr(pa, "TUNING_FILE", path)
    pa._tuning.cache_clear()
    try:
        monkeypatch.setattr(pa, "_device_kind", lambda: "NVIDIA H200")
        assert pa.default_config(FP8) == fp8_cfg
        assert pa.default_config(BF16) == pa.DEFAULT_CONFIG
        assert pa.describe_config(FP8) == {"table": str(path), "device_kind": "NVIDIA H200",
                                           "config": dataclasses.asdict(fp8_cfg)}
        monkeypatch.setattr(pa, "_device_kind", lambda: "cpu")
        assert pa.default_config(FP8) == pa.DEFAULT_CONFIG
    finally:
        pa._tuning.cache_clear()


def test_table_candidate_skips_configs_below_min_warps():
    """The tuning table takes the fastest config with enough warps (one-warp configs stalled W1
    rollouts on the H200); failed configs are ignored; none qualifying gives None."""
    one = {"config": dataclasses.asdict(pa.PagedAttentionConfig(pages_per_block=2, num_warps=1)), "ms": 0.3}
    four = {"config": dataclasses.asdict(pa.PagedAttentionConfig(num_warps=4)), "ms": 0.5}
    eight = {"config": dataclasses.asdict(pa.PagedAttentionConfig(num_warps=8)), "ms": 0.45}
    failed = {"config": dataclasses.asdict(pa.PagedAttentionConfig(num_warps=4, num_stages=3)), "error": "x"}
    row = {"configs": [one, four, failed, eight]}
    assert suite.table_candidate(row, 4) is eight
    assert suite.table_candidate(row, 1) is one
    assert suite.table_candidate({"configs": [one, failed]}, 4) is None


def _run_suite(argv):
    parser = argparse.ArgumentParser()
    suite.add_arguments(parser)
    return suite.run(parser.parse_args(argv))


def test_benchmark_suite_smoke():
    """The runner's suite on its CPU smoke flags (interpret mode off the GPU): every config timed, each within the
    twin's tolerance (FP8 pools with float16 dots against the twin's bfloat16 ones: a bfloat16 rounding more), the
    bytes as `bytes_moved` counts them, fractions of the copy bandwidth measured here."""
    payload = _run_suite(suite.SMOKE)
    assert payload["hbm_copy_gbps"] > 0 and payload["tuning"] == []
    assert {(r["pool"], r["layout"]) for r in payload["results"]} == {("bfloat16", "nhd"), ("float8_e4m3fn", "nhd")}
    for row in payload["results"]:
        assert row["configs"] and all("error" not in c and c["ms"] > 0 for c in row["configs"])
        best = row["best"]
        assert best["max_rel_err"] < 2 * TOL_REF[BF16]
        assert best["GBps"] == pytest.approx(row["bytes"] / (best["ms"] * 1e-3) / 1e9)
        assert 100 * best["GBps"] / best["pct_copy_ceiling"] == pytest.approx(payload["hbm_copy_gbps"], abs=0.051)
    lengths = np.asarray(suite.bench_inputs(2, 40, BF16, num_heads=4, num_kv_heads=2, head_dim=64, ragged=True)[-1])
    pages = int(np.sum(-(-lengths // 16)))  # K and V pages below the lengths, then q and the output
    assert payload["results"][0]["bytes"] == 2 * pages * 16 * 2 * 64 * 2 + 2 * (2 * 4 * 64) * 2


def test_benchmark_suite_writes_a_tuning_table_the_kernel_reads(tmp_path, monkeypatch):
    """``--tuning-out``: the faster of two timed launch orders (a sweep of the table's config) becomes this device
    kind's entry, and `default_config` takes it from that file."""
    path = tmp_path / "paged_attention_tuning.json"
    payload = _run_suite(["--batch", "2", "--context", "40", "--heads", "4", "2", "64", "--dtypes", "bfloat16",
                          "--table-only", "--orders", "rows", "heads", "--chain", "1", "--repeats", "1",
                          "--tuning-out", str(path)])
    (row,) = payload["results"]
    assert len(row["configs"]) == 2 and row["swept"]
    entries = json.loads(path.read_text())["entries"]
    assert entries == payload["tuning"] and len(entries) == 1
    assert entries[0]["pool"] == "bfloat16" and entries[0]["config"] == suite.table_candidate(row, 2)["config"]
    monkeypatch.setattr(pa, "TUNING_FILE", path)
    pa._tuning.cache_clear()
    try:
        assert pa.default_config(BF16) == pa.PagedAttentionConfig(**entries[0]["config"])
    finally:
        pa._tuning.cache_clear()


@pytest.mark.gpu
class TestFullSizeGpu:
    """Qwen3-8B attention sizes (N=32, K=8, H=128, pages of 16) natively on the GPU."""

    @pytest.mark.parametrize("pool", [BF16, FP8], ids=["bf16", "fp8"])
    @pytest.mark.parametrize("batch", [1, 64])
    def test_vs_reference(self, pool, batch):
        rng = np.random.default_rng(batch)
        lengths = rng.integers(1, 4097, batch)
        lengths[0] = 4096
        kw = {"N": 32, "K": 8, "H": 128, "ps": 16, "max_pages": 257, "pool": pool, "q_dtype": BF16}
        args, q64, row_kv = make_case(batch, lengths, **kw)
        got = pa.paged_attention(*args, interpret=False)
        assert np.isfinite(np.asarray(got.astype(F32))).all()
        assert _max_rel(got, pa.paged_attention_reference(*args, config=pa.default_config(pool))) < TOL_REF[BF16]
        idx = [0, batch - 1]  # float64 on two rows keeps the test short
        want = attention_f64(q64, row_kv, 8, idx)
        assert _max_rel(np.asarray(got.astype(F32))[idx], want) < TOL_F64[BF16]

    def test_long_context_fp8_error_flat(self):
        errs = [_needle_fp8_error(ctx, seed=7, N=32, K=8, H=128, interpret=False, bp=8) for ctx in (1024, 8192, 32768)]
        print("FP8 vs f32 KV at 1k/8k/32k:", errs)
        assert max(errs) < 2**-4
        assert errs[1] < 1.5 * errs[0] and errs[2] < 1.5 * errs[0]


@pytest.mark.gpu
def test_engine_decode_with_kernel_gpu():
    """The rollout engine decoding through the kernel (jitted multi-step loop, donated cache) samples
    the same tokens as through the reference read path: float32 compute over an FP8 KV pool. (On
    the CPU the same check passes in interpret mode but takes ~30 s, so it runs on the GPU only.)"""
    from configs.models import tiny_qwen3
    from fp8rl_jax.models import Fp8Mode, init_params
    from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
    from fp8rl_jax.rollout.sampling import SamplingConfig

    cfg = tiny_qwen3
    ec = EngineConfig(max_slots=3, page_size=4, num_pages=64, max_seq_len=64, steps_per_call=3, prefill_batch=2,
                      prefill_buckets=(8, 16, 32, 64), dtype="float32", precision=Fp8Mode.KV)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    params = jax.tree.map(lambda w: w * 50 / np.sqrt(w.shape[-1]) if w.ndim >= 2 else w, params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in [3, 12, 7, 1]]
    sampling = SamplingConfig(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
    out = {}
    for kern in (Kernels.REFERENCE, Kernels.PALLAS):
        engine = JaxEngine(cfg, params, ec)
        engine.cache = engine.cache.replace(kernels=kern)
        out[kern] = engine.generate(prompts, sampling)
    assert out[Kernels.PALLAS].token_lists() == out[Kernels.REFERENCE].token_lists()
    np.testing.assert_allclose(out[Kernels.PALLAS].logprobs, out[Kernels.REFERENCE].logprobs, atol=1e-4)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_split_combine_kernel_is_the_reference(interpret):
    """The splits' combine kernel == `_combine_reference` (the XLA ops it replaced): bit for bit in interpret mode,
    within float32 rounding on the GPU (its exp is not XLA's); a row whose last split is empty (lse = float32 min,
    o = 0) weighs it 0; bf16 and float32 outputs; three splits (not a power of two)."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    for S, B, K, go, H, dt in ((3, 5, 2, 4, 16, jnp.bfloat16), (2, 6, 8, 4, 128, jnp.bfloat16),
                               (3, 3, 2, 2, 32, F32)):
        o = jnp.asarray(rng.standard_normal((S, B, K, go, H)), F32)
        lse = jnp.asarray(rng.standard_normal((S, B, K, go)) * 3, F32)
        lse, o = lse.at[-1, 0].set(float(np.finfo(np.float32).min)), o.at[-1, 0].set(0)
        got = np.asarray(pa._combine(o, lse, jnp.dtype(dt), interpret).astype(F32))
        want = np.asarray(jax.jit(pa._combine_reference, static_argnums=2)(o, lse, jnp.dtype(dt)).astype(F32))
        if interpret:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=2.0 ** -7 if dt == jnp.bfloat16 else 1e-6, atol=1e-6)
        w = np.exp(np.asarray(lse, np.float64) - np.asarray(lse, np.float64).max(0))
        ref64 = (np.asarray(o, np.float64) * w[..., None]).sum(0) / w.sum(0)[..., None]
        np.testing.assert_allclose(got, ref64, rtol=2.0 ** -7 if dt == jnp.bfloat16 else 1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_split_combine_lowers_to_triton_for_h200():
    from pallas_kernels.common import triton_ir_for_sm90

    S = jax.ShapeDtypeStruct
    with triton_ir_for_sm90() as ir:
        text = pa._combine.trace(S((3, 256, 8, 4, 128), F32), S((3, 256, 8, 4), F32), jnp.dtype(jnp.bfloat16),
                                 False).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and len(ir) == 1
