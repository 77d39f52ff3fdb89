"""PPO with a value head on the shared trunk and GAE: the value loss, the head's alignment, the
trainer with the value loss on, the loop's GAE stages and the config (CPU, tiny models, float32).

References are independent of the code under test: the value loss, its gradient and the
explained variance are recomputed in float64 NumPy from their formulas (plain loops), the
gradient is also checked by central differences; the values against the final hidden states
of the model's own forward; accumulated gradients against one whole-batch ``jax.grad``;
padding against the unpadded batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from configs.models import tiny_qwen3
from fp8rl_jax.models import (
    DensePolicy,
    Fp8Mode,
    bind,
    forward,
    init_params,
)
from fp8rl_jax.rl import config as rlconfig
from fp8rl_jax.rl.algos import (
    AdvantageEstimator,
    Correction,
    LossAgg,
    gae_advantages,
    masked_whiten,
    outcome_to_token_rewards,
    value_loss,
)
from fp8rl_jax.rl.algos import value_loss as _value_loss
from fp8rl_jax.rl.loop import (
    MetricsLogger,
    Task,
    build_batch,
    read_metrics,
    rollout,
    run,
    sync_weights,
    with_trainer_logprobs,
)
from fp8rl_jax.rl.trainer import (
    ComputeDtype,
    LossConfig,
    OptimizerConfig,
    PolicyValueParams,
    TrainBatch,
    TrainerConfig,
    compute_grads,
    init_train_state,
    loss_fn,
    make_logprob_fn,
    make_logprob_value_fn,
    make_optimizer,
    make_train_step,
    model_params,
    token_logprobs,
    token_logprobs_and_values,
    with_value_head,
)
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.tasks import Example

SMALL1 = dataclasses.replace(tiny_qwen3, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=16)
F32 = DensePolicy("float32")
ALL_AGGS = list(LossAgg)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def fast_jit(fn, static=("model_config", "policy", "trainer_config")):
    """``jax.jit(fn)`` compiled once per (static keywords, argument shapes) with FAST_COMPILE
    (XLA's CPU compile, not the run, dominates these tests)."""
    jitted = jax.jit(fn, static_argnames=static)
    cache = {}

    def call(*args, **kw):
        st = {k: kw.pop(k) for k in static if k in kw}
        leaves, tree = jax.tree.flatten((args, kw))
        key = (tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves), tuple(sorted(st.items())))
        if key not in cache:
            cache[key] = jitted.lower(*args, **kw, **st).compile(FAST_COMPILE)
        return cache[key](*args, **kw)

    return call


def compile_fast(jitted):
    compiled = {}

    def call(*args):
        if "fn" not in compiled:
            compiled["fn"] = jitted.lower(*args).compile(FAST_COMPILE)
        return compiled["fn"](*args)

    return call


# the reference values jitted: one compilation instead of one per op (seconds on the CPU)
_jit_logprobs_and_values = jax.jit(token_logprobs_and_values, static_argnames=("config", "policy"))


@functools.cache
def params_for(cfg, seed=0):
    return init_params(cfg, jax.random.key(seed), jnp.float32)


def pv_params(cfg, scale=1.0, seed=0) -> PolicyValueParams:
    """Model params with a random (non-zero) value head, so the value loss also reaches the trunk."""
    return with_value_head(params_for(cfg, seed), cfg, jax.random.key(100 + seed), scale=scale)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


# --------------------------------------------------------------------------- value loss (algos)


def value_inputs(rng, B=5, T=7, nan_padding=True):
    """V, V_old, R, mask: ragged rows, row 1 empty, NaN on padding; ``V - V_old`` spread so that a
    0.2 clip binds on some tokens but not all."""
    lengths = rng.integers(1, T + 1, B)
    lengths[1] = 0
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    old = rng.normal(0, 1, (B, T))
    v = old + rng.normal(0, 0.3, (B, T))
    ret = rng.normal(0, 1, (B, T))
    if nan_padding:
        v, old, ret = (np.where(mask > 0, x, np.nan) for x in (v, old, ret))
    return v, old, ret, mask


