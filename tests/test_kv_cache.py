"""Paged and FP8 KV caches against the full-sequence forward of the same model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3, tiny_qwen3_moe
from conftest import rel_err
from fp8rl_jax.models import DensePolicy, KVCache, PagedKVCache, forward, init_params
from fp8rl_jax.models.attention import dot_attention

F32 = DensePolicy("float32")
# The forward jitted: one compilation per shapes (eagerly every op compiles for every new shape, seconds
# per forward on the CPU); config, policy and remat are static.
jit_forward = jax.jit(forward, static_argnames=("config", "policy", "remat"))


def _paged(cfg, batch, page_size, max_len, rng, dtype=jnp.float32, spare=3):
    """A paged cache whose rows own shuffled, non-contiguous pages of one shared pool."""
    max_pages = -(-max_len // page_size)
    num_pages = batch * max_pages + spare
    cache = PagedKVCache.init(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                              batch, max_pages, dtype)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    return cache.replace(page_table=jnp.asarray(table, jnp.int32))


def _decode(cfg, params, seqs, lens, cache):
    """Prefill the ragged prompts as one right-padded batch, then decode one token per step.
    Returns logits at every real position [B, total, V]."""
    B, total = seqs.shape
    def step(p, t, c, n):  # the module's jitted forward: tests of one model and cache shape share its programs
        return jit_forward(p, t, config=cfg, policy=F32, cache=c, num_new=n)

    prompt = np.zeros((B, lens.max()), np.int32)
    for b, n in enumerate(lens):
        prompt[b, :n] = seqs[b, :n]
    out = np.zeros((B, total, cfg.vocab_size), np.float32)
    logits, cache = step(params, prompt, cache, jnp.asarray(lens))
    for b, n in enumerate(lens):
        out[b, :n] = np.asarray(logits)[b, :n]
    pos = lens.copy()
    while (pos < total).any():
        active = pos < total
        nxt = np.where(active, seqs[np.arange(B), np.minimum(pos, total - 1)], 0)[:, None].astype(np.int32)
        logits, cache = step(params, nxt, cache, jnp.asarray(active.astype(np.int32)))
        for b in np.flatnonzero(active):
            out[b, pos[b]] = np.asarray(logits)[b, 0]
        pos += active
    return out, cache


@pytest.mark.parametrize("cfg, page_size", [(tiny_qwen3, 1), (tiny_qwen3, 8), (tiny_qwen3_moe, 3)],
                         ids=["dense-page1", "dense-page8", "moe-page3"])
def test_paged_decode_equals_full_forward(cfg, page_size):
    rng = np.random.default_rng(page_size)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    lens = np.array([4, 9, 1])
    seqs = rng.integers(0, cfg.vocab_size, (3, 13)).astype(np.int32)
    full = np.asarray(jit_forward(params, seqs, config=cfg, policy=F32)[0])
    paged, cache = _decode(cfg, params, seqs, lens, _paged(cfg, 3, page_size, 16, rng))
    np.testing.assert_allclose(paged, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [13, 13, 13])
    if cfg.num_experts:  # the MoE model's contiguous cache against its full forward: test_model.py's cached decode
        return
    contiguous, _ = _decode(cfg, params, seqs, lens, KVCache.init(cfg.num_layers, 3, 16, cfg.num_kv_heads,
                                                                  cfg.head_dim, jnp.float32))
    np.testing.assert_allclose(paged, contiguous, rtol=1e-5, atol=1e-5)


def test_padding_never_writes_into_pages():
    """Right-padded prefill and finished rows write nothing past their real tokens: every page
    slot that no real token owns keeps its sentinel (it may belong to another sequence)."""
    cfg, rng = tiny_qwen3, np.random.default_rng(7)
    params = init_params(cfg, jax.random.key(1), jnp.float32)
    cache = _paged(cfg, 3, 4, 16, rng)
    sentinel = 7.0
    cache = cache.replace(k_pages=tuple(jnp.full_like(p, sentinel) for p in cache.k_pages),
                          v_pages=tuple(jnp.full_like(p, sentinel) for p in cache.v_pages))
    lens = np.array([2, 6, 3])
    tokens = rng.integers(0, cfg.vocab_size, (3, 6)).astype(np.int32)
    _, cache = jit_forward(params, tokens, config=cfg, policy=F32, cache=cache, num_new=jnp.asarray(lens))
    table = np.asarray(cache.page_table)
    owned = np.zeros(cache.k_pages[0].shape[:2], bool)
    for b, n in enumerate(lens):
        for pos in range(n):
            owned[table[b, pos // 4], pos % 4] = True
    for pages in cache.k_pages + cache.v_pages:
        p = np.asarray(pages)
        assert np.all(p[~owned] == sentinel)
        assert not np.any(np.all(p[owned] == sentinel, axis=(-1, -2)))


def test_fp8_kv_cache_logits_error_is_bounded():
    """FP8 (E4M3, per-layer scales = amax / 448) K/V against float32 K/V in the same forward.

    Bound derivation: E4M3 keeps 3 mantissa bits and BF16 7, so each stored element's rounding
    error is 2^4 = 16x BF16's; one scale per layer and tensor leaves small elements with fewer
    significant bits (down to the subnormal range), worth up to one more bit: 32x. Measured:
    FP8 5.1e-2 against BF16 3.2e-3 (16x) on this random, order-one-gain model. The lower bound
    proves the values really went through FP8.
    """
    cfg, rng = tiny_qwen3, np.random.default_rng(3)
    params = init_params(cfg, jax.random.key(2), jnp.float32)
    # weights ~ 1/sqrt(fan_in), like a trained model's, instead of HF's tiny init
    params = jax.tree.map(lambda w: w * 50 / np.sqrt(w.shape[-1]) if w.ndim >= 2 else w, params)
    tokens = rng.integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    f32 = _paged(cfg, 2, 8, 24, rng, jnp.float32, spare=0)
    _, filled = jit_forward(params, tokens, config=cfg, policy=F32, cache=f32)
    k_scale = jnp.stack([jnp.max(jnp.abs(p)) for p in filled.k_pages]) / 448.0
    v_scale = jnp.stack([jnp.max(jnp.abs(p)) for p in filled.v_pages]) / 448.0
    out = {}
    for name, dtype in [("f32", jnp.float32), ("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)]:
        cache = _paged(cfg, 2, 8, 24, rng, dtype, spare=0).replace(page_table=f32.page_table)
        if dtype == jnp.float8_e4m3fn:
            cache = cache.replace(k_scale=k_scale, v_scale=v_scale)
            assert cache.is_fp8
        out[name] = jit_forward(params, tokens, config=cfg, policy=F32, cache=cache)[0]
    err_fp8, err_bf16 = rel_err(out["fp8"], out["f32"]), rel_err(out["bf16"], out["f32"])
    print(f"KV cache logits relative error: FP8 {err_fp8:.2e}, BF16 {err_bf16:.2e}")
    assert err_bf16 < err_fp8 < 32 * err_bf16


def _needle_errors(context: int, seed: int) -> tuple[float, float]:
    """(FP8-vs-f32 relative error of the attention output, f32 output's distance to the needle)."""
    rng = np.random.default_rng(seed)
    K, G, H, ps = 2, 2, 64, 128
    q = rng.standard_normal((1, 1, K * G, H)).astype(np.float32)
    keys = rng.standard_normal((1, context, K, H)).astype(np.float32) / np.sqrt(H)
    vals = rng.standard_normal((1, context, K, H)).astype(np.float32)
    needle = context // 3
    direction = q[0, 0].reshape(K, G, H).mean(1)
    keys[0, needle] = 30 * direction / np.linalg.norm(direction, axis=-1, keepdims=True)
    max_pages = context // ps
    table = jnp.asarray(rng.permutation(max_pages)[None], jnp.int32)

    # the cache's own write of the whole context; jitted, so the prefill attention of the dummy
    # queries (unused here, and context^2 work) is dead code XLA drops
    write = jax.jit(lambda cache, k, v: cache.attend(0, jnp.zeros((1, context, K * G, H)), k, v,
                                                     jnp.array([context]))[1])
    # the query at the last position, attending once more (jitted: one compilation instead of one per op)
    last = jax.jit(lambda cache, q, k, v: cache.advance(jnp.array([context - 1])).attend(0, q, k, v, jnp.array([1]))[0])

    def run(dtype, scale_k, scale_v):
        cache = PagedKVCache.init(1, max_pages, ps, K, H, 1, max_pages, dtype).replace(
            page_table=table, k_scale=jnp.array([scale_k], jnp.float32), v_scale=jnp.array([scale_v], jnp.float32))
        # write the whole context, then attend once more with the query at the last position
        cache = write(cache, jnp.asarray(keys), jnp.asarray(vals))
        return np.asarray(last(cache, jnp.asarray(q), jnp.asarray(keys[:, -1:]), jnp.asarray(vals[:, -1:])))

    ref = run(jnp.float32, 1.0, 1.0)
    exact = np.asarray(dot_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(vals),
                                     jnp.ones((1, 1, context), bool)))
    np.testing.assert_allclose(ref, exact, rtol=1e-5, atol=1e-6)
    fp8 = run(jnp.float8_e4m3fn, float(np.abs(keys).max()) / 448, float(np.abs(vals).max()) / 448)
    needle_v = np.repeat(vals[0, needle], G, axis=0)[None, None]
    return rel_err(fp8, ref), rel_err(ref, needle_v)


