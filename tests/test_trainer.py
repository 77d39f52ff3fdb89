"""fp8rl_jax.rl.trainer and rl.checkpointing on tiny Qwen3 models (CPU).

References are independent of the code under test: the schedule and AdamW are recomputed in
float64 NumPy from their formulas; token logprobs from float64 log-softmax of the model's logits;
accumulated gradients against one un-accumulated whole-batch ``jax.grad``; padding against the
unpadded batch; resume against an uninterrupted run. Inputs are fresh random draws: ragged
prompts and responses, an empty row, NaN garbage on padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3
from fp8rl_jax.models import DensePolicy, forward, init_params
from fp8rl_jax.rl import Correction, LossAgg
from fp8rl_jax.rl.checkpointing import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    latest_step,
)
from fp8rl_jax.rl.trainer import (
    ComputeDtype,
    LossConfig,
    OptimizerConfig,
    Schedule,
    TrainBatch,
    TrainerConfig,
    compute_grads,
    head_logprobs,
    init_train_state,
    loss_fn,
    lr_schedule,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    token_logprobs,
    trainer_logprobs,
)

# Smaller than the tiny preset (XLA compile time, not the run, dominates these tests on the CPU).
SMALL = dataclasses.replace(tiny_qwen3, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=2, num_kv_heads=1, head_dim=16)
SMALL1 = dataclasses.replace(SMALL, num_layers=1)
F32 = DensePolicy("float32")
BF16 = DensePolicy("bfloat16")
# XLA's CPU compile, not the run, dominates these tests; without LLVM's backend optimizations it
# takes half the time and computes the same operations.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class fast_jit:
    """``jax.jit(fn)`` compiled once per (static keywords, argument shapes) with FAST_COMPILE."""

    def __init__(self, fn, static=("model_config", "policy", "trainer_config"), **jit_kw):
        self.jitted = jax.jit(fn, static_argnames=static, **jit_kw) if static else jax.jit(fn, **jit_kw)
        self.static = static
        self.cache = {}

    def __call__(self, *args, **kw):
        static = {k: kw.pop(k) for k in self.static if k in kw}
        leaves, tree = jax.tree.flatten((args, kw))
        key = (tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves), tuple(sorted(static.items())))
        if key not in self.cache:
            self.cache[key] = self.jitted.lower(*args, **kw, **static).compile(FAST_COMPILE)
        return self.cache[key](*args, **kw)


def compile_fast(jitted):
    """A ``jax.jit`` object (donation included) compiled at its first call with FAST_COMPILE."""
    compiled = {}

    def call(*args):
        if "fn" not in compiled:
            compiled["fn"] = jitted.lower(*args).compile(FAST_COMPILE)
        return compiled["fn"](*args)

    return call


jit_grads = fast_jit(compute_grads)
jit_value_and_grad = fast_jit(jax.value_and_grad(loss_fn, has_aux=True))


# --------------------------------------------------------------------------- helpers


def make_batch(rng, cfg, B, T, *, with_ref=True) -> TrainBatch:
    """Random ragged batch: prompt of 1..T/2 tokens, response after it (row 1 has none), NaN on padding.
    Logprob fields sit near the uniform model's ``-log V`` with spread, so ratios clip and the
    rollout correction both caps and rejects."""
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    prompt = rng.integers(1, T // 2 + 1, B)
    resp = rng.integers(1, T - prompt + 1)
    resp[1] = 0
    t = np.arange(T)[None, :]
    mask = ((t >= prompt[:, None]) & (t < (prompt + resp)[:, None])).astype(np.int32)
    base = -math.log(cfg.vocab_size)
    old = base + rng.normal(0, 0.3, (B, T))
    roll = old + rng.normal(0, 0.2, (B, T)) - 1.0 * (rng.random((B, T)) < 0.15)  # some tokens over the TIS cap
    ref = old + rng.normal(0, 0.2, (B, T))
    adv = rng.normal(0, 1, (B, T))

    def f(x):
        return jnp.asarray(np.where(mask > 0, x, np.nan), jnp.float32)

    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=f(adv),
                      old_logprobs=f(old), rollout_logprobs=f(roll), ref_logprobs=f(ref) if with_ref else None)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def rel_err(x, ref) -> float:
    x, ref = flat(x), flat(ref)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def assert_trees_close(x, ref, rel, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(x), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(np.abs(b).max(), 1e-30)
        assert np.abs(a - b).max() <= rel * scale, f"{what} {jax.tree_util.keystr(path)}: max diff " \
                                                   f"{np.abs(a - b).max():.3g} vs scale {scale:.3g}"


@functools.cache
def params_for(cfg, seed=0):
    return init_params(cfg, jax.random.key(seed), jnp.float32)


def loss_config(agg, **kw):
    return LossConfig(agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01,
                      correction=(Correction.TOKEN_TIS, Correction.SEQ_MASK_GEO), geo_low=0.8, geo_high=1.25, **kw)


# --------------------------------------------------------------------------- optimizer


def np_lr(k, lr, W, schedule, total, min_ratio):
    if k < W:
        return lr * (k + 1) / W
    if schedule is Schedule.CONSTANT:
        return lr
    p = min(max((k - W) / (total - W), 0.0), 1.0)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


@pytest.mark.parametrize("schedule,W,total,min_ratio", [(Schedule.CONSTANT, 0, None, 0.0),
                                                        (Schedule.CONSTANT, 5, None, 0.0),
                                                        (Schedule.COSINE, 0, 10, 0.0),
                                                        (Schedule.COSINE, 4, 20, 0.1)])
def test_lr_schedule_matches_closed_form(schedule, W, total, min_ratio):
    lr = float(np.random.default_rng(W).uniform(1e-6, 1e-3))
    cfg = OptimizerConfig(lr=lr, warmup_steps=W, schedule=schedule, total_steps=total, min_lr_ratio=min_ratio)
    steps = np.arange(0, (total or 12) + 5)
    got = np.asarray(jax.jit(jax.vmap(lr_schedule(cfg)))(steps))
    want = np.array([np_lr(int(k), lr, W, schedule, total, min_ratio) for k in steps])
    np.testing.assert_allclose(got, want, rtol=2e-6)
    # Anchors: the last warmup update runs at the peak, cosine is halfway at its midpoint, then floors.
    if W:
        np.testing.assert_allclose(got[W - 1], lr, rtol=1e-6)
        np.testing.assert_allclose(got[0], lr / W, rtol=1e-6)
    if schedule is Schedule.COSINE:
        mid = W + (total - W) // 2
        if (total - W) % 2 == 0:
            np.testing.assert_allclose(got[mid], lr * (min_ratio + (1 - min_ratio) / 2), rtol=1e-6)
        np.testing.assert_allclose(got[total:], lr * min_ratio, atol=1e-12)


def np_adamw(params, grads_seq, cfg: OptimizerConfig):
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for k, g in enumerate(grads_seq):
        g = {n: x.astype(np.float64) for n, x in g.items()}
        if cfg.max_grad_norm is not None:
            norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
            g = {n: x * min(1.0, cfg.max_grad_norm / norm) for n, x in g.items()}
        lr = np_lr(k, cfg.lr, cfg.warmup_steps, cfg.schedule, cfg.total_steps, cfg.min_lr_ratio)
        for n, x in p.items():
            m[n] = cfg.b1 * m[n] + (1 - cfg.b1) * g[n]
            v2[n] = cfg.b2 * v2[n] + (1 - cfg.b2) * g[n] ** 2
            mhat, vhat = m[n] / (1 - cfg.b1 ** (k + 1)), v2[n] / (1 - cfg.b2 ** (k + 1))
            wd = cfg.weight_decay if x.ndim >= 2 else 0.0
            p[n] = x - lr * (mhat / (np.sqrt(vhat) + cfg.eps) + wd * x)
    return p


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_adamw_with_clipping_matches_numpy(max_grad_norm):
    rng = np.random.default_rng(7)
    cfg = OptimizerConfig(lr=0.05, warmup_steps=2, schedule=Schedule.COSINE, total_steps=6, min_lr_ratio=0.2,
                          b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3, max_grad_norm=max_grad_norm)
    params = {"w": rng.normal(0, 1, (3, 4)).astype(np.float32), "g": rng.normal(1, 0.1, (4,)).astype(np.float32)}
    # Scales 0.1 .. 10 relative to the clip: clipping binds on some steps and reweights Adam's moments.
    grads_seq = [{n: (s * rng.normal(0, 1, x.shape)).astype(np.float32) for n, x in params.items()}
                 for s in (2.0, 0.05, 10.0, 0.3, 1.0)]
    opt = make_optimizer(cfg)
    p = jax.tree.map(jnp.asarray, params)
    state = opt.init(p)
    update = jax.jit(opt.update)
    for g in grads_seq:
        u, state = update(jax.tree.map(jnp.asarray, g), state, p)
        p = jax.tree.map(lambda a, b: a + b, p, u)
    want = np_adamw(params, grads_seq, cfg)
    for n in params:
        np.testing.assert_allclose(np.asarray(p[n]), want[n], rtol=2e-5, atol=2e-6, err_msg=n)
    if max_grad_norm is not None:  # the clip must matter here, or this test checks nothing about it
        unclipped = np_adamw(params, grads_seq, dataclasses.replace(cfg, max_grad_norm=None))
        assert max(np.abs(unclipped[n] - want[n]).max() for n in params) > 1e-3


# --------------------------------------------------------------------------- logprobs


def test_token_logprobs_match_float64_log_softmax():
    rng = np.random.default_rng(0)
    params = params_for(SMALL1)
    tokens = jnp.asarray(rng.integers(0, SMALL1.vocab_size, (3, 9)), jnp.int32)

    def both(p, t):
        return token_logprobs(p, t, config=SMALL1, policy=F32, with_entropy=True), forward(p, t, config=SMALL1,
                                                                                           policy=F32)[0]

    (logp, ent), logits = fast_jit(both, static=())(params, tokens)
    logits = np.asarray(logits, np.float64)
    z = logits - logits.max(-1, keepdims=True)
    ls = z - np.log(np.exp(z).sum(-1, keepdims=True))  # ls[b, t] predicts token t + 1
    want = np.zeros(tokens.shape)
    want_ent = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            want[b, t] = ls[b, t - 1, int(tokens[b, t])]
            want_ent[b, t] = -np.sum(np.exp(ls[b, t - 1]) * ls[b, t - 1])
    np.testing.assert_allclose(np.asarray(logp), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- gradient accumulation


# The gradient tests share compiled functions (XLA compile time dominates on the CPU): batch
# [B, T] = [8, 12], M = 4 micro-batches; the TOKEN_MEAN case runs the 2-layer model with remat on.
B_ACC, T_ACC, M_ACC = 8, 12, 4
ACC_MODEL = {LossAgg.TOKEN_MEAN: SMALL, LossAgg.SEQ_MEAN_TOKEN_SUM: SMALL1, LossAgg.SEQ_MEAN_TOKEN_MEAN: SMALL1}


def acc_config(agg: LossAgg) -> TrainerConfig:
    return TrainerConfig(loss=loss_config(agg), micro_batches=M_ACC, compute_dtype=ComputeDtype.FLOAT32,
                         remat=agg is LossAgg.TOKEN_MEAN)


@pytest.mark.parametrize("agg", list(LossAgg))
def test_accumulation_equals_whole_batch(agg):
    """Accumulated gradients (and every metric) == one whole-batch jax.grad without micro-batches
    (and without remat)."""
    cfg = ACC_MODEL[agg]
    rng = np.random.default_rng(10 + list(LossAgg).index(agg))
    params = params_for(cfg)
    batch = make_batch(rng, cfg, B_ACC, T_ACC)
    # Unequal real-token counts per micro-batch (and the empty row 1): averaging micro-batch
    # means instead of dividing by the global count would change the result.
    counts = np.asarray(batch.loss_mask)[:, 1:].reshape(M_ACC, -1).sum(1)
    assert len(set(counts.tolist())) > 1
    tc = acc_config(agg)
    (loss, ref_metrics), ref_grads = jit_value_and_grad(params, batch, model_config=cfg, policy=F32,
                                                        trainer_config=dataclasses.replace(tc, micro_batches=1,
                                                                                           remat=False))
    grads, metrics = jit_grads(params, batch, model_config=cfg, policy=F32, trainer_config=tc)
    assert rel_err(grads, ref_grads) < 1e-5
    assert_trees_close(grads, ref_grads, 1e-4, "grad")
    assert set(metrics) == set(ref_metrics)
    for k in ref_metrics:
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    # The batch exercises clipping, the TIS cap and sequence rejection.
    for k in ("clip_frac", "correction/truncated_frac", "correction/masked_frac"):
        assert 0 < float(metrics[k]) < 1, k


def pad_batch(rng, batch: TrainBatch, cfg, extra_rows: int, extra_cols: int) -> TrainBatch:
    """Appends fully masked rows and columns holding random tokens and NaN/huge garbage."""
    def grow(x, fill):
        B, T = x.shape
        out = np.concatenate([np.asarray(x), fill((B, extra_cols))], axis=1)
        return np.concatenate([out, fill((extra_rows, T + extra_cols))], axis=0)

    toks = functools.partial(rng.integers, 0, cfg.vocab_size)

    def junk(shape):
        return np.where(rng.random(shape) < 0.5, np.nan, 1e4 * rng.normal(size=shape))

    floats = [f.name for f in dataclasses.fields(batch) if f.name not in ("tokens", "loss_mask")]
    kw = {name: jnp.asarray(grow(getattr(batch, name), junk), jnp.float32) for name in floats
          if getattr(batch, name) is not None}
    return TrainBatch(tokens=jnp.asarray(grow(batch.tokens, toks), jnp.int32),
                      loss_mask=jnp.asarray(grow(batch.loss_mask, lambda s: np.zeros(s, np.int32))), **kw)


def test_padding_changes_nothing():
    """Fully masked rows and columns (random tokens, NaN/huge garbage elsewhere) change neither
    gradients nor metrics."""
    agg = LossAgg.SEQ_MEAN_TOKEN_MEAN  # counts sequences: an empty row must not count
    cfg, tc = ACC_MODEL[agg], acc_config(agg)
    rng = np.random.default_rng(20)
    params = params_for(cfg)
    batch = make_batch(rng, cfg, B_ACC, T_ACC)
    padded = pad_batch(rng, batch, cfg, extra_rows=M_ACC, extra_cols=3)
    g0, m0 = jit_grads(params, batch, model_config=cfg, policy=F32, trainer_config=tc)
    g1, m1 = jit_grads(params, padded, model_config=cfg, policy=F32, trainer_config=tc)
    assert np.isfinite(flat(g1)).all()
    assert rel_err(g1, g0) < 1e-5
    assert_trees_close(g1, g0, 1e-4, "grad")
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_bf16_compute_grads_close_to_f32():
    cfg, tc = ACC_MODEL[LossAgg.TOKEN_MEAN], acc_config(LossAgg.TOKEN_MEAN)
    rng = np.random.default_rng(30)
    params = params_for(cfg)
    batch = make_batch(rng, cfg, B_ACC, T_ACC)
    g32, _ = jit_grads(params, batch, model_config=cfg, policy=F32, trainer_config=tc)
    tc16 = dataclasses.replace(tc, compute_dtype=ComputeDtype.BFLOAT16)
    g16, _ = jit_grads(params, batch, model_config=cfg, policy=BF16, trainer_config=tc16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))  # f32 master grads
    err = rel_err(g16, g32)
    assert 1e-5 < err < 5e-2, err  # bf16 rounding is visible but small


# --------------------------------------------------------------------------- training loop


@pytest.fixture(scope="module")
def loop():
    """SMALL1, a BF16 train step (2 micro-batches, jitted, donated) and 3 fixed batches
    whose old logprobs are the trainer's own (on-policy) and whose rollout logprobs are perturbed."""
    cfg = SMALL1
    tc = TrainerConfig(loss=LossConfig(clip_high=0.28, correction=Correction.TOKEN_TIS, entropy_metric=False),
                       micro_batches=2,
                       optimizer=OptimizerConfig(lr=2e-3, warmup_steps=2, schedule=Schedule.COSINE, total_steps=8))
    params = params_for(cfg)
    opt = make_optimizer(tc.optimizer)
    logprob_fn = compile_fast(make_logprob_fn(cfg, BF16, tc))
    rng = np.random.default_rng(40)
    batches = []
    for _ in range(3):
        b = make_batch(rng, cfg, 4, 16, with_ref=False)
        mask = np.asarray(b.loss_mask)
        adv = np.where(mask > 0, np.where(rng.random(mask.shape) < 0.5, 1.0, -1.0), 0.0)
        old = logprob_fn(params, b.tokens)
        roll = np.asarray(old) + rng.normal(0, 0.05, mask.shape) - 1.0 * (rng.random(mask.shape) < 0.1)
        batches.append(dataclasses.replace(b, advantages=jnp.asarray(adv, jnp.float32), old_logprobs=old,
                                           rollout_logprobs=jnp.asarray(roll, jnp.float32)))

    def fresh():
        return init_train_state(params, opt, jax.random.key(3))

    return {"cfg": cfg, "tc": tc, "opt": opt, "step": compile_fast(make_train_step(cfg, BF16, tc, opt)),
            "batches": batches, "fresh": fresh, "logprob_fn": logprob_fn}


