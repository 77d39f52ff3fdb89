"""The one model definition: cached decoding, policy injection, MoE maths, full-size shapes."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import qwen3_30b_a3b, qwen3_8b, tiny_qwen3, tiny_qwen3_moe
from conftest import rel_err
from fp8rl_jax.models import (ConfigError, DensePolicy, KVCache, ModelConfig, Proj, Site, abstract_params, bind,
                              count_params, forward, init_params)
from fp8rl_jax.models.policy import MatmulPolicy

F32 = DensePolicy("float32")
# The forward jitted: one compilation per shapes (eagerly every op compiles for every new shape, seconds
# per forward on the CPU); config, policy and remat are static.
jit_forward = jax.jit(forward, static_argnames=("config", "policy", "remat"))


@pytest.mark.parametrize("cfg", [tiny_qwen3, tiny_qwen3_moe], ids=["dense", "moe"])
def test_cached_decode_equals_full_forward_ragged(cfg):
    """Ragged prompts prefilled as one right-padded batch, then decoded token by token: every
    real position's logits equal the full-sequence forward of that row alone (float32)."""
    rng = np.random.default_rng(0)
    params = init_params(cfg, jax.random.key(1), jnp.float32)
    lens = np.array([5, 9, 2])
    total = 14
    seqs = rng.integers(0, cfg.vocab_size, (3, total)).astype(np.int32)
    prompt = np.zeros((3, lens.max()), np.int32)
    for b, n in enumerate(lens):
        prompt[b, :n] = seqs[b, :n]
    full = np.asarray(jit_forward(params, seqs, config=cfg, policy=F32)[0])

    model = bind(params, cfg, F32)
    cache = model.init_cache(batch=3, max_len=32)
    step = jax.jit(lambda p, t, c, n: forward(p, t, config=cfg, policy=F32, cache=c, num_new=n))
    logits, cache = step(params, prompt, cache, jnp.asarray(lens))
    chex.assert_trees_all_equal(cache.lengths, jnp.asarray(lens, jnp.int32))
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(logits)[b, :n], full[b, :n], rtol=1e-5, atol=1e-5)
    pos = lens.copy()
    for _ in range(total - lens.max()):
        nxt = seqs[np.arange(3), pos][:, None]
        logits, cache = step(params, nxt, cache, jnp.ones(3, jnp.int32))
        for b in range(3):
            np.testing.assert_allclose(np.asarray(logits)[b, 0], full[b, pos[b]], rtol=1e-5, atol=1e-5)
        pos += 1
    chex.assert_trees_all_equal(cache.lengths, jnp.asarray(pos, jnp.int32))