def test_fp8_kv_long_context_needle():
    """A needle in 1k and 8k contexts: the FP8 cache retrieves it as float32 does, and its
    error does not grow with the context.

    One query, random keys of norm ~1 and a needle key aligned with the query: an outlier that
    also sets the per-layer FP8 scale, so the haystack keys keep fewer significant bits. The FP8
    path dequantizes K/V and keeps logits, softmax and the PV sum in float32, so the only error
    is storage rounding (at most 2^-4 relative per element, E4M3), not an accumulation error
    growing with the number of keys (the failure of low-precision tensor-core accumulation).
    """
    err_1k, dist_1k = _needle_errors(1024, 11)
    err_8k, dist_8k = _needle_errors(8192, 11)
    print(f"needle: FP8 vs f32 attention output error {err_1k:.2e} at 1k, {err_8k:.2e} at 8k")
    assert dist_1k < 0.2 and dist_8k < 0.2  # the needle dominates the float32 output
    assert err_1k < 2**-4 and err_8k < 2**-4
    assert err_8k < 1.5 * err_1k


def test_calibration_does_not_depend_on_rows_per_pass():
    """``calibrate_kv_scales`` runs its forward a few rows at a time (memory); padded rows add
    nothing: the scales equal one pass over all rows, with ragged lengths (to float32 rounding:
    other batch shapes block the matmuls differently)."""
    from fp8rl_jax.models import calibrate_kv_scales

    params = init_params(tiny_qwen3, jax.random.key(0), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (6, 20), 0, tiny_qwen3.vocab_size)
    lengths = jnp.array([20, 5, 17, 20, 1, 9])
    run = lambda r: calibrate_kv_scales(params, tokens, lengths, config=tiny_qwen3,  # noqa: E731
                                        policy=DensePolicy("float32"), rows_per_pass=r)
    want = run(6)
    # 4 rows per pass: two passes, the second with two padded rows (each rows_per_pass compiles its own forward)
    for got, w in zip(run(4), want):
        np.testing.assert_allclose(got, w, rtol=1e-6)
    with pytest.raises(ValueError, match="rows_per_pass"):
        run(0)