def test_training_raises_positive_advantage_logprobs(loop):
    batch = loop["batches"][0]
    state = loop["fresh"]()
    mask = np.asarray(batch.loss_mask) > 0
    mask[:, 0] = False
    adv = np.asarray(batch.advantages)
    old = np.asarray(batch.old_logprobs, np.float64)
    roll = np.asarray(batch.rollout_logprobs, np.float64)
    history = []
    for k in range(6):
        state, metrics = loop["step"](state, batch)
        history.append({n: float(v) for n, v in metrics.items()})
    first = history[0]
    # On-policy first update: ratio exactly 1, nothing clipped; lr follows the warmup.
    assert abs(first["ratio_mean"] - 1.0) < 1e-6 and first["clip_frac"] == 0.0
    np.testing.assert_allclose([h["lr"] for h in history], [np_lr(k, 2e-3, 2, Schedule.COSINE, 8, 0.0)
                                                            for k in range(6)], rtol=1e-6)
    # Mismatch and correction metrics against float64 NumPy on the trained tokens.
    d = (old - roll)[mask]
    np.testing.assert_allclose(first["mismatch/kl_k1"], np.mean(-d), rtol=1e-4)
    np.testing.assert_allclose(first["mismatch/log_ratio_max"], d.max(), rtol=1e-5)
    np.testing.assert_allclose(first["correction/truncated_frac"], np.mean(d > math.log(2.0)), atol=1e-7)
    assert first["correction/truncated_frac"] > 0
    assert first["correction/masked_frac"] == 0.0  # TIS truncates, never masks
    assert first["tokens"] == mask.sum()
    assert "entropy" not in first and "kl_loss" not in first  # switched off / no reference logprobs
    assert history[-1]["loss"] < first["loss"]
    new = np.asarray(loop["logprob_fn"](state.params, batch.tokens), np.float64)
    up, down = mask & (adv > 0), mask & (adv < 0)
    assert np.mean((new - old)[up]) > 0.05 and np.mean((new - old)[down]) < -0.05
    assert int(state.step) == 6