def ref_value_loss(v, old, ret, mask, agg, clip):
    """float64 loops: loss, d loss / d V, metrics."""
    v, old, ret, mask = (np.asarray(x, np.float64) for x in (v, old, ret, mask))
    B, T = mask.shape
    n_b = mask.sum(1)
    n_tok, n_seq = mask.sum(), max((n_b > 0).sum(), 1)
    loss, grad = 0.0, np.zeros((B, T))
    clipped = []
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            l1 = 0.5 * (v[b, t] - ret[b, t]) ** 2
            g = v[b, t] - ret[b, t]
            if clip is not None:
                vc = old[b, t] + min(max(v[b, t] - old[b, t], -clip), clip)
                l2 = 0.5 * (vc - ret[b, t]) ** 2
                clipped.append(l2 > l1)
                if l2 > l1:  # only when |V - V_old| > clip: the clipped value is constant in V
                    l1, g = l2, 0.0
            else:
                clipped.append(False)
            w = {LossAgg.TOKEN_MEAN: 1 / max(n_tok, 1), LossAgg.SEQ_MEAN_TOKEN_SUM: 1 / n_seq,
                 LossAgg.SEQ_MEAN_TOKEN_MEAN: 1 / (n_b[b] * n_seq)}[agg]
            loss += w * l1
            grad[b, t] = w * g
    m = mask > 0
    err, r = (ret - v)[m], ret[m]
    metrics = {"clip_frac": np.mean(clipped), "explained_var": 1 - err.var() / (r.var() + 1e-5),
               "value_mean": v[m].mean(), "return_mean": r.mean()}
    return loss, grad, metrics


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_float64_numpy(clip):
    rng = np.random.default_rng(0 if clip is None else 1)
    v, old, ret, mask = value_inputs(rng)
    f = jax.jit(jax.value_and_grad(value_loss, has_aux=True), static_argnames=("clip", "agg"))
    for agg in ALL_AGGS:
        (loss, metrics), grad = f(jnp.asarray(v, jnp.float32), jnp.asarray(old, jnp.float32),
                                  jnp.asarray(ret, jnp.float32), mask, clip=clip, agg=agg)
        ref_loss, ref_grad, ref_m = ref_value_loss(v, old, ret, mask, agg, clip)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(agg))
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7, err_msg=str(agg))
        assert not np.asarray(grad)[mask == 0].any()  # NaN padding neither leaks into values nor gradients
        for k, want in ref_m.items():
            np.testing.assert_allclose(metrics[k], want, rtol=1e-5, atol=1e-6, err_msg=f"{agg} {k}")
    if clip is not None:  # the data exercises both branches
        assert 0 < ref_m["clip_frac"] < 1


def test_value_loss_grad_matches_central_differences_float64():
    rng = np.random.default_rng(2)
    clip, h = 0.2, 1e-6
    while True:  # keep every token away from the kinks (|V - V_old| = clip, equal branches) within +-h
        v, old, ret, mask = value_inputs(rng, B=3, T=5, nan_padding=False)
        d = np.abs(v - old)
        vc = old + np.clip(v - old, -clip, clip)
        gap = np.abs((vc - ret) ** 2 - (v - ret) ** 2)
        if np.abs(d - clip).min() > 1e-3 and gap[d > clip].min() > 1e-4:
            break
    with jax.enable_x64(True):
        for agg in ALL_AGGS:
            f = jax.jit(lambda x: value_loss(x, jnp.asarray(old), jnp.asarray(ret), mask, clip=clip, agg=agg)[0])  # noqa: B023
            x = jnp.asarray(v, jnp.float64)
            grad = np.asarray(jax.grad(f)(x))
            assert grad.dtype == np.float64
            fd = np.zeros(v.shape)
            for i in np.ndindex(*v.shape):
                e = np.zeros(v.shape)
                e[i] = h
                fd[i] = (float(f(x + e)) - float(f(x - e))) / (2 * h)
            np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9, err_msg=str(agg))
            np.testing.assert_allclose(grad, ref_value_loss(v, old, ret, mask, agg, clip)[1], rtol=1e-10, atol=1e-14)


