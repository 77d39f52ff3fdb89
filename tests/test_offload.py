"""Optimizer offload (``fp8rl_jax.rl.offload``): the streamed update against the one-program train step, the
moments' memory kind, value heads, checkpoints, and the errors where offload does not apply."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.tree_utils import tree_get, tree_set

from configs.models import tiny_qwen3
from fp8rl_jax.models import DensePolicy, init_params
from fp8rl_jax.rl import offload
from fp8rl_jax.rl.checkpointing import Checkpointer
from fp8rl_jax.rl.trainer import (OptimizerConfig, Schedule, TrainBatch, TrainerConfig, init_train_state,
                                  make_optimizer, make_train_step, with_value_head)

CFG = dataclasses.replace(tiny_qwen3, num_layers=2)
POLICY = DensePolicy("bfloat16")


def _batch(rng: np.random.Generator, B: int = 4, T: int = 12) -> TrainBatch:
    tokens = rng.integers(2, CFG.vocab_size, (B, T)).astype(np.int32)
    mask = (np.arange(T)[None] >= int(rng.integers(2, 6))).repeat(B, 0).astype(np.float32)
    lp = -rng.exponential(1.0, (B, T)).astype(np.float32) * mask
    adv = rng.normal(size=(B, 1)).astype(np.float32) * mask
    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
                      old_logprobs=jnp.asarray(lp), rollout_logprobs=jnp.asarray(lp + 0.05 * rng.normal(size=(B, T))
                                                                                   .astype(np.float32) * mask))


def _config(offload_optimizer: bool, max_grad_norm: float | None = 0.05) -> TrainerConfig:
    # a clip far below the gradient norm (so the global factor matters), warmup + cosine (the shared count)
    opt = OptimizerConfig(lr=1e-3, warmup_steps=2, schedule=Schedule.COSINE, total_steps=10, weight_decay=0.1,
                          max_grad_norm=max_grad_norm)
    return TrainerConfig(micro_batches=2, optimizer=opt, offload_optimizer=offload_optimizer)


def _memory_kinds(state) -> set[str]:
    opt = state.opt_state
    return {x.sharding.memory_kind for k in ("mu", "nu") for x in jax.tree.leaves(tree_get(opt, k))}


def test_streamed_update_equals_the_train_step():
    """Two offloaded steps against two steps of ``make_train_step`` from the same state and batches (a value head,
    the clip active): params, moments, step, rng and every metric agree to float32 rounding; the moments stay in
    host memory."""
    rng = np.random.default_rng()
    params = init_params(CFG, jax.random.key(int(rng.integers(1 << 30))), jnp.float32)
    params = with_value_head(params, CFG, jax.random.key(3), scale=1.0)
    base = _config(False)
    opt = make_optimizer(base.optimizer)
    ref_state = init_train_state(params, opt, jax.random.key(1))
    state = offload.offload_moments(init_train_state(params, opt, jax.random.key(1)))
    assert _memory_kinds(state) == {offload.HOST_MEMORY}
    ref_step = make_train_step(CFG, POLICY, base, opt)
    step = offload.make_step(CFG, POLICY, dataclasses.replace(base, offload_optimizer=True))
    for _ in range(2):
        batch = _batch(rng)
        ref_state, ref_m = ref_step(ref_state, batch)
        state, m = step(state, batch)
        assert set(m) == set(ref_m)
        for k in m:
            np.testing.assert_allclose(np.asarray(m[k]), np.asarray(ref_m[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    assert _memory_kinds(state) == {offload.HOST_MEMORY}
    back = offload.moments_to_device(state)
    assert jax.tree.structure(back) == jax.tree.structure(ref_state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ref_state), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * max(1.0, float(np.abs(b).max())))
        else:
            np.testing.assert_array_equal(a, b)
    moved = jax.tree.leaves(tree_get(back.opt_state, "mu"))
    assert all(x.sharding.memory_kind == "device" for x in moved)


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "unclipped"])
def test_adamw_state_is_found_with_and_without_the_clip(max_grad_norm):
    """The update streams the AdamW part of ``make_optimizer``'s state (the chain's second stage with a clip, the
    whole state without): its moments mirror the params, and putting it back gives the state unchanged."""
    cfg = _config(True, max_grad_norm)
    params = init_params(CFG, jax.random.key(0), jnp.float32)
    opt_state = make_optimizer(cfg.optimizer).init(params)
    adamw = offload._adamw_state(opt_state, max_grad_norm is not None)
    assert jax.tree.structure(tree_get(adamw, "mu")) == jax.tree.structure(params)
    again = offload._with_adamw_state(opt_state, adamw, max_grad_norm is not None)
    assert jax.tree.structure(again) == jax.tree.structure(opt_state)


def test_groups_are_layers_and_top_level_parameters():
    params = init_params(CFG, jax.random.key(0), jnp.float32)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    groups = offload.param_groups(params)
    assert sorted(i for g in groups for i in g) == list(range(len(paths)))
    layer_groups = [g for g in groups if "'layers'" in paths[g[0]]]
    assert len(layer_groups) == CFG.num_layers
    for n, g in enumerate(layer_groups):
        assert all(f"['layers'][{n}]" in paths[i] for i in g)
        assert len(g) == len(layer_groups[0]) > 1
    assert all(len(g) == 1 for g in groups if g not in layer_groups)


def test_offloaded_state_checkpoints_and_restores(tmp_path):
    """A state with host moments (random, as after some updates) saves, with its per-leaf checksums, and restores
    (into the plain abstract state, then placed again) bit for bit."""
    opt = make_optimizer(_config(True).optimizer)
    params = init_params(CFG, jax.random.key(0), jnp.float32)
    state = init_train_state(params, opt, jax.random.key(1))
    rng = np.random.default_rng()
    moments = {k: jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), tree_get(state.opt_state, k))
               for k in ("mu", "nu")}
    state = offload.offload_moments(state.replace(opt_state=tree_set(state.opt_state, **moments)))
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, {"step": 1})
    ckpt.wait()
    target = jax.eval_shape(lambda p: init_train_state(p, opt, jax.random.key(1)), params)
    restored = offload.offload_moments(ckpt.restore_latest(target).state)
    assert _memory_kinds(restored) == {offload.HOST_MEMORY}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_where_offload_does_not_apply():
    cfg = _config(True)
    with pytest.raises(ValueError, match="offload_optimizer"):
        make_train_step(CFG, POLICY, cfg)
    opt = make_optimizer(cfg.optimizer)
    state = init_train_state(init_params(CFG, jax.random.key(0), jnp.float32), opt, jax.random.key(1))
    with pytest.raises(ValueError, match="pinned_host"):  # moments still on the device
        offload.make_step(CFG, POLICY, cfg)(state, _batch(np.random.default_rng(0)))