@pytest.mark.parametrize("cfg", [tiny_qwen3, tiny_qwen3_moe], ids=["dense", "moe"])
def test_logits_at_picks_one_position_per_row(cfg):
    """``logits_at`` returns [B, 1, V], row b's logits at position ``logits_at[b]`` of the full
    output (what a prefill samples from), with and without a cache and with routing recorded."""
    from fp8rl_jax.models.qwen3 import forward_with_routing

    rng = np.random.default_rng(5)
    params = init_params(cfg, jax.random.key(2), jnp.float32)
    # [3, 14]: the shape of the full forward of test_cached_decode_equals_full_forward_ragged (one compile for both)
    tokens = rng.integers(0, cfg.vocab_size, (3, 14)).astype(np.int32)
    at = jnp.asarray(rng.integers(0, 14, 3), jnp.int32)
    full = np.asarray(jit_forward(params, tokens, config=cfg, policy=F32)[0])
    want = full[np.arange(3), np.asarray(at)][:, None]
    got = jit_forward(params, tokens, config=cfg, policy=F32, logits_at=at)[0]
    assert got.shape == (3, 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    cache = bind(params, cfg, F32).init_cache(batch=3, max_len=16)
    got, cache = jit_forward(params, tokens, config=cfg, policy=F32, cache=cache, logits_at=at)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    if cfg.num_experts:
        got, _, experts = jax.jit(forward_with_routing, static_argnames=("config", "policy"))(
            params, tokens, config=cfg, policy=F32, logits_at=at)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
        assert experts.shape[:2] == (3, 14)
    with pytest.raises(AssertionError):  # (raised while tracing)
        jit_forward(params, tokens, config=cfg, policy=F32, logits_at=at[:2])


def test_attention_mask_hides_padding_and_positions_follow():
    """Left-padded rows with an attention mask and shifted positions equal the unpadded rows."""
    cfg = tiny_qwen3
    rng = np.random.default_rng(1)
    params = init_params(cfg, jax.random.key(2), jnp.float32)
    row = rng.integers(0, cfg.vocab_size, (1, 6)).astype(np.int32)
    ref = np.asarray(jit_forward(params, row, config=cfg, policy=F32)[0])
    padded = np.concatenate([np.zeros((1, 3), np.int32), row], axis=1)
    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    out = np.asarray(jit_forward(params, padded, config=cfg, policy=F32, attention_mask=mask, positions=positions)[0])
    np.testing.assert_allclose(out[:, 3:], ref, rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class _ScaledPolicy(MatmulPolicy):
    """Test policy: adds a ramp over the output features of one projection to prove the site
    reaches the policy (not a scale or a constant shift: q/k feed a scale-invariant RMSNorm and
    the router a shift-invariant softmax)."""

    target: Proj

    @property
    def compute_dtype(self):
        return jnp.float32

    def dot(self, x, w, site: Site):
        y = F32.dot(x, w, site)
        return y + jnp.linspace(0, 1, y.shape[-1]) if site.proj is self.target else y

    def ragged_dot(self, x, w, group_sizes, site: Site):
        y = F32.ragged_dot(x, w, group_sizes, site)
        return y + jnp.linspace(0, 1, y.shape[-1]) if site.proj is self.target else y


@pytest.mark.parametrize("proj", list(Proj))
def test_every_projection_goes_through_the_policy(proj):
    """Changing the policy for one projection changes the logits: no linear bypasses the policy."""
    cfg = tiny_qwen3_moe if proj in (Proj.EXPERT_GATE, Proj.EXPERT_UP, Proj.EXPERT_DOWN, Proj.ROUTER) else tiny_qwen3
    params = init_params(cfg, jax.random.key(3), jnp.float32)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
    base = np.asarray(forward(params, tokens, config=cfg, policy=F32)[0])
    scaled = np.asarray(forward(params, tokens, config=cfg, policy=_ScaledPolicy(proj))[0])
    assert rel_err(scaled, base) > 1e-3


def _moe_reference_f64(x, router_w, gate, up, down, k, norm):
    """Float64 numpy MoE: a loop over tokens and their top-k experts (independent of ragged_dot)."""
    x = x.astype(np.float64)
    logits = x @ router_w.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for m in range(x.shape[0]):
        top = np.argsort(-p[m])[:k]
        w = p[m, top] / (p[m, top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            g, u = gate[e] @ x[m], up[e] @ x[m]
            out[m] += we * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_moe_block_matches_float64_loop(norm):
    cfg = dataclasses.replace(tiny_qwen3_moe, norm_topk_prob=norm)
    params = init_params(cfg, jax.random.key(4), jnp.float32)
    model = bind(params, cfg, F32)
    moe = model.layers[0].mlp
    x = np.random.default_rng(3).standard_normal((2, 7, cfg.hidden_size)).astype(np.float32)
    out = np.asarray(moe(jnp.asarray(x)))
    as_np = lambda v: np.asarray(v.get_value(), np.float64)
    ref = _moe_reference_f64(x.reshape(-1, cfg.hidden_size), as_np(moe.gate.weight), as_np(moe.experts.gate_proj),
                             as_np(moe.experts.up_proj), as_np(moe.experts.down_proj), cfg.num_experts_per_tok, norm)
    assert rel_err(out.reshape(-1, cfg.hidden_size), ref) < 1e-5


def test_bfloat16_policy_runs_in_bfloat16():
    params = init_params(tiny_qwen3, jax.random.key(5), jnp.bfloat16)
    tokens = np.random.default_rng(4).integers(0, tiny_qwen3.vocab_size, (2, 8)).astype(np.int32)
    h, _ = jax.jit(lambda p, t: bind(p, tiny_qwen3, DensePolicy("bfloat16")).hidden_states(t))(params, tokens)
    assert h.dtype == jnp.bfloat16
    lo = np.asarray(jit_forward(params, tokens, config=tiny_qwen3, policy=DensePolicy("bfloat16"))[0])
    hi = np.asarray(jit_forward(params, tokens, config=tiny_qwen3, policy=F32)[0])
    assert lo.dtype == np.float32
    assert 0 < rel_err(lo, hi) < 5e-2


def _dot_outputs(fn, *args) -> list:
    """The output dtypes of the dot_general / ragged_dot_general equations ``fn(*args)`` traces to."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [e.outvars[0].aval.dtype for e in eqns if e.primitive.name in ("dot_general", "ragged_dot_general")]


def test_fused_cast_gemms_write_bfloat16_with_float32_accumulation():
    """``fused_cast``: the GEMM itself writes BF16 (no float32 result and convert); its values are the
    float64 product's rounding to BF16 (float32 accumulation), as the default float32-then-cast path's are;
    the model under it computes the same logits within BF16 rounding; W8A8's dense sites follow the flag."""
    from fp8rl_jax.quant.policy import W8A8Policy

    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((37, 3072)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((200, 3072)), jnp.bfloat16)
    site = Site(0, Proj.UP)
    fused, plain = DensePolicy("bfloat16", fused_cast=True), DensePolicy("bfloat16")
    assert _dot_outputs(lambda x, w: fused.dot(x, w, site), x, w) == [jnp.bfloat16]
    assert _dot_outputs(lambda x, w: plain.dot(x, w, site), x, w) == [jnp.float32]
    assert _dot_outputs(lambda x, w: W8A8Policy(fused_cast=True).dot(x, w, site), x, w) == [jnp.bfloat16]
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    for pol in (fused, plain):
        y = pol.dot(x, w, site)
        assert y.dtype == jnp.bfloat16
        # one BF16 rounding (2^-9 relative) of a float32-accumulated sum over K = 3072
        np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2**-8, atol=2**-8 * np.abs(ref).max() / 64)
    gs = jnp.asarray([10, 0, 27], jnp.int32)
    we = jnp.asarray(rng.standard_normal((3, 64, 3072)), jnp.bfloat16)
    assert _dot_outputs(lambda x, w: fused.ragged_dot(x, w, gs, site), x, we) == [jnp.bfloat16]
    ragged = np.asarray(fused.ragged_dot(x, we, gs, site), np.float64)
    rows = np.repeat(np.arange(3), np.asarray(gs))
    ref_r = np.einsum("mk,mnk->mn", np.asarray(x, np.float64), np.asarray(we, np.float64)[rows])
    np.testing.assert_allclose(ragged, ref_r, rtol=2**-8, atol=2**-8 * np.abs(ref_r).max() / 64)
    params = init_params(tiny_qwen3, jax.random.key(5), jnp.bfloat16)
    tokens = rng.integers(0, tiny_qwen3.vocab_size, (2, 8)).astype(np.int32)
    lo = np.asarray(jit_forward(params, tokens, config=tiny_qwen3, policy=fused)[0])
    hi = np.asarray(jit_forward(params, tokens, config=tiny_qwen3, policy=F32)[0])
    assert 0 < rel_err(lo, hi) < 5e-2


def test_fp32_master_weights_with_bf16_compute():
    """FP32 parameters under a BF16 policy compute in BF16 (the trainer's mixed precision)."""
    params = init_params(tiny_qwen3, jax.random.key(6), jnp.float32)
    h, _ = jax.jit(lambda p, t: bind(p, tiny_qwen3, DensePolicy("bfloat16")).hidden_states(t))(
        params, jnp.zeros((1, 4), jnp.int32))
    assert h.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "cfg, total, active",
    [(qwen3_8b, 8_190_735_360, 8_190_735_360), (qwen3_30b_a3b, 30_532_122_624, 3_353_032_704)],
    ids=["qwen3_8b", "qwen3_30b_a3b"],
)
def test_full_size_presets_eval_shape(cfg, total, active):
    """Shapes of the real models without allocating them.

    Derivation (Qwen3-8B): per layer attention 4096*128*(2*32 + 2*8) + 2*128 = 41,943,296, MLP
    3*4096*12288 = 150,994,944, norms 8192; times 36 layers = 6,946,086,912; plus embeddings and
    lm_head 2*151936*4096 = 1,244,659,712 and the final norm 4096: 8,190,735,360 ("8.2B").
    Qwen3-30B-A3B: attention 2048*128*(64 + 8) + 256 = 18,874,624, router 2048*128, experts
    128*3*2048*768, norms 4096 per layer, 48 layers, embeddings 2*151936*2048 + 2048:
    30,532,122,624 in all ("30.5B"); 8 of 128 experts active: 3,353,032,704 ("3.3B").
    """
    abstract = abstract_params(cfg)
    assert count_params(abstract) == total
    assert cfg.param_counts() == (total, active)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract))
    logits = jax.eval_shape(lambda p, t: forward(p, t, config=cfg)[0], abstract,
                            jax.ShapeDtypeStruct((2, 16), jnp.int32))
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    model_state = jax.eval_shape(lambda: KVCache.init(cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim,
                                                      jnp.bfloat16))
    assert model_state.k[0].shape == (2, 64, cfg.num_kv_heads, cfg.head_dim)