def test_value_loss_padding_and_split_denominator():
    """Padding rows/columns with garbage change nothing; two halves with the whole batch's
    denominator add up to the whole-batch loss."""
    rng = np.random.default_rng(3)
    v, old, ret, mask = value_inputs(rng, B=6, T=6)
    # jitted: one compilation per shapes and settings instead of one per op and shape
    value_loss = jax.jit(_value_loss, static_argnames=("clip", "agg", "denominator"))
    for agg in ALL_AGGS:
        loss, m = value_loss(v, old, ret, mask, clip=0.2, agg=agg)

        def pad(x, fill):
            x = np.concatenate([x, np.full((x.shape[0], 3), fill)], 1)
            return np.concatenate([x, np.full((2, x.shape[1]), fill)], 0)

        lp, mp = value_loss(pad(v, 1e4), pad(old, np.nan), pad(ret, -np.inf), pad(mask, 0.0), clip=0.2, agg=agg)
        np.testing.assert_allclose(lp, loss, rtol=1e-6)
        for k in m:
            np.testing.assert_allclose(mp[k], m[k], rtol=1e-5, atol=1e-7, err_msg=k)
        den = float(mask.sum() if agg is LossAgg.TOKEN_MEAN else (mask.sum(1) > 0).sum())
        halves = sum(float(value_loss(v[s], old[s], ret[s], mask[s], clip=0.2, agg=agg, denominator=den)[0])
                     for s in (slice(0, 3), slice(3, 6)))
        np.testing.assert_allclose(halves, loss, rtol=1e-6)
    with pytest.raises(ValueError, match="needs old_values"):
        _value_loss(v, None, ret, mask, clip=0.2)
    with pytest.raises(ValueError, match="value clip must be > 0"):
        _value_loss(v, old, ret, mask, clip=0.0)


def test_masked_whiten_and_gae_alignment_of_outcome_rewards():
    rng = np.random.default_rng(4)
    x = rng.normal(3, 2, (4, 6))
    mask = np.ones((4, 6))
    mask[1] = 0
    mask[2, 4:] = 0
    w = np.asarray(masked_whiten(np.where(mask > 0, x, np.nan), mask), np.float64)
    xs = x[mask > 0]
    np.testing.assert_allclose(w[mask > 0], (xs - xs.mean()) / np.sqrt(xs.var(ddof=1) + 1e-8), rtol=1e-5)
    assert not w[mask == 0].any()
    # gamma = lam = 1, outcome reward on the last real token: A_t = r - V_t, R_t = r on every real token.
    r = rng.normal(0, 1, 4)
    v = rng.normal(0, 1, (4, 6))
    adv, ret = gae_advantages(outcome_to_token_rewards(r, mask), v, mask)
    np.testing.assert_allclose(np.asarray(adv)[mask > 0], (r[:, None] - v)[mask > 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret)[mask > 0], np.broadcast_to(r[:, None], (4, 6))[mask > 0], rtol=1e-5)


# --------------------------------------------------------------------------- the value head on the trunk


