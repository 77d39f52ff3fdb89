"""MoE routing replay: the model records and replays expert choices, the engine records them per
position (preemption included), the trainer and the loop replay them, and on an FP8 rollout vs a
BF16 trainer replay lowers the K3 mismatch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3, tiny_qwen3_moe
from conftest import rel_err
from fp8rl_jax.models import DensePolicy, Fp8Mode, bind, forward, init_params
from fp8rl_jax.models.qwen3 import forward_with_routing, moe_layers
from fp8rl_jax.rl.algos import mismatch_metrics
from fp8rl_jax.rl.loop import Rollout, build_batch, with_trainer_logprobs
from fp8rl_jax.rl.trainer import (LossConfig, TrainerConfig, ComputeDtype, compute_grads,
                                  make_logprob_fn, token_logprobs)
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig

F32 = DensePolicy("float32")
BF16 = DensePolicy("bfloat16")
CFG = tiny_qwen3_moe  # 2 MoE layers, 8 experts, top-2, renormalized
L_MOE, K = len(moe_layers(CFG)), CFG.num_experts_per_tok
# 8 pages of 4 tokens for 3 slots: the engine preempts (every engine here shares one compilation)
ENGINE_F32 = EngineConfig(max_slots=3, page_size=4, num_pages=8, max_seq_len=64, steps_per_call=3, prefill_batch=2,
                          prefill_buckets=(8, 16, 32, 64), dtype="float32", record_routing=True)


def _random_replay(rng, m, e, k):
    """[m, k] distinct expert ids per row (a random subset in random order)."""
    return np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)


def _moe_given_experts_f64(x, router_w, gate, up, down, experts, norm):
    """Float64 numpy MoE that uses the given experts [M, k] (a loop: independent of sort + ragged_dot)."""
    x = x.astype(np.float64)
    logits = x @ router_w.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for m in range(x.shape[0]):
        w = p[m, experts[m]] / (p[m, experts[m]].sum() if norm else 1.0)
        for e, we in zip(experts[m], w):
            g, u = gate[e] @ x[m], up[e] @ x[m]
            out[m] += we * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


# ------------------------------------------------------------------------------------ model


@pytest.mark.parametrize("norm", [True, False])
def test_moe_replay_uses_the_given_experts_with_router_gates(norm):
    """Valid replay rows use exactly the given experts, gated by the router's renormalized
    probabilities of those experts; -1 / out-of-range / duplicate rows fall back to top-k."""
    cfg = dataclasses.replace(CFG, norm_topk_prob=norm)
    rng = np.random.default_rng(11)
    params = init_params(cfg, jax.random.key(21), jnp.float32)
    moe = bind(params, cfg, F32).layers[0].mlp
    B, T, E = 2, 9, cfg.num_experts
    x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
    replay = _random_replay(rng, B * T, E, K)
    replay[3] = -1  # not recorded
    replay[5, 1] = E  # out of range
    replay[8, 1] = replay[8, 0]  # duplicate
    apply = jax.jit(lambda p, x, r: bind(p, cfg, F32).layers[0].mlp.apply(x, r))
    out, used = apply(params, jnp.asarray(x), jnp.asarray(replay.reshape(B, T, K)))
    as_np = lambda v: np.asarray(v.get_value(), np.float64)
    args = (as_np(moe.gate.weight), as_np(moe.experts.gate_proj), as_np(moe.experts.up_proj),
            as_np(moe.experts.down_proj))
    logits = x.reshape(-1, cfg.hidden_size).astype(np.float64) @ args[0].T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = replay.copy()
    for m in (3, 5, 8):  # fallback rows: the router's own top-k, descending
        expected[m] = np.argsort(-p[m])[:K]
    np.testing.assert_array_equal(np.asarray(used).reshape(-1, K), expected)
    ref = _moe_given_experts_f64(x.reshape(-1, cfg.hidden_size), *args, expected, norm)
    assert rel_err(np.asarray(out).reshape(-1, cfg.hidden_size), ref) < 1e-5
    # most replayed rows are not the router's top-k: the test exercises real overrides
    assert np.mean(np.sort(expected, 1) != np.sort(np.argsort(-p, 1)[:, :K], 1)) > 0.3


def test_replay_gradient_flows_through_the_router_probabilities():
    """jax.grad through the replayed MoE == jax.grad of a dense one-hot formulation (every expert
    computed, masked to the replayed ones, gates = renormalized softmax of the mask)."""
    cfg = CFG
    rng = np.random.default_rng(12)
    params = init_params(cfg, jax.random.key(22), jnp.float32)
    M, E = 10, cfg.num_experts
    x = jnp.asarray(rng.standard_normal((1, M, cfg.hidden_size)).astype(np.float32))
    replay = jnp.asarray(_random_replay(rng, M, E, K).reshape(1, M, K))
    cot = jnp.asarray(rng.standard_normal((1, M, cfg.hidden_size)).astype(np.float32))
    names = (("gate", "weight"), ("experts", "gate_proj"), ("experts", "up_proj"), ("experts", "down_proj"))
    pick = lambda state: tuple(state["layers"][1]["mlp"][a][b].get_value() for a, b in names)

    def ours(params):
        return jnp.sum(bind(params, cfg, F32).layers[1].mlp.apply(x, replay)[0] * cot)

    def dense(w):
        hp = jax.lax.Precision.HIGHEST
        xf = x[0]
        p = jax.nn.softmax(jnp.dot(xf, w[0].T, precision=hp), axis=-1)  # [M, E]
        sel = jnp.sum(jax.nn.one_hot(replay[0], E), axis=1)  # [M, E] 0/1
        gates = p * sel / jnp.sum(p * sel, axis=-1, keepdims=True)
        g = jnp.einsum("md,eid->mei", xf, w[1], precision=hp)
        u = jnp.einsum("md,eid->mei", xf, w[2], precision=hp)
        y = jnp.einsum("mei,edi->med", jax.nn.silu(g) * u, w[3], precision=hp)
        return jnp.sum(jnp.einsum("med,me->md", y, gates, precision=hp) * cot[0])

    g_ours = pick(jax.jit(jax.grad(ours))(params))
    g_dense = jax.jit(jax.grad(dense))(pick(params))
    for a, b in zip(g_ours, g_dense):
        assert rel_err(np.asarray(a), np.asarray(b)) < 1e-4
    assert float(jnp.linalg.norm(g_ours[0])) > 0  # the router learns under replay


def test_forward_records_top_k_and_replays_it_exactly():
    """Recorded ids are k distinct experts (-1 on masked padding); replaying them (or -1
    everywhere) is bitwise identical to no replay, with or without remat (gradients too);
    other ids change the logits; bad shapes and dense models are refused."""
    rng = np.random.default_rng(13)
    params = init_params(CFG, jax.random.key(23), jnp.float32)
    B, T = 3, 12
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32))
    mask = np.ones((B, T), np.int32)
    mask[1, 8:] = 0
    m = jnp.asarray(mask)
    record = jax.jit(lambda p, t, m: forward_with_routing(p, t, config=CFG, policy=F32, attention_mask=m))
    fwd = jax.jit(lambda p, t, m, r=None: forward(p, t, config=CFG, policy=F32, attention_mask=m, routing=r)[0])
    logits, _, rec = record(params, tokens, m)
    rec = np.asarray(rec)
    assert rec.shape == (B, T, L_MOE, K) and rec.dtype == np.int32
    assert np.all(rec[1, 8:] == -1)
    real = rec[mask == 1]
    assert np.all((real >= 0) & (real < CFG.num_experts)) and np.all(real[..., 0] != real[..., 1])
    base = np.asarray(fwd(params, tokens, m))
    np.testing.assert_array_equal(np.asarray(logits), base)
    np.testing.assert_array_equal(np.asarray(fwd(params, tokens, m, jnp.asarray(rec))), base)
    np.testing.assert_array_equal(np.asarray(fwd(params, tokens, m, jnp.full(rec.shape, -1, jnp.int32))), base)
    other = _random_replay(rng, B * T * L_MOE, CFG.num_experts, K).reshape(B, T, L_MOE, K)
    assert rel_err(np.asarray(fwd(params, tokens, m, jnp.asarray(other))), base) > 1e-3
    # remat under replay: the same gradient (up to float32 summation order)
    loss = lambda p, remat: jnp.sum(forward(p, tokens, config=CFG, policy=F32, routing=jnp.asarray(other),
                                            remat=remat)[0][:, :, :4])
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    for a, b in zip(jax.tree.leaves(grad(params, False)), jax.tree.leaves(grad(params, True))):
        assert rel_err(np.asarray(a), np.asarray(b)) < 1e-5
    with pytest.raises(ValueError, match=r"routing must be an integer \[B, T, L_moe, top_k\]"):
        fwd(params, tokens, m, jnp.zeros((B, T, L_MOE, K + 1), jnp.int32))
    dense = init_params(tiny_qwen3, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="no MoE layer"):
        forward_with_routing(dense, tokens, config=tiny_qwen3)
    with pytest.raises(ValueError, match="no MoE layer"):
        JaxEngine(tiny_qwen3, dense, ENGINE_F32)


# ------------------------------------------------------------------------------------ engine


def _prompts(rng, lengths):
    return [rng.integers(2, CFG.vocab_size, n).tolist() for n in lengths]


def _context_tokens(prompts, ro, T):
    tokens = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros((len(prompts), T), np.float32)
    rollout_lp = np.zeros((len(prompts), T), np.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, ro.token_lists(), ro.logprob_lists())):
        tokens[i, : len(p) + len(r)] = p + r
        mask[i, len(p) : len(p) + len(r)] = 1
        rollout_lp[i, len(p) : len(p) + len(r)] = lp
    return tokens, mask, rollout_lp


def test_engine_records_routing_aligned_with_the_full_forward_and_survives_preemption():
    """Float32 engine: every recorded position equals the full-sequence forward's top-k on
    prompt + response; the last generated token and the padding are -1; the batch with
    preemptions (tight page pool, recompute prefills) records the same routing as the requests
    run one at a time (no preemption), with no recompute disagreement; replaying the routing in
    the trainer reproduces the rollout logprobs (temperature 1: they are plain log-softmax)."""
    params = init_params(CFG, jax.random.key(24), jnp.float32)
    rng = np.random.default_rng(14)
    prompts = _prompts(rng, [9, 6, 11, 3])
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    eng = JaxEngine(CFG, params, ENGINE_F32)
    big = eng.generate(prompts, sampling)
    assert big.preemptions > 0
    for i, p in enumerate(prompts):  # alone: no preemption; seeds depend on (seed, position) only
        alone = eng.generate([p], sampling)
        assert alone.preemptions == 0 and alone.token_lists()[0] == big.token_lists()[i]
        n = len(p) + int(alone.lengths[0])
        np.testing.assert_array_equal(alone.routing[0, :n], big.routing[i, :n])
    assert big.routing_recompute_mismatches == 0
    assert EngineConfig().record_routing is False
    # swap preemption (no recompute): the same tokens and routing
    swap = JaxEngine(CFG, params, dataclasses.replace(ENGINE_F32, swap_space_gib=1.0))
    swapped = swap.generate(prompts, sampling)
    assert swap.stats["swap_outs"] == swapped.preemptions > 0 and swapped.token_lists() == big.token_lists()
    np.testing.assert_array_equal(swapped.routing, big.routing)

    lens = [len(p) + n for p, n in zip(prompts, big.lengths)]
    S = max(lens)
    assert big.routing.shape == (len(prompts), S, L_MOE, K) and big.routing.dtype == np.int32
    tokens, mask, rollout_lp = _context_tokens(prompts, big, S)
    # (jitted: one compilation each instead of one per op)
    _, _, own = jax.jit(lambda p, t: forward_with_routing(p, t, config=CFG, policy=F32))(params, jnp.asarray(tokens))
    own = np.asarray(own)
    for i, n in enumerate(lens):
        np.testing.assert_array_equal(big.routing[i, : n - 1], own[i, : n - 1])
        assert np.all(big.routing[i, n - 1 :] == -1)
    logp, _ = jax.jit(lambda p, t, r: token_logprobs(p, t, config=CFG, policy=F32, routing=r))(
        params, jnp.asarray(tokens), jnp.asarray(big.routing))
    np.testing.assert_allclose(np.asarray(logp) * mask, rollout_lp, atol=1e-5)


def test_build_batch_and_trainer_replay_the_rollout_routing():
    """build_batch aligns RolloutBatch.routing with the batch tokens (-1 on padding) and the
    trainer's logprob function and loss use it: exact micro-batch accumulation holds, and a
    routing that differs from top-k changes the logprobs and the gradient."""
    params = init_params(CFG, jax.random.key(25), jnp.float32)
    rng = np.random.default_rng(15)
    prompts = _prompts(rng, [5, 8, 4, 7])
    ro_batch = JaxEngine(CFG, params, ENGINE_F32).generate(
        prompts, SamplingConfig(temperature=1.0, max_tokens=6, ignore_eos=True, seed=9))
    ro = Rollout(prompts, np.array([0, 0, 1, 1], np.int32), ro_batch, 0.0)
    rewards = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
    batch = build_batch(ro, rewards, pad_multiple=16)
    assert build_batch(ro, rewards, pad_multiple=16, replay_routing=False).routing is None
    N, T = batch.tokens.shape
    routing = np.asarray(batch.routing)
    assert routing.shape == (N, T, L_MOE, K)
    for i, p in enumerate(prompts):
        n = len(p) + int(ro_batch.lengths[i])
        np.testing.assert_array_equal(routing[i, :n], ro_batch.routing[i, :n])
        assert np.all(routing[i, n:] == -1)

    tc = TrainerConfig(compute_dtype=ComputeDtype.FLOAT32, loss=LossConfig(entropy_metric=False))
    fn = make_logprob_fn(CFG, F32, tc)
    batch = with_trainer_logprobs(batch, fn, params)
    np.testing.assert_allclose(np.asarray(batch.old_logprobs), np.asarray(batch.rollout_logprobs), atol=1e-5)

    # a routing the router would not choose: replace the recorded ids by other experts
    flipped = np.where(routing >= 0, (routing + 3) % CFG.num_experts, -1).astype(np.int32)
    lp_flip = np.asarray(fn(params, batch.tokens, routing=jnp.asarray(flipped))) * np.asarray(batch.loss_mask)
    assert np.max(np.abs(lp_flip - np.asarray(batch.old_logprobs))) > 1e-3
    fb = batch.replace(routing=jnp.asarray(flipped), old_logprobs=jnp.asarray(lp_flip))
    grads = jax.jit(compute_grads, static_argnames=("model_config", "policy", "trainer_config"))
    g1, m1 = grads(params, fb, model_config=CFG, policy=F32, trainer_config=tc)
    g2, m2 = grads(params, fb, model_config=CFG, policy=F32, trainer_config=dataclasses.replace(tc, micro_batches=2))
    # the loss replays too: its logprobs equal the replayed old_logprobs (ratio 1 everywhere)
    np.testing.assert_allclose(float(m1["ratio_mean"]), 1.0, atol=1e-5)
    np.testing.assert_allclose(float(m1["ratio_max"]), 1.0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert rel_err(np.asarray(a), np.asarray(b)) < 1e-5
    assert np.linalg.norm(np.asarray(g1["layers"][0]["mlp"]["gate"]["weight"].get_value())) > 0
    with pytest.raises(ValueError, match="TrainBatch.routing must be an integer"):
        compute_grads(params, fb.replace(routing=jnp.asarray(flipped[:, :-1])), model_config=CFG, policy=F32,
                      trainer_config=tc)


# ------------------------------------------------------------------------------------ measurement


def test_fp8_rollout_replay_lowers_the_k3_mismatch():
    """W8A8 (FP8) BF16 rollout, BF16 trainer, on tiny_qwen3_moe with its weight matrices scaled
    by 3 (random init at std 0.02 gives near-uniform logits, where every mismatch is ~1e-5;
    std 0.06 makes routing and predictions decisive). Router top-k flips between rollout and
    trainer are common (~10-18% of token-layers); replaying the rollout's experts removes them
    and roughly halves K3 (measured ratio 1.6-2.3 over seeds 0-10; asserted: < 0.75x)."""
    params = jax.tree.map(lambda p: (p * 3.0 if p.ndim >= 2 else p).astype(jnp.bfloat16),
                          init_params(CFG, jax.random.key(1), jnp.float32))
    eng = JaxEngine(CFG, params, EngineConfig(max_slots=8, page_size=8, num_pages=128, max_seq_len=64,
                                              steps_per_call=4, prefill_batch=4, prefill_buckets=(16, 32, 64),
                                              precision=Fp8Mode.W8A8, dtype="bfloat16", record_routing=True))
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, rng.integers(4, 12, 8).tolist())
    ro = eng.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1))
    tokens, mask, rollout_lp = _context_tokens(prompts, ro, 32)
    routing = np.full((len(prompts), 32, L_MOE, K), -1, np.int32)
    routing[:, : ro.routing.shape[1]] = ro.routing
    lp = jax.jit(lambda t, r=None: token_logprobs(params, t, config=CFG, policy=BF16, routing=r)[0])
    k3 = {}
    for name, r in (("no_replay", None), ("replay", jnp.asarray(routing))):
        k3[name] = float(mismatch_metrics(lp(jnp.asarray(tokens), r), jnp.asarray(rollout_lp), jnp.asarray(mask))["kl_k3"])
    _, _, own = jax.jit(lambda t: forward_with_routing(params, t, config=CFG, policy=BF16))(jnp.asarray(tokens))
    rec = routing[..., 0] >= 0
    flips = float(np.mean(np.any(np.asarray(own) != routing, axis=-1)[rec]))
    print(f"flip fraction {flips:.3f}, K3 no replay {k3['no_replay']:.3e}, replay {k3['replay']:.3e}")
    assert flips > 0.02
    assert k3["replay"] < 0.75 * k3["no_replay"]