def test_donation_consumes_state_and_keeps_batch(loop):
    state = loop["fresh"]()
    batch = loop["batches"][1]
    leaf = jax.tree.leaves(state.params)[0]
    new, _ = loop["step"](state, batch)
    assert leaf.is_deleted()  # the old state was donated
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))
    again, m = loop["step"](new, batch)  # the returned state and the same batch are reusable
    assert np.isfinite(float(m["loss"])) and int(again.step) == 2
    assert not any(x.is_deleted() for x in jax.tree.leaves(params_for(loop["cfg"])))  # init copied


def test_exact_resume_from_checkpoint(loop, tmp_path):
    step, batches = loop["step"], loop["batches"]

    def run(state, cursor, n):
        metrics = []
        for _ in range(n):
            state, m = step(state, batches[cursor["index"] % len(batches)])
            cursor = {**cursor, "index": cursor["index"] + 1}
            metrics.append(jax.device_get(m))
        return state, cursor, metrics

    full, full_cursor, full_metrics = run(loop["fresh"](), {"index": 0, "epoch": 0, "note": "run-a"}, 4)
    half, cursor, first_metrics = run(loop["fresh"](), {"index": 0, "epoch": 0, "note": "run-a"}, 2)
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(max_to_keep=2)) as ckpt:
        assert ckpt.save(half, cursor) == 2
    del half
    target = jax.eval_shape(loop["fresh"])  # a fresh, abstract state: structure, shapes and dtypes only
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() == 2
        restored, got_cursor = ckpt.restore(target)
    assert got_cursor == cursor
    resumed, end_cursor, rest_metrics = run(restored, got_cursor, 2)
    assert end_cursor == full_cursor
    assert jax.tree.structure(resumed) == jax.tree.structure(full)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(full)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    for got, want in zip(first_metrics + rest_metrics, full_metrics):
        assert got.keys() == want.keys()
        for k in want:
            assert np.array_equal(got[k], want[k], equal_nan=True), k


