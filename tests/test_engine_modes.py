"""The engine's memory and host-loop modes against its plain runs: sleep / wake (the KV pool and the
weights freed between rollouts) and the overlapped host loop (``overlap_host``)."""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import F32, GREEDY, _prompts, _trained_like

from configs.models import tiny_qwen3, tiny_qwen3_moe
from fp8rl_jax.models import DensePolicy, Fp8Mode, PagedKVCache, calibrate_kv_scales, init_params
from fp8rl_jax.rollout.base import FinishReason
from fp8rl_jax.rollout import programs
from fp8rl_jax.rollout.engine import JaxEngine, KvCalibration
from fp8rl_jax.rollout.sampling import SamplingConfig


def test_sleep_frees_the_pool_and_changes_no_result():
    """``sleep`` deletes the KV pool's device buffers; the next generate allocates it again at the
    same shape (no new compile) and gives the tokens and logprobs of an engine that never slept
    (FP8 KV, preemption forced); calibrated scales and their freshness survive a sleep, a weight
    update while asleep still makes them stale, and an engine built asleep holds no pool."""
    cfg, rng = tiny_qwen3, np.random.default_rng(11)
    params = _trained_like(cfg, 11)
    prompts = _prompts(rng, cfg.vocab_size, [9, 6, 11, 3])
    sampling = SamplingConfig(temperature=0.8, max_tokens=12, ignore_eos=True, seed=9)
    ec = dataclasses.replace(F32, precision=Fp8Mode.KV, num_pages=9)
    ref = JaxEngine(cfg, params, ec)
    first = ref.generate(prompts, sampling)
    assert first.preemptions > 0

    eng = JaxEngine(cfg, params, ec, asleep=True)
    assert eng.asleep and eng.cache is None and eng.kv_pool_bytes == 2 * cfg.num_layers * 9 * 4 * \
        cfg.num_kv_heads * cfg.head_dim
    out = eng.generate(prompts, sampling)  # wakes itself, calibrates
    assert not eng.asleep and out.token_lists() == first.token_lists()
    np.testing.assert_array_equal(out.logprobs, first.logprobs)
    pools = (*eng.cache.k_pages, *eng.cache.v_pages)
    k1, v1 = np.asarray(eng.cache.k_scale), np.asarray(eng.cache.v_scale)
    sizes = [f._cache_size() for f in (programs.prefill_jit, programs.decode_jit)]
    eng.sleep()
    eng.sleep()  # idempotent
    assert eng.asleep and all(a.is_deleted() for a in pools) and eng.kv_scales_fresh
    again = eng.generate(prompts, sampling)
    assert again.token_lists() == first.token_lists()
    np.testing.assert_array_equal(again.logprobs, first.logprobs)
    np.testing.assert_array_equal(np.asarray(eng.cache.k_scale), k1)  # kept, not recalibrated or reset
    np.testing.assert_array_equal(np.asarray(eng.cache.v_scale), v1)
    assert [f._cache_size() for f in (programs.prefill_jit, programs.decode_jit)] == sizes
    assert eng.cache.k_pages[0].shape == pools[0].shape and eng.cache.k_pages[0].dtype == jnp.float8_e4m3fn

    # an update while asleep: the scales are stale and the next generate recalibrates them on the new weights
    eng.sleep()
    doubled = jax.tree_util.tree_map_with_path(
        lambda path, w: w * 2 if any(getattr(k, "key", None) == "k_norm" for k in path) else w, params)
    eng.update_weights(doubled)
    assert not eng.kv_scales_fresh
    eng.generate(prompts, sampling)
    np.testing.assert_allclose(float(eng.cache.k_scale[0]), 2 * k1[0], rtol=1e-5)


def test_sleep_can_drop_the_weights_until_the_next_update():
    """``sleep(weights=True)`` lets go of the engine's weights (a W8A8 engine's FP8 copy is freed;
    arrays the caller holds are untouched); generating before ``update_weights`` is an error that
    says so, and after it the engine generates as a fresh one."""
    cfg, rng = tiny_qwen3, np.random.default_rng(13)
    params = _trained_like(cfg, 13)
    prompts = _prompts(rng, cfg.vocab_size, [5, 8])
    ec = dataclasses.replace(F32, precision=Fp8Mode.W8A8, fp8_block=(16, 16))
    eng = JaxEngine(cfg, params, ec)
    first = eng.generate(prompts, GREEDY)
    fp8 = [weakref.ref(w) for w in jax.tree.leaves(eng.params) if w.dtype == jnp.float8_e4m3fn]
    assert fp8 and all(r() is not None for r in fp8)
    eng.sleep(weights=True)
    gc.collect()
    assert eng.asleep and eng.params is None
    assert all(r() is None for r in fp8)  # the engine held the only references: its FP8 copy is gone
    assert all(not w.is_deleted() for w in jax.tree.leaves(params))
    with pytest.raises(RuntimeError, match="call update_weights"):
        eng.generate(prompts, GREEDY)
    with pytest.raises(RuntimeError, match="call update_weights"):
        eng.warmup(min_prompt_len=5, max_prompt_len=8)
    eng.update_weights(params)
    again = eng.generate(prompts, GREEDY)
    assert again.token_lists() == first.token_lists()
    np.testing.assert_array_equal(again.logprobs, first.logprobs)


