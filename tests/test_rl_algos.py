"""fp8rl_jax.rl.algos against independent float64 NumPy references (plain loops).

Every reference below is written from the formula, not from the JAX code: per-token
Python loops over real tokens only, so padding handling is checked rather than shared.
Inputs are fresh random draws with ragged right padding and an all-padding row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.rl import (
    AdvantageEstimator,
    Correction,
    KLEstimator,
    LossAgg,
    aggregate_loss,
    compute_advantages,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    mismatch_metrics,
    outcome_to_token_rewards,
    policy_loss,
    rollout_correction_weights,
)

# The reference tests call the functions jitted, as a train step would (this is also
# the "works under jit" check); on the CPU one compile per shape is several times
# cheaper than op-by-op eager dispatch. test_eager_equals_jit covers eager mode.
j_policy_loss = jax.jit(policy_loss, static_argnames=("agg", "dual_clip"))
j_loss_grad = jax.jit(jax.value_and_grad(policy_loss, has_aux=True), static_argnames=("agg", "dual_clip"))
j_grpo = jax.jit(grpo_advantages, static_argnames=("group_size", "normalize_std", "ddof"))
j_gae = jax.jit(gae_advantages)
j_adv = jax.jit(compute_advantages, static_argnames=("estimator", "group_size"))
j_outcome = jax.jit(outcome_to_token_rewards)
j_corr = jax.jit(rollout_correction_weights, static_argnames=("correction", "kl_estimator"))
j_kl = jax.jit(kl_penalty, static_argnames=("estimator",))
j_entropy = jax.jit(entropy_from_logits)
j_mismatch = jax.jit(mismatch_metrics)

SHAPES = [(1, 1), (4, 7), (6, 16)]
ALL_AGGS = list(LossAgg)
F32 = dict(rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------- inputs


def ragged_mask(rng, B, T, empty_row=True):
    """Right-padded mask: one full row, one all-padding row (if B > 2), others random lengths."""
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0] = T
    if empty_row and B > 2:
        lengths[-1] = 0
    return (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)


def rl_batch(rng, B, T, empty_row=True):
    """logp, old_logp (near logp), advantages, mask: float32 NumPy arrays."""
    mask = ragged_mask(rng, B, T, empty_row)
    old = np.log(rng.uniform(0.05, 1.0, (B, T))).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, (B, T)).astype(np.float32)
    return logp, old, adv, mask


def with_garbage(rng, x, mask, extra_cols, fill=None):
    """``x`` with random garbage (huge values, NaN, inf) at padding and ``extra_cols`` padded columns."""
    B, T = x.shape
    out = np.concatenate([x, np.zeros((B, extra_cols), x.dtype)], axis=1)
    m = np.concatenate([mask, np.zeros((B, extra_cols), mask.dtype)], axis=1)
    garbage = rng.normal(0, 1e3, out.shape).astype(x.dtype)
    garbage.flat[:: 7] = np.nan
    garbage.flat[3:: 11] = np.inf
    garbage.flat[5:: 13] = -np.inf
    out = np.where(m != 0, out, garbage if fill is None else fill)
    return out, m


# --------------------------------------------------------------------------- references (float64)


def ref_grpo(r, groups, eps, normalize_std, ddof=1):
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    for g in set(groups.tolist()):
        idx = [i for i in range(len(r)) if groups[i] == g]
        vals = r[idx]
        if len(idx) == 1 or np.all(vals == vals[0]):
            continue
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - ddof))
        for i in idx:
            out[i] = (r[i] - mean) / (std + eps) if normalize_std else r[i] - mean
    return out


def ref_gae(rewards, values, mask, gamma, lam):
    B, T = mask.shape
    adv, ret = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        real = [t for t in range(T) if mask[b, t]]
        next_v = next_a = 0.0
        for t in reversed(real):
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            next_a = delta + gamma * lam * next_a
            next_v = values[b, t]
            adv[b, t] = next_a
            ret[b, t] = next_a + values[b, t]
    return adv, ret


def ref_token_losses(logp, old, adv, mask, clip_low, clip_high, dual_clip):
    """Token loss, and d(token loss)/d(logp), float64."""
    B, T = mask.shape
    loss, grad = np.zeros((B, T)), np.zeros((B, T))
    clipped, dual = np.zeros((B, T), bool), np.zeros((B, T), bool)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            A = float(adv[b, t])
            r = math.exp(float(logp[b, t]) - float(old[b, t]))
            l1 = -A * r
            l2 = -A * min(max(r, 1 - clip_low), 1 + clip_high)
            l, g = (l2, 0.0) if l2 > l1 else (l1, -A * r)
            clipped[b, t] = l2 > l1
            if dual_clip is not None and A < 0 and l > -A * dual_clip:
                l, g = -A * dual_clip, 0.0
                dual[b, t] = True
            loss[b, t], grad[b, t] = l, g
    return loss, grad, clipped, dual


def ref_aggregate(tok, mask, agg, denominator=None):
    """Scalar loss and d(loss)/d(token loss) per token."""
    B, T = mask.shape
    n = mask.sum(1)
    dl = np.zeros((B, T))
    if agg is LossAgg.TOKEN_MEAN:
        D = denominator if denominator is not None else max(n.sum(), 1)
        total = sum(tok[b, t] for b in range(B) for t in range(T) if mask[b, t]) / D
        dl[mask != 0] = 1.0 / D
        return total, dl
    D = denominator if denominator is not None else max((n > 0).sum(), 1)
    total = 0.0
    for b in range(B):
        if n[b] == 0:
            continue
        s = sum(tok[b, t] for t in range(T) if mask[b, t])
        scale = 1.0 if agg is LossAgg.SEQ_MEAN_TOKEN_SUM else 1.0 / n[b]
        total += s * scale
        dl[b, mask[b] != 0] = scale
    return total / D, dl / D


def ref_policy_loss(logp, old, adv, mask, clip_low, clip_high, dual_clip, agg, weights=None, denominator=None):
    tok, g, clipped, dual = ref_token_losses(logp, old, adv, mask, clip_low, clip_high, dual_clip)
    w = np.ones(mask.shape) if weights is None else np.asarray(weights, np.float64)
    loss, dl = ref_aggregate(tok * w, mask, agg, denominator)
    n = max(mask.sum(), 1)
    metrics = {"clip_frac": clipped.sum() / n, "dual_clip_frac": dual.sum() / n,
               "approx_kl": ((old - logp.astype(np.float64)) * mask).sum() / n}
    return loss, dl * w * g, metrics


def ref_kl(logp, ref, est):
    out = np.zeros(logp.shape)
    for i in np.ndindex(logp.shape):
        x = float(ref[i]) - float(logp[i])
        out[i] = {KLEstimator.K1: -x, KLEstimator.K2: 0.5 * x * x, KLEstimator.K3: math.exp(x) - x - 1}[est]
    return out


def ref_correction(old, roll, mask, corr, cap, mis_low, mis_high, geo_low, geo_high, kl_est, kl_thr):
    B, T = mask.shape
    w = np.zeros((B, T))
    for b in range(B):
        real = [t for t in range(T) if mask[b, t]]
        s = {t: float(old[b, t]) - float(roll[b, t]) for t in real}
        k = {t: ref_kl(np.array(float(roll[b, t])), np.array(float(old[b, t])), kl_est).item() for t in real}
        seq_ratio = math.exp(sum(s.values())) if real else 1.0
        geo = math.exp(sum(s.values()) / len(real)) if real else 1.0
        mean_k = sum(k.values()) / len(real) if real else 0.0
        for t in real:
            r = math.exp(s[t])
            w[b, t] = {
                Correction.NONE: 1.0,
                Correction.TOKEN_TIS: min(r, cap),
                Correction.TOKEN_MIS: r if mis_low <= r <= mis_high else 0.0,
                Correction.TOKEN_MASK: 1.0 if mis_low <= r <= mis_high else 0.0,
                Correction.SEQ_TIS: min(seq_ratio, cap),
                Correction.SEQ_MASK_GEO: 1.0 if geo_low <= geo <= geo_high else 0.0,
                Correction.TOKEN_KL_REJECT: 1.0 if k[t] <= kl_thr else 0.0,
                Correction.SEQ_KL_REJECT: 1.0 if mean_k <= kl_thr else 0.0,
            }[corr]
    return w


def ref_mismatch(trainer, rollout, mask):
    d = [float(trainer[i]) - float(rollout[i]) for i in np.ndindex(mask.shape) if mask[i]]
    lt = [float(trainer[i]) for i in np.ndindex(mask.shape) if mask[i]]
    lr = [float(rollout[i]) for i in np.ndindex(mask.shape) if mask[i]]
    N = len(d)
    r = [math.exp(x) for x in d]
    mean = sum(d) / N
    seq_w = [math.exp(sum(float(trainer[b, t]) - float(rollout[b, t]) for t in range(mask.shape[1]) if mask[b, t]))
             for b in range(mask.shape[0]) if mask[b].any()]
    ppl_t, ppl_r = math.exp(-sum(lt) / N), math.exp(-sum(lr) / N)
    return {
        "kl_k1": -mean,
        "kl_k3": sum(x - 1 - math.log(x) for x in r) / N,
        "chi2": sum((x - 1) ** 2 for x in r) / N,
        "log_ratio_mean": mean,
        "log_ratio_std": math.sqrt(sum((x - mean) ** 2 for x in d) / N),
        "log_ratio_max": max(d),
        "log_ratio_min": min(d),
        "prob_mult_error": sum(math.exp(abs(x)) for x in d) / N,
        "ess_token": sum(r) ** 2 / (N * sum(x * x for x in r)),
        "ess_seq": sum(seq_w) ** 2 / (len(seq_w) * sum(x * x for x in seq_w)),
        "ppl_trainer": ppl_t,
        "ppl_rollout": ppl_r,
        "ppl_gap": ppl_t - ppl_r,
        "ppl_ratio": ppl_t / ppl_r,
    }


# --------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("B,G", [(4, 4), (12, 3), (32, 8)])
def test_grpo_matches_reference(B, G, normalize_std):
    rng = np.random.default_rng(B * 10 + G)
    r = rng.normal(0, 1, B).astype(np.float32)
    r[:G] = 1.0  # one group with identical rewards
    by_size = j_grpo(r, group_size=G, normalize_std=normalize_std)
    np.testing.assert_allclose(by_size, ref_grpo(r, np.arange(B) // G, 1e-6, normalize_std), **F32)
    # Arbitrary, shuffled labels, including singleton groups.
    labels = rng.choice([3, 17, 1000, -5, 42], size=B)
    by_ids = j_grpo(r, labels, normalize_std=normalize_std)
    np.testing.assert_allclose(by_ids, ref_grpo(r, labels, 1e-6, normalize_std), **F32)


def test_grpo_identical_rewards_give_exact_zero():
    rewards = np.array([0.1, 0.1, 0.1, 1 / 3, 1 / 3, 1 / 3, 0.0, 0.0, 0.0, 7.0, 7.0, 7.0], np.float32)
    for normalize_std in (True, False):
        a = np.asarray(j_grpo(rewards, group_size=3, normalize_std=normalize_std))
        assert np.all(a == 0.0), a
        a = np.asarray(j_grpo(rewards[:1], group_size=1, normalize_std=normalize_std))
        assert np.all(a == 0.0), a


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("B,T", SHAPES)
def test_gae_matches_reference(B, T, gamma, lam):
    rng = np.random.default_rng(B * T + int(lam * 100))
    mask = ragged_mask(rng, B, T)
    if T > 4:
        mask[0, 2] = 0  # a masked hole (multi-turn tool output) is skipped
    rewards = rng.normal(0, 1, (B, T)).astype(np.float32)
    values = rng.normal(0, 1, (B, T)).astype(np.float32)
    adv, ret = j_gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, **F32)
    np.testing.assert_allclose(ret, ref_ret, **F32)


def test_gae_lambda_one_is_reward_to_go_minus_values():
    rng = np.random.default_rng(7)
    B, T = 5, 9
    mask = ragged_mask(rng, B, T)
    rewards = rng.normal(0, 1, (B, T)).astype(np.float32)
    values = rng.normal(0, 1, (B, T)).astype(np.float32)
    adv, ret = j_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    rtg = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                rtg[b, t] = sum(float(rewards[b, s]) for s in range(t, T) if mask[b, s])
    np.testing.assert_allclose(adv, (rtg - values) * mask, **F32)
    np.testing.assert_allclose(ret, rtg, **F32)


def test_gae_padding_never_leaks():
    rng = np.random.default_rng(8)
    B, T = 4, 6
    mask = ragged_mask(rng, B, T)
    rewards = rng.normal(0, 1, (B, T)).astype(np.float32)
    values = rng.normal(0, 1, (B, T)).astype(np.float32)
    adv, ret = j_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    g_rewards, g_mask = with_garbage(rng, rewards, mask, 3)
    g_values, _ = with_garbage(rng, values, mask, 3)
    g_adv, g_ret = j_gae(g_rewards, g_values, g_mask, gamma=0.99, lam=0.95)
    np.testing.assert_array_equal(g_adv[:, :T], adv)
    np.testing.assert_array_equal(g_ret[:, :T], ret)
    assert np.all(np.asarray(g_adv)[g_mask == 0] == 0) and np.all(np.asarray(g_ret)[g_mask == 0] == 0)


def test_compute_advantages_dispatch():
    rng = np.random.default_rng(9)
    B, T, G = 8, 5, 4
    mask = ragged_mask(rng, B, T)
    r = rng.integers(0, 2, B).astype(np.float32)
    for est, norm in ((AdvantageEstimator.GRPO, True), (AdvantageEstimator.GRPO_NO_STD, False)):
        adv, ret = j_adv(est, r, mask, group_size=G)
        np.testing.assert_allclose(adv, ref_grpo(r, np.arange(B) // G, 1e-6, norm)[:, None] * mask, **F32)
        np.testing.assert_array_equal(adv, ret)
    tok_r = j_outcome(r, mask)
    ref_tok = np.zeros((B, T))
    for b in range(B):
        if mask[b].any():
            ref_tok[b, np.nonzero(mask[b])[0][-1]] = r[b]
    np.testing.assert_array_equal(tok_r, ref_tok)
    values = rng.normal(0, 1, (B, T)).astype(np.float32)
    adv, ret = j_adv(AdvantageEstimator.GAE, tok_r, mask, values=values, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = ref_gae(np.asarray(tok_r), values, mask, 0.9, 0.8)
    np.testing.assert_allclose(adv, ref_adv, **F32)
    np.testing.assert_allclose(ret, ref_ret, **F32)
    with pytest.raises(TypeError, match="AdvantageEstimator"):
        compute_advantages("grpo", r, mask, group_size=G)


# --------------------------------------------------------------------------- policy loss

CLIPS = {
    "ppo": dict(clip_low=0.2, clip_high=0.2, dual_clip=None),
    "dapo_clip_higher": dict(clip_low=0.2, clip_high=0.28, dual_clip=None),
    "dual_clip": dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
}


LOSS_CASES = [(agg, clip, has_w) for agg in ALL_AGGS for clip in CLIPS for has_w in (False, True)]


@jax.jit
def all_policy_losses(logp, old, adv, mask, weights):
    """Loss, metrics and d loss / d logp for every (aggregation, clip setting, weights or not):
    one compile per shape instead of one per combination."""
    return [jax.value_and_grad(policy_loss, has_aux=True)(
                logp, old, adv, mask, agg=agg, weights=weights if has_w else None, **CLIPS[clip])
            for agg, clip, has_w in LOSS_CASES]


@pytest.mark.parametrize("B,T", SHAPES)
def test_policy_loss_and_grad_match_reference(B, T):
    rng = np.random.default_rng(B * 100 + T)
    logp, old, adv, mask = rl_batch(rng, B, T)
    logp[0, 0] = old[0, 0] + 2.0  # a far-off ratio so every clip branch is visited
    adv[0, 0] = -1.0
    weights = rng.uniform(0, 2, (B, T)).astype(np.float32) * (rng.uniform(size=(B, T)) > 0.2)
    results = all_policy_losses(logp, old, adv, mask, weights)
    for (agg, clip, has_w), ((loss, metrics), grad) in zip(LOSS_CASES, results, strict=True):
        msg = f"{agg} {clip} weights={has_w}"
        ref_loss, ref_grad, ref_m = ref_policy_loss(logp, old, adv, mask, agg=agg, weights=weights if has_w else None,
                                                    **CLIPS[clip])
        np.testing.assert_allclose(loss, ref_loss, **F32, err_msg=msg)
        np.testing.assert_allclose(grad, ref_grad, **F32, err_msg=msg)
        for k, v in ref_m.items():
            np.testing.assert_allclose(metrics[k], v, **F32, err_msg=f"{msg} {k}")


def test_policy_loss_grad_matches_central_differences_float64():
    rng = np.random.default_rng(11)
    B, T, h = 3, 5, 1e-6
    cfg = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    while True:  # keep every ratio away from the clip kinks so the loss is smooth within +-h
        logp, old, adv, mask = rl_batch(rng, B, T)
        logp = (old + rng.normal(0, 0.6, (B, T))).astype(np.float64)
        r = np.exp(logp - old)
        kinks = (1 - cfg["clip_low"], 1 + cfg["clip_high"], cfg["dual_clip"])  # dual clip binds at r = c
        if min(np.abs(r - k).min() for k in kinks) > 1e-3:
            break
    weights = rng.uniform(0.5, 1.5, (B, T))
    with jax.enable_x64(True):
        for agg in ALL_AGGS:
            f = jax.jit(lambda lp: policy_loss(lp, jnp.asarray(old, jnp.float64), jnp.asarray(adv, jnp.float64),
                                               mask, agg=agg, weights=jnp.asarray(weights), **cfg)[0])
            lp = jnp.asarray(logp)
            grad = np.asarray(jax.grad(f)(lp))
            assert grad.dtype == np.float64
            fd = np.zeros((B, T))
            for i in np.ndindex(B, T):
                e = np.zeros((B, T))
                e[i] = h
                fd[i] = (float(f(lp + e)) - float(f(lp - e))) / (2 * h)
            np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9, err_msg=str(agg))


@jax.jit
def all_aggregations(token_loss, mask):
    return [aggregate_loss(token_loss, mask, agg, denominator=d) for agg in ALL_AGGS for d in (None, 5.0)]


def test_aggregate_loss_matches_reference():
    """The reducer shared by the policy loss, KL penalty and entropy bonus."""
    rng = np.random.default_rng(10)
    for B, T in SHAPES:
        _, ref_lp, _, mask = rl_batch(rng, B, T)
        lp = (ref_lp + rng.normal(0, 0.5, (B, T))).astype(np.float32)
        tok = np.asarray(j_kl(lp, ref_lp, KLEstimator.K3, mask))
        got = all_aggregations(tok, mask)
        want = [ref_aggregate(ref_kl(lp, ref_lp, KLEstimator.K3), mask, agg, d)[0]
                for agg in ALL_AGGS for d in (None, 5.0)]
        np.testing.assert_allclose(got, want, **F32)
    assert float(all_aggregations(tok, np.zeros_like(mask))[0]) == 0.0  # all-padding batch -> 0, not NaN
    with pytest.raises(TypeError, match="LossAgg"):
        aggregate_loss(tok, mask, "token_mean")


@pytest.mark.parametrize("agg", ALL_AGGS)
def test_padding_never_changes_loss_or_grads(agg):
    rng = np.random.default_rng(12)
    B, T, extra = 5, 8, 4
    logp, old, adv, mask = rl_batch(rng, B, T)
    roll = (old + rng.normal(0, 0.2, (B, T))).astype(np.float32)
    cfg = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg)

    def run(logp, old, adv, roll, mask):
        w, _ = j_corr(old, roll, mask, (Correction.TOKEN_MIS, Correction.SEQ_TIS))
        (loss, metrics), grad = j_loss_grad(logp, old, adv, mask, weights=w, **cfg)
        return loss, metrics, np.asarray(grad), np.asarray(w)

    loss, metrics, grad, w = run(logp, old, adv, roll, mask)
    g = [with_garbage(rng, x, mask, extra)[0] for x in (logp, old, adv, roll)]
    g_mask = with_garbage(rng, logp, mask, extra)[1]
    g_loss, g_metrics, g_grad, g_w = run(*g, g_mask)
    assert np.isfinite(g_loss) and np.all(np.isfinite(g_grad))
    np.testing.assert_allclose(g_loss, loss, rtol=1e-6, atol=0)
    np.testing.assert_allclose(g_grad[:, :T], grad, rtol=1e-6, atol=0)
    np.testing.assert_allclose(g_w[:, :T], w, rtol=1e-6, atol=0)
    assert np.all(g_grad[g_mask == 0] == 0) and np.all(g_w[g_mask == 0] == 0)
    for k in metrics:
        np.testing.assert_allclose(g_metrics[k], metrics[k], rtol=1e-6, atol=0, err_msg=k)


def test_token_mean_denominator_counts_real_tokens_even_when_weights_are_zero():
    rng = np.random.default_rng(13)
    B, T = 6, 10
    logp, old, adv, mask = rl_batch(rng, B, T)
    roll = (old + rng.normal(0, 0.7, (B, T))).astype(np.float32)
    w, m = j_corr(old, roll, mask, Correction.TOKEN_MIS, mis_low=0.8, mis_high=1.25)
    w = np.asarray(w)
    n_real, n_kept = mask.sum(), int(((w > 0) & (mask != 0)).sum())
    assert 0 < n_kept < n_real  # the correction really rejected some tokens
    np.testing.assert_allclose(m["token_kept_frac"], n_kept / n_real, **F32)
    loss, _ = j_policy_loss(logp, old, adv, mask, agg=LossAgg.TOKEN_MEAN, weights=w)
    tok, _, _, _ = ref_token_losses(logp, old, adv, mask, 0.2, 0.2, None)
    weighted_sum = float((tok * w * mask).sum())
    np.testing.assert_allclose(loss, weighted_sum / n_real, **F32)
    assert not np.isclose(float(loss), weighted_sum / n_kept, rtol=1e-3)
    # A sequence whose every token is rejected still counts as a sequence.
    w2 = np.ones((B, T), np.float32)
    w2[1] = 0.0
    for agg in (LossAgg.SEQ_MEAN_TOKEN_SUM, LossAgg.SEQ_MEAN_TOKEN_MEAN):
        loss, _ = j_policy_loss(logp, old, adv, mask, agg=agg, weights=w2)
        np.testing.assert_allclose(loss, ref_aggregate(tok * w2, mask, agg)[0], **F32)


@pytest.mark.parametrize("agg", ALL_AGGS)
def test_fixed_denominator_microbatches_sum_to_full_batch(agg):
    rng = np.random.default_rng(14)
    B, T = 8, 12
    logp, old, adv, mask = rl_batch(rng, B, T)
    w = rng.uniform(0, 1.5, (B, T)).astype(np.float32)
    den = mask.sum() if agg is LossAgg.TOKEN_MEAN else (mask.sum(1) > 0).sum()
    cfg = dict(agg=agg, clip_high=0.28, dual_clip=3.0)
    (full, _), full_grad = j_loss_grad(logp, old, adv, mask, weights=w, **cfg)
    micro, grads = 0.0, []
    # Uneven micro-batches, each padded to 4 rows with all-padding (garbage) rows for one static shape.
    for sl in (slice(0, 3), slice(3, 4), slice(4, 8)):
        n = sl.stop - sl.start
        pad = lambda x: np.concatenate([x[sl], rng.normal(0, 9, (4 - n, T)).astype(x.dtype)])
        m = np.concatenate([mask[sl], np.zeros((4 - n, T), mask.dtype)])
        (l, _), g = j_loss_grad(pad(logp), pad(old), pad(adv), m, weights=pad(w), denominator=float(den), **cfg)
        micro += float(l)
        grads.append(np.asarray(g)[:n])
    np.testing.assert_allclose(micro, full, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.concatenate(grads), full_grad, rtol=1e-6, atol=1e-9)


def test_dual_clip_bounds_loss_for_negative_advantages():
    rng = np.random.default_rng(15)
    B, T, c = 4, 6, 3.0
    mask = np.ones((B, T), np.int32)
    old = np.log(rng.uniform(0.05, 0.5, (B, T))).astype(np.float32)
    logp = (old + rng.uniform(2.0, 8.0, (B, T))).astype(np.float32)  # ratios e^2 .. e^8 >> c
    adv = -rng.uniform(0.1, 2.0, (B, T)).astype(np.float32)
    (loss, metrics), grad = j_loss_grad(logp, old, adv, mask, dual_clip=c)
    np.testing.assert_allclose(loss, (c * np.abs(adv)).mean(), **F32)
    np.testing.assert_array_equal(grad, 0.0)
    assert float(metrics["dual_clip_frac"]) == 1.0
    plain, _ = j_policy_loss(logp, old, adv, mask)
    assert float(plain) > float(loss)  # without dual clip the loss grows with the ratio
    # Positive advantages are untouched by dual clip.
    np.testing.assert_array_equal(j_policy_loss(logp, old, -adv, mask, dual_clip=c)[0],
                                  j_policy_loss(logp, old, -adv, mask)[0])
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, dual_clip=0.5)


def test_policy_loss_upcasts_low_precision_and_rejects_strings():
    rng = np.random.default_rng(16)
    logp, old, adv, mask = rl_batch(rng, 3, 4)
    loss, metrics = j_policy_loss(jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16),
                                jnp.asarray(adv, jnp.bfloat16), mask)
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in metrics.values())
    with pytest.raises(TypeError, match="LossAgg"):
        policy_loss(logp, old, adv, mask, agg="token_mean")
    with pytest.raises(ValueError, match="shape"):
        policy_loss(logp[:, :2], old, adv, mask)


# --------------------------------------------------------------------------- KL, entropy


@pytest.mark.parametrize("est", list(KLEstimator))
def test_kl_penalty_matches_reference(est):
    rng = np.random.default_rng(17)
    for B, T in SHAPES:
        _, ref, _, mask = rl_batch(rng, B, T)
        logp = (ref + rng.normal(0, 0.5, (B, T))).astype(np.float32)
        np.testing.assert_allclose(j_kl(logp, ref, est), ref_kl(logp, ref, est), **F32)
        g_logp, g_mask = with_garbage(rng, logp, mask, 2)
        g_ref, _ = with_garbage(rng, ref, mask, 2)
        out = np.asarray(j_kl(g_logp, g_ref, est, mask=g_mask))
        np.testing.assert_allclose(out[:, :T], ref_kl(logp, ref, est) * mask, **F32)
        assert np.all(out[g_mask == 0] == 0)


def test_entropy_from_logits_matches_reference():
    rng = np.random.default_rng(18)
    for B, T, V, scale in ((2, 3, 5, 1.0), (3, 4, 50, 30.0)):
        z = (rng.normal(0, scale, (B, T, V)) + 1000.0).astype(np.float32)  # large offset: must be shift-invariant
        z[0, 0, : V // 2] = -np.inf  # masked vocabulary
        ref = np.zeros((B, T))
        for i in np.ndindex(B, T):
            x = z[i].astype(np.float64) - np.max(z[i])
            p = np.exp(x) / np.exp(x).sum()
            ref[i] = -sum(pv * math.log(pv) for pv in p if pv > 0)
        np.testing.assert_allclose(j_entropy(z), ref, rtol=1e-4, atol=1e-5)
        g = jax.grad(lambda z: j_entropy(z).sum())(jnp.asarray(z))
        assert np.all(np.isfinite(g))
    out = j_entropy(jnp.zeros((1, 1, 8), jnp.bfloat16))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, math.log(8), rtol=1e-6)


# --------------------------------------------------------------------------- rollout correction

CORR_KW = dict(tis_cap=2.0, mis_low=0.5, mis_high=1.6, geo_low=0.95, geo_high=1.05, kl_threshold=0.05)


CORR_CASES = [(c, KLEstimator.K3) for c in Correction] + [(c, KLEstimator.K2) for c in Correction if "KL" in c.name]


@jax.jit
def all_corrections(old, roll, mask):
    """Weights, metrics and d sum(w) / d old for every correction case, in one compile per shape."""
    out = []
    for corr, est in CORR_CASES:
        f = lambda o: rollout_correction_weights(o, roll, mask, corr, kl_estimator=est, **CORR_KW)
        out.append((*f(old), jax.grad(lambda o: f(o)[0].sum())(old)))
    return out


@pytest.mark.parametrize("B,T", SHAPES)
def test_rollout_correction_matches_reference(B, T):
    rng = np.random.default_rng(19 + B)
    _, old, _, mask = rl_batch(rng, B, T)
    roll = (old + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    if B > 2:
        roll[1] = old[1] + 0.01 * rng.normal(size=T)  # one near-on-policy row: geo/KL keep it
    for (corr, est), (w, metrics, grad) in zip(CORR_CASES, all_corrections(old, roll, mask), strict=True):
        msg = f"{corr} {est}"
        ref = ref_correction(old, roll, mask, corr, CORR_KW["tis_cap"], CORR_KW["mis_low"], CORR_KW["mis_high"],
                             CORR_KW["geo_low"], CORR_KW["geo_high"], est, CORR_KW["kl_threshold"])
        np.testing.assert_allclose(w, ref, rtol=5e-5, atol=1e-6, err_msg=msg)
        n = mask.sum()
        np.testing.assert_allclose(metrics["weight_mean"], ref.sum() / n, rtol=5e-5, err_msg=msg)
        np.testing.assert_allclose(metrics["token_kept_frac"], ((ref > 0) & (mask > 0)).sum() / n, rtol=1e-6,
                                   err_msg=msg)
        rows = mask.any(1)
        np.testing.assert_allclose(metrics["seq_kept_frac"], (ref[rows] > 0).any(1).mean(), rtol=1e-6, err_msg=msg)
        np.testing.assert_array_equal(grad, 0.0, err_msg=f"{msg}: weights must be stop-gradient")


@pytest.mark.parametrize("corr", [Correction.TOKEN_TIS, Correction.TOKEN_MASK, Correction.SEQ_TIS])
def test_normalized_weights_have_mean_one_over_the_batch(corr):
    """``normalize``: every correction's float64 reference weights divided by their mean over the batch's real
    tokens; still stop-gradient; an all-rejecting batch stays 0 (no division by zero)."""
    rng = np.random.default_rng()
    B, T = 6, 11
    _, old, _, mask = rl_batch(rng, B, T)
    roll = (old + rng.normal(0, 0.4, (B, T))).astype(np.float32)
    f = jax.jit(lambda o, r: rollout_correction_weights(o, r, mask, corr, normalize=True, **CORR_KW))
    w, metrics = f(old, roll)
    ref = ref_correction(old, roll, mask, corr, CORR_KW["tis_cap"], CORR_KW["mis_low"], CORR_KW["mis_high"],
                         CORR_KW["geo_low"], CORR_KW["geo_high"], KLEstimator.K3, CORR_KW["kl_threshold"])
    ref = ref / (ref.sum() / mask.sum())
    np.testing.assert_allclose(np.asarray(w), ref, rtol=5e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["weight_mean"]), 1.0, rtol=1e-5)
    grad = jax.grad(lambda o: f(o, roll)[0].sum())(old)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    far = (old - 10.0).astype(np.float32)  # every ratio e^10: outside the mask's bounds
    w_far, _ = jax.jit(lambda o, r: rollout_correction_weights(o, r, mask, Correction.TOKEN_MASK, normalize=True,
                                                               **CORR_KW))(old, far)
    assert not np.any(np.asarray(w_far))


def test_tis_with_infinite_cap_is_plain_importance_sampling():
    rng = np.random.default_rng(20)
    B, T = 5, 9
    _, old, _, mask = rl_batch(rng, B, T)
    roll = (old + rng.normal(0, 1.0, (B, T))).astype(np.float32)
    w, m = j_corr(old, roll, mask, Correction.TOKEN_TIS, tis_cap=math.inf)
    np.testing.assert_allclose(w, np.exp(old.astype(np.float64) - roll) * mask, **F32)
    assert float(m["capped_frac"]) == 0.0
    w, _ = j_corr(old, roll, mask, Correction.SEQ_TIS, tis_cap=math.inf)
    seq = np.exp(((old.astype(np.float64) - roll) * mask).sum(1))
    np.testing.assert_allclose(w, seq[:, None] * mask, **F32)
    # and a finite cap binds exactly where the ratio exceeds it
    w, m = j_corr(old, roll, mask, Correction.TOKEN_TIS, tis_cap=1.5)
    r = np.exp(old.astype(np.float64) - roll)
    np.testing.assert_allclose(w, np.minimum(r, 1.5) * mask, **F32)
    np.testing.assert_allclose(m["capped_frac"], ((r > 1.5) & (mask > 0)).sum() / mask.sum(), rtol=1e-6)


def test_mis_masks_exactly_the_out_of_range_tokens():
    B, T = 3, 6
    lo, hi = 0.5, 2.0
    ratios = np.array([[0.3, 0.5, 0.9, 1.0, 2.0, 2.5],
                       [0.49, 0.51, 1.99, 2.01, 10.0, 0.01],
                       [1.1, 4.0, 0.2, 1.0, 1.0, 1.0]])
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], np.int32)
    roll = np.log(np.full((B, T), 0.2))
    old = roll + np.log(ratios)
    # compute r from the float32 inputs the function sees, so boundary tokens are judged alike
    r32 = np.exp(old.astype(np.float32).astype(np.float64) - roll.astype(np.float32))
    expected_keep = (r32 >= lo * (1 - 1e-6)) & (r32 <= hi * (1 + 1e-6)) & (mask > 0)
    w, m = j_corr(old.astype(np.float32), roll.astype(np.float32), mask, Correction.TOKEN_MIS,
                                      mis_low=lo, mis_high=hi)
    w = np.asarray(w)
    np.testing.assert_array_equal(w > 0, expected_keep)
    np.testing.assert_allclose(w[expected_keep], ratios[expected_keep], rtol=1e-5)  # kept weight is the ratio
    assert np.all(w[~expected_keep] == 0.0)
    np.testing.assert_allclose(m["token_kept_frac"], expected_keep.sum() / mask.sum(), rtol=1e-6)


def test_corrections_compose_by_product():
    rng = np.random.default_rng(21)
    B, T = 6, 8
    _, old, _, mask = rl_batch(rng, B, T)
    roll = (old + rng.normal(0, 0.05, (B, T))).astype(np.float32)
    pair = (Correction.SEQ_TIS, Correction.SEQ_MASK_GEO)
    w, _ = j_corr(old, roll, mask, pair, **CORR_KW)
    w1, _ = j_corr(old, roll, mask, pair[0], **CORR_KW)
    w2, _ = j_corr(old, roll, mask, pair[1], **CORR_KW)
    np.testing.assert_allclose(w, np.asarray(w1) * np.asarray(w2), rtol=1e-6)
    with pytest.raises(TypeError, match="Correction"):
        j_corr(old, roll, mask, "token_tis")
    with pytest.raises(ValueError, match="K2 or K3"):
        j_corr(old, roll, mask, Correction.TOKEN_KL_REJECT, kl_estimator=KLEstimator.K1)


@pytest.mark.parametrize("B,T", [(1, 3), (4, 7), (6, 16)])
def test_mismatch_metrics_match_reference(B, T):
    rng = np.random.default_rng(22 + B)
    _, trainer, _, mask = rl_batch(rng, B, T)
    rollout = (trainer + rng.normal(0, 0.2, (B, T))).astype(np.float32)
    got = j_mismatch(trainer, rollout, mask)
    ref = ref_mismatch(trainer, rollout, mask)
    assert set(got) == set(ref)
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    g_tr, g_mask = with_garbage(rng, trainer, mask, 3)
    g_ro, _ = with_garbage(rng, rollout, mask, 3)
    g = j_mismatch(g_tr, g_ro, g_mask)
    for k in ref:
        np.testing.assert_allclose(g[k], got[k], rtol=1e-6, atol=1e-6, err_msg=k)
    empty = j_mismatch(trainer, rollout, np.zeros_like(mask))
    assert all(np.isfinite(v) for v in empty.values())


def test_identical_policies_have_zero_mismatch():
    rng = np.random.default_rng(23)
    _, lp, _, mask = rl_batch(rng, 4, 6)
    m = j_mismatch(lp, lp, mask)
    for k in ("kl_k1", "kl_k3", "chi2", "log_ratio_std", "ppl_gap"):
        assert float(m[k]) == 0.0, k
    for k in ("prob_mult_error", "ess_token", "ess_seq", "ppl_ratio"):
        np.testing.assert_allclose(m[k], 1.0, rtol=1e-6, err_msg=k)


# --------------------------------------------------------------------------- jit


def test_eager_equals_jit():
    """The jitted calls above are the reference-checked path; eager mode must agree with them."""
    rng = np.random.default_rng(24)
    B, T, G = 4, 7, 2  # a shape used above, so the jitted side is mostly cached
    logp, old, adv, mask = rl_batch(rng, B, T)
    roll = (old + rng.normal(0, 0.2, (B, T))).astype(np.float32)
    r = rng.normal(size=B).astype(np.float32)
    values = rng.normal(size=(B, T)).astype(np.float32)
    logits = rng.normal(size=(B, T, 11)).astype(np.float32)

    def same(eager, jitted):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), eager, jitted)

    cfg = dict(agg=LossAgg.SEQ_MEAN_TOKEN_MEAN, clip_high=0.28, dual_clip=3.0)
    same(jax.value_and_grad(policy_loss, has_aux=True)(logp, old, adv, mask, weights=roll, **cfg),
         j_loss_grad(logp, old, adv, mask, weights=roll, **cfg))
    corr = (Correction.TOKEN_MIS, Correction.SEQ_MASK_GEO, Correction.SEQ_KL_REJECT)
    same(rollout_correction_weights(old, roll, mask, corr), j_corr(old, roll, mask, corr))
    same(kl_penalty(logp, old, KLEstimator.K3, mask), j_kl(logp, old, KLEstimator.K3, mask))
    same(compute_advantages(AdvantageEstimator.GRPO, r, mask, group_size=G),
         j_adv(AdvantageEstimator.GRPO, r, mask, group_size=G))
    same(gae_advantages(values, values, mask, gamma=0.9, lam=0.8), j_gae(values, values, mask, gamma=0.9, lam=0.8))
    same(mismatch_metrics(old, roll, mask), j_mismatch(old, roll, mask))
    same(entropy_from_logits(logits), j_entropy(logits))


def test_overlong_penalty_against_dapo_formula():
    """DAPO's soft overlong punishment at and around the buffer's edges, against the paper's piecewise formula in
    float64: 0 up to L_max - L_cache, ((L_max - L_cache) - L) / L_cache inside the buffer, -1 past L_max; scaled
    by the penalty; a zero buffer punishes nothing; a buffer beyond the cap is an error."""
    from fp8rl_jax.rl import overlong_penalty

    rng = np.random.default_rng()
    L_max = int(rng.integers(64, 512))
    L_cache = int(rng.integers(1, L_max))
    start = L_max - L_cache
    lengths = np.array([0, start - 1, start, start + 1, (start + L_max) // 2, L_max - 1, L_max, L_max + 7,
                        *rng.integers(0, L_max + 1, 16)])
    lengths = np.clip(lengths, 0, None)

    def dapo(n):
        if n <= start:
            return 0.0
        if n <= L_max:
            return (start - n) / L_cache
        return -1.0

    want = np.array([dapo(int(n)) for n in lengths])
    for penalty in (1.0, 0.5):
        got = np.asarray(overlong_penalty(lengths.astype(np.float64), L_max, L_cache, penalty))
        np.testing.assert_allclose(got, penalty * want, rtol=0, atol=1e-6)  # float32 arithmetic
    assert not np.any(np.asarray(overlong_penalty(lengths, L_max, 0)))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, L_max, L_max + 1)


def test_overlong_shaping_of_a_rollout():
    """The loop's overlong handling: the penalty follows the lengths, and the filter keeps the responses that ended
    with EOS (truncated ones leave the loss); without the options nothing changes."""
    import dataclasses

    from fp8rl_jax.rl.config import AlgorithmConfig, ConfigError
    from fp8rl_jax.rl.loop import Rollout, overlong_shaping
    from fp8rl_jax.rollout.base import FinishReason, RolloutBatch

    lengths = np.array([3, 8, 10, 10], np.int32)
    finish = [FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP]
    batch = RolloutBatch(tokens=np.zeros((4, 10), np.int32), logprobs=np.zeros((4, 10), np.float32), lengths=lengths,
                         finish_reasons=finish)
    ro = Rollout(prompts=[[1]] * 4, group_ids=np.array([0, 0, 1, 1], np.int32), batch=batch, seconds=1.0)
    penalty, kept = overlong_shaping(ro, AlgorithmConfig(), max_new_tokens=10)
    assert not penalty.any() and kept.all()
    alg = AlgorithmConfig(overlong_buffer=4, overlong_penalty=1.0, overlong_filter=True)
    penalty, kept = overlong_shaping(ro, alg, max_new_tokens=10)
    np.testing.assert_allclose(penalty, [0.0, -0.5, -1.0, -1.0])
    assert kept.tolist() == [True, True, False, True]
    with pytest.raises(ConfigError, match="overlong"):
        AlgorithmConfig(overlong_buffer=-1)
    from configs.rl import QUICKSTART
    with pytest.raises(ConfigError, match="exceeds rollout.max_new_tokens"):
        dataclasses.replace(QUICKSTART, algorithm=dataclasses.replace(QUICKSTART.algorithm, overlong_buffer=99))