def test_async_save_survives_deleting_the_state(loop, tmp_path):
    """An asynchronous save has its own host copy when ``save`` returns: deleting the device
    arrays right after (what donating the state to the next step does) loses nothing."""
    state = loop["fresh"]()
    want = jax.device_get(state)
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(async_save=True)) as ckpt:
        ckpt.save(state, {"index": 5}, step=5)
        for x in jax.tree.leaves(state):
            x.delete()
        ckpt.wait()
        got, cursor = ckpt.restore(jax.eval_shape(loop["fresh"]))
    assert cursor == {"index": 5}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(a), b)


def test_checkpoint_keep_last_n_and_errors(loop, tmp_path):
    state = jax.device_get(loop["fresh"]())
    root = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError, match="no checkpoint in"), Checkpointer(root) as ckpt:
        ckpt.restore(state)
    with Checkpointer(root, CheckpointConfig(max_to_keep=2)) as ckpt:
        for s in (1, 2, 3, 4):
            ckpt.save(state, {"index": s}, step=s)
        assert ckpt.all_steps() == [3, 4]
        assert sorted(p.name for p in root.iterdir() if p.name.isdigit()) == ["3", "4"]
        with pytest.raises(FileExistsError, match="step 4 already exists"):
            ckpt.save(state, step=4)
        with pytest.raises(TypeError, match="JSON-serializable"):
            ckpt.save(state, {"bad": object()}, step=5)
    # An unfinished save (Orbax's temporary folder) is never a checkpoint.
    (root / "9.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
    assert latest_step(root) == 4 and latest_step(tmp_path / "nowhere") is None
    with Checkpointer(root) as ckpt:
        with pytest.raises(FileNotFoundError, match=r"step 7 .*available steps: \[3, 4\]"):
            ckpt.restore(state, step=7)
        shutil.rmtree(root / "4" / "state")  # a step folder missing its state
        with pytest.raises(CheckpointError, match="/4 could not be restored"):
            ckpt.restore(state)
        for f in (root / "3" / "state").rglob("*"):  # garbage in every data file
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(b"garbage")
        with pytest.raises(CheckpointError, match="/3 could not be restored"):
            ckpt.restore(state, step=3)


# --------------------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(50)
    params = params_for(SMALL1)
    batch = make_batch(rng, SMALL1, 4, 8)
    tc = TrainerConfig(loss=loss_config(LossAgg.TOKEN_MEAN), compute_dtype=ComputeDtype.FLOAT32)
    kw = {"model_config": SMALL1, "policy": F32}
    bad = dataclasses.replace(batch, advantages=batch.advantages[:, :-1])
    with pytest.raises(ValueError, match=r"TrainBatch.advantages has shape \(4, 7\), expected \[B, T\] = \(4, 8\)"):
        compute_grads(params, bad, trainer_config=tc, **kw)
    with pytest.raises(ValueError, match="micro_batches = 3 does not divide the batch size B = 4"):
        compute_grads(params, batch, trainer_config=dataclasses.replace(tc, micro_batches=3), **kw)
    with pytest.raises(ValueError, match="tokens must be an integer"):
        compute_grads(params, dataclasses.replace(batch, tokens=batch.tokens.astype(jnp.float32)), trainer_config=tc,
                      **kw)
    with pytest.raises(ValueError, match="needs TrainBatch.ref_logprobs"):
        compute_grads(params, dataclasses.replace(batch, ref_logprobs=None), trainer_config=tc, **kw)
    with pytest.raises(ValueError, match="policy compute dtype bfloat16 differs"):
        compute_grads(params, batch, model_config=SMALL1, policy=BF16, trainer_config=tc)
    with pytest.raises(ValueError, match="float32 master weights"):
        compute_grads(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), batch, trainer_config=tc, **kw)
    with pytest.raises(ValueError, match="Schedule.COSINE needs total_steps"):
        OptimizerConfig(schedule=Schedule.COSINE, warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        LossConfig(dual_clip=1.0)
    with pytest.raises(TypeError, match="agg must be a LossAgg"):
        LossConfig(agg="token_mean")
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        TrainerConfig(micro_batches=0)


# --------------------------------------------------------------------------- chunked vocabulary projection


def test_chunked_head_matches_unchunked_loss_grads_and_logprobs():
    """``logits_chunk`` (LM head + log-softmax a few positions at a time, rematerialized) changes
    neither the loss, its metrics, its gradients nor the trainer logprobs, with a chunk size (5) that does
    not divide T - 1 = 22 (a partial last chunk). float32, so only summation order may differ. One decoder
    layer: the chunking is in the LM head, after the last layer."""
    rng = np.random.default_rng(21)
    params = init_params(SMALL1, jax.random.key(3), jnp.float32)
    batch = make_batch(rng, SMALL1, 4, 23)
    tc = TrainerConfig(loss=LossConfig(entropy_coef=0.01, kl_coef=0.1), compute_dtype=ComputeDtype.FLOAT32,
                       logits_chunk=None)
    (l0, m0), g0 = jit_value_and_grad(params, batch, model_config=SMALL1, policy=F32, trainer_config=tc)
    lp0 = np.asarray(trainer_logprobs(params, batch.tokens, model_config=SMALL1, policy=F32, trainer_config=tc))
    for chunk in (5,):  # each chunk size is a compile of seconds; 8 (also not dividing 22) ran the same code
        tcc = dataclasses.replace(tc, logits_chunk=chunk)
        (l1, m1), g1 = jit_value_and_grad(params, batch, model_config=SMALL1, policy=F32, trainer_config=tcc)
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-7)
        for k in ("entropy", "kl", "pg_loss"):
            np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(flat(g1), flat(g0), rtol=1e-4, atol=1e-7)
        lp1 = trainer_logprobs(params, batch.tokens, model_config=SMALL1, policy=F32, trainer_config=tcc)
        np.testing.assert_allclose(np.asarray(lp1), lp0, rtol=1e-5, atol=1e-6)