def test_trainer_side_scales_synced_while_asleep_are_used_after_wake():
    cfg, rng = tiny_qwen3, np.random.default_rng(12)
    params = _trained_like(cfg, 12)
    prompts = _prompts(rng, cfg.vocab_size, [6, 11])
    eng = JaxEngine(cfg, params, dataclasses.replace(F32, precision=Fp8Mode.KV, kv_calibration=KvCalibration.TRAINER))
    calib = jnp.asarray(rng.integers(2, cfg.vocab_size, (4, 16)), jnp.int32)
    k, v = calibrate_kv_scales(params, calib, jnp.full((4,), 16), config=cfg, policy=DensePolicy("float32"))
    eng.sleep()
    eng.update_weights(params)
    with pytest.raises(RuntimeError, match="stale"):
        eng.generate(prompts, GREEDY)
    eng.sleep()
    eng.set_kv_scales(k, v)
    assert eng.asleep and eng.kv_scales_fresh
    eng.wake()
    np.testing.assert_array_equal(np.asarray(eng.cache.k_scale), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(eng.cache.v_scale), np.asarray(v))
    assert eng.generate(prompts, GREEDY).lengths.tolist() == [7, 7]


def test_wake_without_memory_names_the_pool_and_stays_asleep(monkeypatch):
    cfg = tiny_qwen3
    eng = JaxEngine(cfg, init_params(cfg, jax.random.key(0), jnp.float32), F32, asleep=True)

    def exhausted(*a, **k):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes.")

    monkeypatch.setattr(PagedKVCache, "init", exhausted)
    with pytest.raises(RuntimeError, match=r"KV pool \(64 pages, .* GiB\) does not fit"):
        eng.generate([[3, 4, 5]], GREEDY)
    assert eng.asleep
    monkeypatch.undo()
    assert eng.generate([[3, 4, 5]], GREEDY).lengths.tolist() == [7]


def test_overlapped_host_loop_changes_no_result():
    """``overlap_host`` (the next decode chunk dispatched before the host reads the last one) against
    the synchronous loop: same tokens, logprobs, finish reasons and recorded MoE routing, with more
    requests than slots (admission every few chunks), stop tokens, ragged budgets, and a page pool
    small enough to preempt; the overlapped loop's device-time stats stay within the wall time. MoE,
    so the recorded routing is compared too."""
    cfg, rng = tiny_qwen3_moe, np.random.default_rng(21)
    params = _trained_like(cfg, 21)
    prompts = _prompts(rng, cfg.vocab_size, [9, 3, 14, 6, 11, 2, 8, 5])
    sampling = [SamplingConfig(temperature=0.9, top_p=0.95, max_tokens=int(n), seed=40 + i, ignore_eos=True)
                for i, n in enumerate(rng.integers(10, 17, len(prompts)))]
    ec = dataclasses.replace(F32, max_slots=3, num_pages=9, steps_per_call=3,
                             record_routing=True)
    # every other request stops at the token it samples third (the free run on the synchronous engine's
    # programs: a config of its own would compile its own)
    free_run = JaxEngine(cfg, params, ec).generate(prompts, sampling).token_lists()
    sampling = [dataclasses.replace(sp, stop_token_ids=(free_run[i][2],)) if i % 2 == 0 else sp
                for i, sp in enumerate(sampling)]
    out = {}
    for overlap in (False, True):
        eng = JaxEngine(cfg, params, dataclasses.replace(ec, overlap_host=overlap))
        t0 = time.perf_counter()
        out[overlap] = eng.generate(prompts, sampling)
        wall = time.perf_counter() - t0
        assert out[overlap].preemptions > 0 and eng.stats["decode_s"] + eng.stats["prefill_s"] <= wall
    a, b = out[False], out[True]
    assert a.token_lists() == b.token_lists() and a.finish_reasons == b.finish_reasons
    # float32 rounding only: a recompute may land in another prefill group and length bucket
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert a.finish_reasons[::2] == [FinishReason.STOP] * 4 and a.finish_reasons[1::2] == [FinishReason.LENGTH] * 4
    assert a.routing is not None and (a.routing >= 0).any()
    np.testing.assert_array_equal(a.routing, b.routing)