def test_values_align_with_logprobs_and_grpo_outputs_are_unchanged():
    """values[:, t] = head(h[:, t - 1]) (the hidden state that predicts tokens[t]), values[:, 0] = 0;
    the value of entry t does not see tokens[t], the one of entry t + 1 does. The logits and
    logprobs of the value path are exactly those of the GRPO path."""
    rng = np.random.default_rng(5)
    cfg = SMALL1
    pv = pv_params(cfg)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 9)), jnp.int32)

    def both(p, t):
        model = bind(p.model, cfg, F32)
        h, _ = model.hidden_states(t)
        logits = model.logits(h)
        return (logits, h, forward(p.model, t, config=cfg, policy=F32)[0],
                token_logprobs_and_values(p, t, config=cfg, policy=F32),
                token_logprobs(p.model, t, config=cfg, policy=F32)[0])

    f = fast_jit(both, static=())
    logits, h, logits_ref, (logp, ent, values), logp_ref = f(pv, tokens)
    assert ent is None
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_ref))
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(logp_ref))
    k, b = (np.asarray(pv.value_head[n], np.float64) for n in ("kernel", "bias"))
    h = np.asarray(h, np.float64)
    want = np.zeros(tokens.shape)
    for t in range(1, tokens.shape[1]):
        want[:, t] = h[:, t - 1] @ k[:, 0] + b
    np.testing.assert_allclose(np.asarray(values), want, rtol=1e-5, atol=1e-6)
    assert np.abs(want[:, 1:]).min() > 0 and not np.asarray(values)[:, 0].any()
    # Causality of the alignment: changing tokens[:, 4] leaves values[:, :5] and changes values[:, 5].
    changed = tokens.at[:, 4].set((tokens[:, 4] + 1) % cfg.vocab_size)
    v2 = np.asarray(f(pv, changed)[3][2])
    np.testing.assert_array_equal(v2[:, :5], np.asarray(values)[:, :5])
    assert np.all(np.abs(v2[:, 5] - np.asarray(values)[:, 5]) > 1e-6)