def test_head_logprobs_against_float64_and_memory():
    """``head_logprobs`` against float64 numpy on random hidden states, and the point of chunking:
    the compiled gradient holds far less temporary memory than the one-shot [B, S, V] version."""
    rng = np.random.default_rng(5)
    B, S, D, V = 2, 300, 16, 4096
    h = rng.normal(size=(B, S, D)).astype(np.float32)
    w = (rng.normal(size=(V, D)) / 4).astype(np.float32)
    t = rng.integers(0, V, (B, S)).astype(np.int32)
    z = h.astype(np.float64) @ w.T.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ref_lp = np.take_along_axis(logp_all, t[..., None], -1)[..., 0]
    ref_ent = -(np.exp(logp_all) * logp_all).sum(-1)
    head = lambda x, w: jnp.einsum("...d,vd->...v", x, w, precision=jax.lax.Precision.HIGHEST)  # noqa: E731
    for chunk in (None, 64):
        lp, ent = head_logprobs(functools.partial(head, w=jnp.asarray(w)), jnp.asarray(h), jnp.asarray(t),
                                with_entropy=True, chunk=chunk)
        np.testing.assert_allclose(np.asarray(lp), ref_lp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ent), ref_ent, rtol=1e-5, atol=1e-5)

    def temp_bytes(chunk):
        loss = lambda x, w: jnp.sum(head_logprobs(lambda y: head(y, w), x, jnp.asarray(t), chunk=chunk)[0])  # noqa: E731
        c = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(jnp.asarray(h), jnp.asarray(w)).compile(FAST_COMPILE)
        return c.memory_analysis().temp_size_in_bytes

    full, chunked = temp_bytes(None), temp_bytes(64)
    assert full >= B * S * V * 4  # at least one float32 [B, S, V] tensor lives in the one-shot gradient
    assert chunked < full / 3, (chunked, full)