def test_presets_derive_by_replace_and_validate():
    small = dataclasses.replace(qwen3_8b, num_layers=2)
    assert small.num_layers == 2 and small.hidden_size == qwen3_8b.hidden_size
    with pytest.raises(ConfigError, match="num_kv_heads"):
        dataclasses.replace(qwen3_8b, num_kv_heads=7)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        dataclasses.replace(qwen3_30b_a3b, num_experts_per_tok=129)
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        dataclasses.replace(qwen3_30b_a3b, mlp_only_layers=(48,))


@pytest.mark.parametrize("cfg", [qwen3_8b, qwen3_30b_a3b, tiny_qwen3_moe], ids=["8b", "30b", "tiny_moe"])
def test_hf_config_dict_round_trip(cfg):
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("cfg", [tiny_qwen3, tiny_qwen3_moe], ids=["dense", "moe"])
def test_init_params_draws_hf_init_leaf_by_leaf(cfg):
    """init_params (one jitted init per leaf shape) returns the model's Param tree: norms at one,
    every other weight normal(0, 0.02) (moments and a Kolmogorov-Smirnov distance against the
    normal CDF, float64), independent leaves, reproducible per key and the same under jax.jit."""
    from math import erf, sqrt

    from flax import nnx

    from fp8rl_jax.models.qwen3 import Qwen3

    params = init_params(cfg, jax.random.key(3), jnp.float32)
    model_state = nnx.state(nnx.eval_shape(lambda: Qwen3(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0))), nnx.Param)
    assert jax.tree.structure(params) == jax.tree.structure(model_state)
    firsts = []
    for (path, x), ref in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(model_state), strict=True):
        assert x.shape == ref.shape and x.dtype == jnp.float32, path
        v = np.asarray(x, np.float64).ravel()
        if x.ndim == 1:
            np.testing.assert_array_equal(v, 1.0)
            continue
        assert abs(v.mean()) < 5 * 0.02 / sqrt(v.size) and abs(v.std() / 0.02 - 1) < 5 / sqrt(2 * v.size), path
        s = np.sort(v) / 0.02
        cdf = 0.5 * (1 + np.vectorize(erf)(s / sqrt(2)))
        ks = np.max(np.maximum(np.arange(1, s.size + 1) / s.size - cdf, cdf - np.arange(s.size) / s.size))
        assert ks < 1.63 / sqrt(s.size) + 1e-3, (path, ks)  # the KS test's 1% critical value
        firsts.append(v[:64])
    assert len({f.tobytes() for f in firsts}) == len(firsts)  # one key per leaf: no two leaves alike
    again = init_params(cfg, jax.random.key(3), jnp.float32)
    jitted = jax.jit(lambda k: init_params(cfg, k, jnp.bfloat16))(jax.random.key(3))
    other = init_params(cfg, jax.random.key(4), jnp.float32)
    for a, b, c, d in zip(*(jax.tree.leaves(t) for t in (params, again, jitted, other)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(c))
        assert a.ndim == 1 or not np.array_equal(np.asarray(a), np.asarray(d))


def test_causal_attention_by_query_blocks_equals_float64_softmax():
    """Past ``block`` tokens, ``causal_attention`` goes block by block (memory ~ T x block): the output and
    the gradients of q, k and v equal a float64 numpy causal softmax with padded keys masked, and the
    short path (one block) agrees with the blocked one on the same inputs."""
    from fp8rl_jax.models.attention import causal_attention

    rng = np.random.default_rng()
    B, T, N, K, H = 2, int(rng.integers(9, 20)), 4, 2, 8
    q, k, v = (rng.normal(size=(B, T, n, H)).astype(np.float32) for n in (N, K, K))
    valid = np.ones((B, T), bool)
    valid[1, int(rng.integers(T // 2, T)):] = False  # right padding in row 1
    w = rng.normal(size=(B, T, N, H))

    def reference(q, k, v):
        qg = q.reshape(B, T, K, N // K, H)
        s = np.einsum("btkgh,bskh->bkgts", qg, k) / np.sqrt(H)
        allowed = np.tril(np.ones((T, T), bool))[None] & valid[:, None, :]
        s = np.where(allowed[:, None, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, H)

    def loss(q, k, v, block):
        return jnp.sum(causal_attention(q, k, v, jnp.asarray(valid), block=block) * w)

    out = {blk: np.asarray(jax.jit(causal_attention, static_argnames="block")(q, k, v, jnp.asarray(valid), block=blk))
           for blk in (4, T)}
    ref = reference(*(x.astype(np.float64) for x in (q, k, v)))
    rows = valid[:, :, None, None]  # a padded query's output is never read
    for got in out.values():
        assert rel_err(np.where(rows, got, 0), np.where(rows, ref, 0)) < 1e-5
    grads = {blk: jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, blk) for blk in (4, T)}
    eps = 1e-3  # the float64 reference gradient by central differences of the reference, on a few entries
    for idx in [tuple(int(rng.integers(s)) for s in q.shape) for _ in range(3)]:
        if not valid[idx[0], idx[1]]:
            continue
        dq = np.zeros_like(q, np.float64)
        dq[idx] = eps
        num = (np.sum((reference(q + dq, k, v) - reference(q - dq, k, v)) * w * rows)) / (2 * eps)
        for g in grads.values():
            assert abs(float(g[0][idx]) - num) < 1e-3 * max(1.0, abs(num))
    for a, b in zip(grads[4], grads[T], strict=True):
        assert rel_err(np.asarray(a), np.asarray(b)) < 1e-5


def _float64_causal(q, k, v):
    B, T, N, H = q.shape
    K = k.shape[2]
    s = np.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k) / np.sqrt(H)
    s = np.where(np.tril(np.ones((T, T), bool))[None, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, H)


def test_causal_attention_takes_the_jnp_path_off_the_gpu(monkeypatch):
    """Flash attention is for GPUs, unpadded keys and 16-bit activations only; the switch reads the environment."""
    from fp8rl_jax.models.attention import flash_attention_applies

    q = jnp.zeros((1, 4, 2, 64), jnp.bfloat16)
    assert not flash_attention_applies(q, None)  # the CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert flash_attention_applies(q, None)
    assert not flash_attention_applies(q, jnp.ones((1, 4), bool))
    assert not flash_attention_applies(q.astype(jnp.float32), None)
    monkeypatch.setenv("FP8RL_TRAIN_ATTENTION", "reference")
    assert not flash_attention_applies(q, None)


@pytest.mark.gpu
def test_flash_attention_on_the_gpu_against_float64():
    """On the GPU, the trainer's causal attention (cuDNN flash, BF16) against a float64 causal softmax on fresh
    random inputs: the output and the gradients of q, k and v within BF16 rounding; and its compiled backward
    holds no [T, T] scores (temporaries far below one float32 score block)."""
    from fp8rl_jax.models.attention import causal_attention, flash_attention_applies

    rng = np.random.default_rng()
    B, T, N, K, H = 2, 1536, 8, 2, 128
    q, k, v = (rng.normal(size=(B, T, n, H)).astype(np.float32) for n in (N, K, K))
    w = rng.normal(size=(B, T, N, H)).astype(np.float32)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    assert flash_attention_applies(qb, None)
    out = np.asarray(jax.jit(causal_attention)(qb, kb, vb), np.float64)
    f64 = [np.asarray(x, np.float64) for x in (qb, kb, vb)]
    assert rel_err(out, _float64_causal(*f64)) < 1e-2

    def loss(q, k, v):
        return jnp.sum(causal_attention(q, k, v).astype(jnp.float32) * w)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grads = step(qb, kb, vb)
    eps = 1e-2  # float64 central differences of the reference along a random direction per input
    for i, g in enumerate(grads):
        d = rng.normal(size=f64[i].shape)
        plus, minus = list(f64), list(f64)
        plus[i], minus[i] = f64[i] + eps * d, f64[i] - eps * d
        num = np.sum((_float64_causal(*plus) - _float64_causal(*minus)) * w) / (2 * eps)
        got = float(np.sum(np.asarray(g, np.float64) * d))
        assert abs(got - num) < 2e-2 * max(1.0, abs(num)), (i, got, num)
    temp = step.lower(qb, kb, vb).compile().memory_analysis().temp_size_in_bytes
    assert temp < B * N * T * T * 4 / 4, temp  # a quarter of one float32 [B, N, T, T] score tensor