def test_trainer_logprobs_and_values_and_the_generator_gets_model_params_only():
    """make_logprob_value_fn = (make_logprob_fn, values) with micro-batches; the GRPO logprob fn
    ignores a value head; sync_weights hands the generator the model's params, nothing else."""
    rng = np.random.default_rng(6)
    cfg = SMALL1
    pv = pv_params(cfg)
    tc = TrainerConfig(compute_dtype=ComputeDtype.FLOAT32, micro_batches=2)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 8)), jnp.int32)
    logp, values = compile_fast(make_logprob_value_fn(cfg, F32, tc))(pv, tokens)
    lp_fn = compile_fast(make_logprob_fn(cfg, F32, tc))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(lp_fn(pv.model, tokens)), rtol=1e-6, atol=1e-6)
    lp_fn_head = compile_fast(make_logprob_fn(cfg, F32, tc))  # the GRPO logprob fn ignores a value head
    np.testing.assert_array_equal(np.asarray(lp_fn_head(pv, tokens)), np.asarray(lp_fn(pv.model, tokens)))
    ref = _jit_logprobs_and_values(pv, tokens, config=cfg, policy=F32)[2]
    np.testing.assert_allclose(np.asarray(values), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert model_params(pv) is pv.model and model_params(pv.model) is pv.model

    class Recorder:
        def update_weights(self, params):
            self.params = params

    gen = Recorder()
    sync_weights(gen, pv, model_config=cfg, dtype=jnp.float32)
    assert jax.tree.structure(gen.params) == jax.tree.structure(params_for(cfg))
    np.testing.assert_array_equal(flat(gen.params), flat(params_for(cfg)))
    sync_weights(gen, params_for(cfg), model_config=cfg, dtype=jnp.bfloat16)  # GRPO: plain params, as before
    assert jax.tree.structure(gen.params) == jax.tree.structure(params_for(cfg))


# --------------------------------------------------------------------------- trainer with the value loss


B_ACC, T_ACC, M_ACC = 8, 12, 4


def ppo_batch(rng, cfg, B, T, *, nan_padding=True) -> TrainBatch:
    """Random ragged batch with V_old, returns and advantages; row 1 has no response."""
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    prompt = rng.integers(1, T // 2 + 1, B)
    resp = rng.integers(1, T - prompt + 1)
    resp[1] = 0
    t = np.arange(T)[None, :]
    mask = ((t >= prompt[:, None]) & (t < (prompt + resp)[:, None])).astype(np.int32)
    old = -np.log(cfg.vocab_size) + rng.normal(0, 0.3, (B, T))
    roll = old + rng.normal(0, 0.1, (B, T))
    v_old = rng.normal(0, 0.5, (B, T))
    ret = v_old + rng.normal(0, 1.0, (B, T))
    adv = rng.normal(0, 1, (B, T))

    def f(x):
        return jnp.asarray(np.where(mask > 0, x, np.nan) if nan_padding else x * mask, jnp.float32)

    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=f(adv), old_logprobs=f(old),
                      rollout_logprobs=f(roll), values=f(v_old), returns=f(ret))


def ppo_config(agg, **kw) -> TrainerConfig:
    return TrainerConfig(loss=LossConfig(agg=agg, kl_coef=0.0, entropy_coef=0.01, correction=Correction.TOKEN_TIS,
                                         vf_coef=0.7, value_clip=0.3), micro_batches=M_ACC,
                         compute_dtype=ComputeDtype.FLOAT32, **kw)


jit_grads = fast_jit(compute_grads)
jit_value_and_grad = fast_jit(jax.value_and_grad(loss_fn, has_aux=True))
jit_loss = fast_jit(loss_fn)  # the loss alone: no backward pass to compile where no gradient is checked
VALUE_METRICS = ("value_loss", "value_clip_frac", "value_explained_var", "value_mean", "return_mean")


@pytest.mark.parametrize("agg", [LossAgg.TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_MEAN])
def test_accumulation_equals_whole_batch_with_value_loss(agg):
    """Micro-batch accumulated gradients (model and value head) and every metric == one whole-batch
    jax.grad; the value loss really is in the loss and its metrics match float64 NumPy."""
    cfg = SMALL1
    rng = np.random.default_rng(10 + ALL_AGGS.index(agg))
    pv = pv_params(cfg)
    batch = ppo_batch(rng, cfg, B_ACC, T_ACC)
    counts = np.asarray(batch.loss_mask)[:, 1:].reshape(M_ACC, -1).sum(1)
    assert len(set(counts.tolist())) > 1  # unequal micro-batches: averaging their means would differ
    tc = ppo_config(agg)
    (loss, ref_m), ref_g = jit_value_and_grad(pv, batch, model_config=cfg, policy=F32,
                                              trainer_config=dataclasses.replace(tc, micro_batches=1))
    grads, metrics = jit_grads(pv, batch, model_config=cfg, policy=F32, trainer_config=tc)
    assert isinstance(grads, PolicyValueParams)
    assert rel_err(flat(grads), flat(ref_g)) < 1e-5
    assert rel_err(flat(grads.value_head), flat(ref_g.value_head)) < 1e-5
    assert set(metrics) == set(ref_m) and set(VALUE_METRICS) <= set(metrics)
    for k in ref_m:
        np.testing.assert_allclose(metrics[k], ref_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # The value metrics against float64 NumPy, with V from the model's own forward.
    m = np.asarray(batch.loss_mask) > 0
    m[:, 0] = False
    v = np.asarray(_jit_logprobs_and_values(pv, batch.tokens, config=cfg, policy=F32)[2], np.float64)
    v_old, ret = (np.asarray(x, np.float64) for x in (batch.values, batch.returns))
    ref_loss, _, ref = ref_value_loss(v, v_old, ret, m.astype(np.float64), agg, 0.3)
    np.testing.assert_allclose(metrics["value_loss"], ref_loss, rtol=1e-4)
    np.testing.assert_allclose(metrics["value_clip_frac"], ref["clip_frac"], atol=1e-6)
    np.testing.assert_allclose(metrics["value_explained_var"], ref["explained_var"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics["value_mean"], ref["value_mean"], rtol=1e-4, atol=1e-6)
    assert 0 < float(metrics["value_clip_frac"]) < 1
    # Without returns the same params give the GRPO loss: the difference is vf_coef * value_loss.
    grpo_loss, _ = jit_loss(pv, dataclasses.replace(batch, values=None, returns=None), model_config=cfg,
                            policy=F32, trainer_config=dataclasses.replace(tc, micro_batches=1))
    np.testing.assert_allclose(float(loss) - float(grpo_loss), 0.7 * float(metrics["value_loss"]), rtol=1e-4)


def test_padding_changes_nothing_with_value_loss():
    cfg, tc = SMALL1, ppo_config(LossAgg.SEQ_MEAN_TOKEN_MEAN)
    rng = np.random.default_rng(20)
    pv = pv_params(cfg)
    batch = ppo_batch(rng, cfg, B_ACC, T_ACC)

    def grow(x, fill):
        x = np.asarray(x)
        out = np.concatenate([x, fill((x.shape[0], 3))], 1)
        return np.concatenate([out, fill((M_ACC, out.shape[1]))], 0)

    def junk(shape):
        return np.where(rng.random(shape) < 0.5, np.nan, 1e4 * rng.normal(size=shape))

    floats = {f: jnp.asarray(grow(getattr(batch, f), junk), jnp.float32)
              for f in ("advantages", "old_logprobs", "rollout_logprobs", "values", "returns")}
    padded = TrainBatch(tokens=jnp.asarray(grow(batch.tokens, lambda s: rng.integers(0, cfg.vocab_size, s)), jnp.int32),
                        loss_mask=jnp.asarray(grow(batch.loss_mask, lambda s: np.zeros(s, np.int32))), **floats)
    g0, m0 = jit_grads(pv, batch, model_config=cfg, policy=F32, trainer_config=tc)
    g1, m1 = jit_grads(pv, padded, model_config=cfg, policy=F32, trainer_config=tc)
    assert np.isfinite(flat(g1)).all()
    assert rel_err(flat(g1), flat(g0)) < 1e-5
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_value_loss_errors_are_clear():
    cfg = SMALL1
    batch = ppo_batch(np.random.default_rng(21), cfg, 4, 8)
    tc = dataclasses.replace(ppo_config(LossAgg.TOKEN_MEAN), micro_batches=1)
    kw = {"model_config": cfg, "policy": F32, "trainer_config": tc}
    with pytest.raises(ValueError, match="needs params with a value head"):
        compute_grads(params_for(cfg), batch, **kw)
    with pytest.raises(ValueError, match="value_clip = 0.3 needs TrainBatch.values"):
        compute_grads(pv_params(cfg), dataclasses.replace(batch, values=None), **kw)
    with pytest.raises(ValueError, match=r"TrainBatch.returns has shape \(4, 7\)"):
        compute_grads(pv_params(cfg), dataclasses.replace(batch, returns=batch.returns[:, 1:]), **kw)
    with pytest.raises(ValueError, match="vf_coef must be >= 0"):
        LossConfig(vf_coef=-1.0)
    with pytest.raises(ValueError, match="value_clip must be > 0 or None"):
        LossConfig(value_clip=0.0)
    with pytest.raises(TypeError, match="already carry a value head"):
        with_value_head(pv_params(cfg), cfg)


def test_gae_train_step_fits_the_value_on_a_fixed_batch():
    """A jitted, donated train step with GAE on the loop's stages: build_batch's token rewards,
    with_trainer_logprobs' V_old / advantages / returns, then repeated updates on the fixed batch
    lower the value loss and raise the explained variance; the first update is on-policy
    (ratio 1, V = V_old, nothing clipped)."""
    cfg = SMALL1
    rng = np.random.default_rng(30)
    tc = TrainerConfig(loss=LossConfig(correction=Correction.NONE, entropy_metric=False, vf_coef=1.0, value_clip=None),
                       micro_batches=2, compute_dtype=ComputeDtype.FLOAT32,
                       optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0))
    opt = make_optimizer(tc.optimizer)
    state = init_train_state(with_value_head(params_for(cfg), cfg), opt, jax.random.key(1))
    assert not flat(state.params.value_head).any()  # zero-initialized head: V = 0 at first
    B, T = 8, 12
    base = ppo_batch(rng, cfg, B, T, nan_padding=False)
    mask = np.asarray(base.loss_mask, np.float32)
    rewards = (rng.random(B) < 0.5).astype(np.float32) + np.arange(B) / B
    batch = TrainBatch(tokens=base.tokens, loss_mask=base.loss_mask, advantages=jnp.zeros((B, T)),
                       old_logprobs=jnp.zeros((B, T)), rollout_logprobs=jnp.zeros((B, T)),
                       token_rewards=outcome_to_token_rewards(rewards, mask))
    value_fn = compile_fast(make_logprob_value_fn(cfg, F32, tc))
    batch = with_trainer_logprobs(batch, value_fn, state.params, gamma=1.0, lam=0.95, whiten_advantages=True)
    batch = batch.replace(rollout_logprobs=batch.old_logprobs)
    m = mask > 0
    assert not np.asarray(batch.values).any()  # V_old of a zero head
    adv = np.asarray(batch.advantages)
    np.testing.assert_allclose([adv[m].mean(), adv[m].std(ddof=1)], [0.0, 1.0], atol=1e-5)  # whitened
    want_adv, want_ret = gae_advantages(batch.token_rewards, batch.values, mask, gamma=1.0, lam=0.95)
    np.testing.assert_allclose(np.asarray(batch.returns), np.asarray(want_ret), rtol=1e-6)
    np.testing.assert_allclose(adv, np.asarray(masked_whiten(want_adv, mask)), rtol=1e-5, atol=1e-6)
    # V_old = 0: R_t = A_t = (gamma lam)^(last - t) r, the outcome reward on the row's last response token.
    last = T - 1 - np.argmax(m[:, ::-1], axis=1)
    want = 0.95 ** (last[:, None] - np.arange(T)[None, :]) * rewards[:, None]
    np.testing.assert_allclose(np.asarray(batch.returns)[m], want[m], rtol=1e-5)
    step = compile_fast(make_train_step(cfg, F32, tc, opt))
    history = []
    for _ in range(25):
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    first, final = history[0], history[-1]
    assert abs(first["ratio_mean"] - 1.0) < 1e-6 and first["value_clip_frac"] == 0.0 and first["value_mean"] == 0.0
    np.testing.assert_allclose(first["value_loss"], 0.5 * np.mean(want[m] ** 2), rtol=1e-5)  # V = 0: mean R^2 / 2
    assert final["value_loss"] < 0.3 * first["value_loss"], (first["value_loss"], final["value_loss"])
    assert final["value_explained_var"] > first["value_explained_var"] + 0.3
    assert isinstance(state.params, PolicyValueParams) and flat(state.params.value_head).any()


# --------------------------------------------------------------------------- config and the loop


def test_config_accepts_gae_with_its_fields():
    from configs.rl import QUICKSTART

    cfg = rlconfig.override(QUICKSTART, [
        "algorithm.estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95", "algorithm.whiten_advantages=false",
        "algorithm.loss.vf_coef=0.25", "algorithm.loss.value_clip=none"])
    a = cfg.algorithm
    assert a.estimator is AdvantageEstimator.GAE and a.uses_value_head and (a.gamma, a.lam) == (0.99, 0.95)
    assert a.whiten_advantages is False and a.loss.vf_coef == 0.25 and a.loss.value_clip is None
    assert cfg.trainer_config().loss.vf_coef == 0.25
    assert not rlconfig.AlgorithmConfig().uses_value_head
    for bad, match in [("algorithm.gamma=1.5", "algorithm.gamma must be in"),
                       ("algorithm.loss.vf_coef=0", "vf_coef, which must be > 0")]:
        with pytest.raises(rlconfig.ConfigError, match=match):
            rlconfig.override(cfg, [bad])


def test_run_two_gae_steps_end_to_end(tmp_path):
    """``run`` for 2 steps with estimator GAE on a tiny model (CPU): the value head rides in the
    train state, the engine only ever receives model params, the value metrics are logged."""
    mcfg = dataclasses.replace(SMALL1, vocab_size=32, eos_token_ids=(1,), max_position_embeddings=64)
    cfg = rlconfig.RLConfig(
        model=mcfg,
        rollout=rlconfig.RolloutConfig(n_samples=4, max_new_tokens=5,
                                       engine=EngineConfig(max_seq_len=32, max_slots=8, page_size=4, steps_per_call=4,
                                                           prefill_batch=8)),
        algorithm=rlconfig.AlgorithmConfig(estimator=AdvantageEstimator.GAE, lam=0.95,
                                           loss=LossConfig(correction=Correction.TOKEN_TIS, entropy_metric=False)),
        optimizer=OptimizerConfig(lr=1e-3),
        trainer=rlconfig.TrainConfig(micro_batches=2, compute_dtype=ComputeDtype.FLOAT32),
        precision=rlconfig.PrecisionConfig(rollout=Fp8Mode.NONE),
        data=rlconfig.DataConfig(prompts_per_step=2, steps=2, eval_every=0),
        logging=rlconfig.LoggingConfig(out_dir=str(tmp_path), tensorboard=False, plot=False, progress=False))
    params = params_for(mcfg)
    engine = JaxEngine(mcfg, params, EngineConfig(max_slots=8, page_size=4, num_pages=64, max_seq_len=32,
                                                  steps_per_call=4, prefill_batch=8, precision=Fp8Mode.NONE,
                                                  dtype="float32"))
    received = []
    update = engine.update_weights
    engine.update_weights = lambda p: (received.append(jax.tree.structure(p)), update(p))[1]
    rng = np.random.default_rng(0)
    task = Task(next_batch=lambda n: [Example(prompt="ab"[: 1 + int(rng.integers(2))], answer="") for _ in range(n)],
                encode=lambda s: [3 + (ord(c) % 20) for c in s], decode=lambda ids: "x" * len(ids),
                reward_fn=lambda text, ans: float(len(text) % 2 == 0))
    tc, policy = cfg.trainer_config(), cfg.train_policy()
    opt = make_optimizer(cfg.optimizer)
    state = init_train_state(with_value_head(params, mcfg), opt, jax.random.key(1))
    with pytest.raises(ValueError, match="trains a value head"):
        run(cfg, state=init_train_state(params, opt, jax.random.key(1)), task=task, engine=engine,
            train_step=make_train_step(mcfg, policy, tc, opt), logprob_fn=make_logprob_fn(mcfg, policy, tc),
            model_config=mcfg, logger=None)
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        state = run(cfg, state=state, task=task, engine=engine, train_step=make_train_step(mcfg, policy, tc, opt),
                    logprob_fn=make_logprob_value_fn(mcfg, policy, tc), model_config=mcfg, logger=logger)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("train/value_loss", "train/value_clip_frac", "train/value_explained_var", "train/value_mean",
                  "train/return_mean", "train/loss", "reward/mean"):
            assert r[k] is not None and np.isfinite(r[k]), k
        assert r["train/value_clip_frac"] == 0.0  # each step's first (only) update is on-policy
    assert received == [jax.tree.structure(params)] * 2  # the generator never sees the head
    assert int(state.step) == 2 and isinstance(state.params, PolicyValueParams)
    assert flat(state.params.value_head).any()  # the head trained
    # The GRPO batch of the same stage carries no value fields.
    ro = rollout(engine, [[3, 4]], n_samples=2, sampling=cfg.rollout.sampling, step=0)
    grpo = build_batch(ro, np.array([1.0, 0.0], np.float32), pad_multiple=8)
    assert grpo.values is None and grpo.returns is None and grpo.token_rewards is None
    gae = build_batch(ro, np.array([1.0, 0.0], np.float32), estimator=AdvantageEstimator.GAE, pad_multiple=8)
    tr = np.asarray(gae.token_rewards)
    assert tr.sum() == 1.0 and not np.asarray(gae.advantages).any()
    last = 2 + int(ro.batch.lengths[0]) - 1  # the last response token of sample 0
    assert tr[0, last] == 1.0 and np.asarray(gae.loss_mask)[0, last] == 1
    with pytest.raises(ValueError, match="needs V_old"):
        with_trainer_logprobs(gae, make_logprob_fn(mcfg, policy, tc), model_params(state.params))
