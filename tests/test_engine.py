"""The JAX rollout engine against full-sequence scoring, transformers' greedy generate, and itself
under other batch compositions, page sizes and preemption."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_GREEDY_LENGTHS, HF_GREEDY_MODELS, HF_GREEDY_NEW_TOKENS, hf_greedy

from configs.models import qwen3_8b, tiny_qwen3, tiny_qwen3_moe
from fp8rl_jax.checkpoint import load_checkpoint
from fp8rl_jax.models import DensePolicy, Fp8Mode, PagedKVCache, calibrate_kv_scales, forward, init_params
from fp8rl_jax.models import calibrate_kv_scales_jit
from fp8rl_jax.rollout import kv_pool, programs
from fp8rl_jax.rollout.base import FinishReason
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine, KvCalibration
from fp8rl_jax.rollout.sampling import Draw, SamplingConfig

# Compiles dominate these tests: every distinct engine config (shapes, precision, model) compiles its own prefill
# (one per length bucket) and decode programs, so the tests share a few configs. Two buckets: most prompts here
# fit the first, longer ones and sequences recomputed after a preemption the second.
F32 = EngineConfig(max_slots=3, page_size=4, num_pages=64, max_seq_len=64, steps_per_call=3, prefill_batch=2,
                   prefill_buckets=(16, 64), dtype="float32")
# more slots, smaller pages, longer decode chunks, a wider prefill: a config of the invariance and truncation tests
WIDE = dataclasses.replace(F32, max_slots=4, page_size=2, steps_per_call=5, prefill_batch=4)
GREEDY = SamplingConfig(temperature=0.0, max_tokens=7, ignore_eos=True)


def _prompts(rng, vocab, lengths):
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


@functools.cache
def _scoring_forward(cfg):
    """The jitted full-sequence float32 forward of ``cfg`` (one per config: every prompt shares it)."""
    return jax.jit(lambda p, t: forward(p, t, config=cfg, policy=DensePolicy("float32"))[0])


def _greedy_by_scoring(params, cfg, prompt, n):
    """Argmax of the full-sequence forward at every step, and its log-softmax logprob."""
    fwd = _scoring_forward(cfg)
    seq, lps = list(prompt), []
    for _ in range(n):
        padded = np.zeros((1, 32), np.int32)  # one shape, one compilation; causal, so padding after is inert
        padded[0, : len(seq)] = seq
        logits = np.asarray(fwd(params, padded))[0, len(seq) - 1].astype(np.float64)
        tok = int(np.argmax(logits))
        lps.append(float(logits[tok] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()))
        seq.append(tok)
    return seq[len(prompt):], lps


@pytest.mark.parametrize("cfg", [tiny_qwen3, tiny_qwen3_moe], ids=["dense", "moe"])
def test_greedy_equals_full_scoring_argmax(cfg):
    """Ragged prompts through 3 slots (continuous batching admits the rest as slots free up)."""
    rng = np.random.default_rng(0)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    params = jax.tree.map(lambda w: w * 50 / np.sqrt(w.shape[-1]) if w.ndim >= 2 else w, params)
    prompts = _prompts(rng, cfg.vocab_size, [3, 12, 7, 1, 9])
    batch = JaxEngine(cfg, params, F32).generate(prompts, GREEDY)
    assert batch.lengths.tolist() == [7] * 5 and batch.finish_reasons == [FinishReason.LENGTH] * 5
    for i, prompt in enumerate(prompts):
        tokens, lps = _greedy_by_scoring(params, cfg, prompt, 7)
        assert batch.token_lists()[i] == tokens, i
        np.testing.assert_allclose(batch.logprob_lists()[i], lps, atol=1e-4)


@pytest.mark.parametrize("name", HF_GREEDY_MODELS)
def test_greedy_equals_transformers_generate(hf_models, name):
    # transformers' greedy continuations come from the reference process that built hf_models
    folder, _, _ = hf_models[name]
    ckpt = load_checkpoint(folder, dtype=jnp.float32)
    prompts, hf = hf_greedy(hf_models, name)
    assert prompts == _prompts(np.random.default_rng(1), ckpt.config.vocab_size, list(HF_GREEDY_LENGTHS))
    cfg = dataclasses.replace(F32, max_seq_len=ckpt.config.max_position_embeddings)
    ours = JaxEngine(ckpt.config, ckpt.params, cfg).generate(
        prompts, dataclasses.replace(GREEDY, max_tokens=HF_GREEDY_NEW_TOKENS))
    assert ours.token_lists() == hf


_SAMPLED = SamplingConfig(temperature=1.0, top_p=0.9, top_k=20, max_tokens=7, ignore_eos=True, seed=5)


# A greedy row takes the argmax whatever the draw (Draw applies to rows with T > 0): the greedy case runs
# the default draw, whose F32 programs the other greedy tests of this file compile too. Every engine config
# compiles its own programs, so each sampled draw runs two of the three configs (together they cover all three).
@pytest.mark.parametrize("sampling,draw,which", [(GREEDY, Draw.INVERSE_CDF, (0, 1, 2)), (_SAMPLED, Draw.GUMBEL, (0, 1)),
                                                 (_SAMPLED, Draw.INVERSE_CDF, (0, 2))],
                         ids=["greedy", "sampled", "sampled-inverse-cdf"])
def test_results_do_not_depend_on_slots_pages_or_chunking(sampling, draw, which):
    cfg, rng = tiny_qwen3, np.random.default_rng(2)
    params = init_params(cfg, jax.random.key(1), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [4, 10, 6, 2])
    seeds = [dataclasses.replace(sampling, seed=sampling.seed + i) for i in range(len(prompts))]
    runs = []
    configs = [F32, dataclasses.replace(F32, max_slots=1, page_size=8, steps_per_call=1), WIDE]
    for i in which:
        engine = JaxEngine(cfg, params, dataclasses.replace(configs[i], sampling_draw=draw))
        runs.append(engine.generate(prompts, seeds))
    for other in runs[1:]:
        assert other.token_lists() == runs[0].token_lists()
        np.testing.assert_allclose(other.logprobs, runs[0].logprobs, atol=1e-5)


def test_decode_runs_the_smallest_row_bucket_holding_the_occupied_slots():
    """``decode_buckets``: a decode call runs only the first R slots, R the smallest bucket holding
    every occupied slot, and the requests' tokens and logprobs are those of an engine that always
    decodes every slot. Slot 0 runs longest, so the calls go from 4 rows to 2 and then 1; then a
    request in a high slot outlives the low ones and moves down (``_compact``)."""
    cfg, rng = tiny_qwen3, np.random.default_rng(23)
    params = init_params(cfg, jax.random.key(6), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [5, 3, 8, 2])
    sampling = [SamplingConfig(temperature=1.0, max_tokens=n, ignore_eos=True, seed=60 + i)
                for i, n in enumerate([24, 12, 2, 6])]
    assert WIDE.decode_rows == (WIDE.max_slots,)  # default buckets: powers of two from 16, none below 4 slots
    full = JaxEngine(cfg, params, WIDE)
    ref = full.generate(prompts, sampling)
    eng = JaxEngine(cfg, params, dataclasses.replace(WIDE, decode_buckets=(2, 1)))
    assert eng.config.decode_rows == (1, 2, 4)
    out = eng.generate(prompts, sampling)
    assert out.token_lists() == ref.token_lists() and out.lengths.tolist() == [24, 12, 2, 6]
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-6)
    buckets = [entry[4] for entry in eng.decode_log]
    assert buckets == sorted(buckets, reverse=True) and set(buckets) == {1, 2, 4}, buckets
    assert {entry[4] for entry in full.decode_log} == {4}
    assert eng.stats["decode_row_steps"] == sum(buckets) * WIDE.steps_per_call
    assert eng.stats["decode_row_steps"] < full.stats["decode_row_steps"]
    assert EngineConfig(max_slots=256).decode_rows == (16, 32, 64, 128, 256)
    assert EngineConfig(max_slots=100).decode_rows == (16, 32, 64, 100)
    for bad in ((0,), (5,), [2]):
        with pytest.raises(ValueError, match="decode_buckets"):
            dataclasses.replace(WIDE, decode_buckets=bad)
    assert eng.stats["slot_moves"] == 0
    # slot 3 outlives slots 0 and 2: it moves to slot 0 (a chunk in flight for it continues there), so the
    # calls still go down to 2 rows and 1
    moved = [dataclasses.replace(sampling[i], max_tokens=n) for i, n in enumerate([2, 12, 6, 24])]
    ref = full.generate(prompts, moved)
    out = eng.generate(prompts, moved)
    assert eng.stats["slot_moves"] == 1 and full.stats["slot_moves"] == 0
    assert out.token_lists() == ref.token_lists() and out.lengths.tolist() == [2, 12, 6, 24]
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-6)
    buckets = [entry[4] for entry in eng.decode_log]
    assert buckets == sorted(buckets, reverse=True) and set(buckets) == {1, 2, 4}, buckets


def test_truncation_is_decided_on_the_host(monkeypatch):
    """Each device call compiles in whether any of its rows truncates (top-k / top-p) rather than
    branching on it: calls without such rows run the program without a device conditional (on
    XLA:GPU one holds the host's dispatch until the GPU reaches it, every step), and a request
    draws the same tokens whether or not a neighbour truncates (its calls then sort)."""
    cfg, rng = tiny_qwen3, np.random.default_rng(21)
    params = init_params(cfg, jax.random.key(5), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [5, 9, 3])
    plain = [SamplingConfig(temperature=1.0, max_tokens=6, ignore_eos=True, seed=40 + i) for i in range(3)]
    flags = {"prefill": [], "decode": []}

    def spy(name, fn):
        def call(*args, **kw):
            flags[name].append(kw["truncation"])
            return fn(*args, **kw)
        return call

    monkeypatch.setattr(programs, "prefill_jit", spy("prefill", programs.prefill_jit))
    monkeypatch.setattr(programs, "decode_jit", spy("decode", programs.decode_jit))
    alone = JaxEngine(cfg, params, F32).generate(prompts, plain)
    assert flags["prefill"] and flags["decode"] and not any(flags["prefill"] + flags["decode"])
    flags = {"prefill": [], "decode": []}
    # four slots, so the top-p request runs from the start (WIDE: the programs of the invariance test's)
    mixed = JaxEngine(cfg, params, WIDE).generate(prompts + [prompts[1]], plain + [_SAMPLED])
    assert True in flags["prefill"] and all(flags["decode"])  # the top-p request runs in every decode call
    assert mixed.token_lists()[:3] == alone.token_lists()
    np.testing.assert_allclose(mixed.logprobs[:3, :6], alone.logprobs, atol=1e-5)
    monkeypatch.undo()
    eng, B = JaxEngine(cfg, params, F32), F32.max_slots
    args = (eng.params, eng.cache, *eng.runner.put((np.zeros((B,), np.int32), np.zeros((B,), bool))),
            *eng.runner.row_inputs([None] * B))
    for truncation, conditionals in ((False, 0), (None, 1)):  # None: the device decides (lax.cond)
        hlo = programs.decode_jit.lower(*args, steps=F32.steps_per_call, truncation=truncation,
                                        **eng.runner.static).compile().as_text()
        assert hlo.count(" conditional(") == conditionals


def test_tiny_page_budget_preempts_and_loses_nothing():
    cfg, rng = tiny_qwen3, np.random.default_rng(3)
    params = init_params(cfg, jax.random.key(2), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [9, 6, 11, 3])
    sampling = SamplingConfig(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)
    big = JaxEngine(cfg, params, F32).generate(prompts, sampling)
    recompute = JaxEngine(cfg, params, dataclasses.replace(F32, num_pages=8))
    tight = recompute.generate(prompts, sampling)
    assert big.preemptions == 0 and tight.preemptions > 0
    assert tight.token_lists() == big.token_lists()
    np.testing.assert_allclose(tight.logprobs, big.logprobs, atol=1e-5)
    # swap preemption (EngineConfig.swap_space_gib): the preempted KV goes to host memory and comes back, no
    # recompute prefill; the same tokens, and logprobs within float32 rounding of the unpreempted run's
    for overlap in (True, False):
        swap = JaxEngine(cfg, params, dataclasses.replace(F32, num_pages=8, swap_space_gib=1.0, overlap_host=overlap))
        out = swap.generate(prompts, sampling)
        assert out.preemptions > 0 and swap.stats["swap_outs"] == swap.stats["swap_ins"] == out.preemptions
        assert swap.stats["prefill_tokens"] == sum(map(len, prompts)) < recompute.stats["prefill_tokens"]
        assert out.token_lists() == big.token_lists()
        np.testing.assert_allclose(out.logprobs, big.logprobs, atol=1e-5)
    # too little host space for any sequence: every preemption recomputes, as without swap
    none = JaxEngine(cfg, params, dataclasses.replace(F32, num_pages=8, swap_space_gib=1e-9))
    out = none.generate(prompts, sampling)
    assert none.stats["swap_outs"] == 0 and out.preemptions == tight.preemptions
    assert out.token_lists() == big.token_lists()
    with pytest.raises(ValueError, match="swap_space_gib"):
        dataclasses.replace(F32, swap_space_gib=-1.0)


def test_stop_tokens_eos_and_length_limits():
    cfg, rng = tiny_qwen3, np.random.default_rng(4)
    params = init_params(cfg, jax.random.key(3), jnp.float32)
    prompt = _prompts(rng, cfg.vocab_size, [5])
    free = JaxEngine(cfg, params, F32).generate(prompt, dataclasses.replace(GREEDY, max_tokens=10)).token_lists()[0]
    stop = free[4]
    first = free.index(stop)
    out = JaxEngine(cfg, params, F32).generate(prompt, dataclasses.replace(GREEDY, max_tokens=10, stop_token_ids=(stop,)))
    assert out.token_lists()[0] == free[: first + 1] and out.finish_reasons == [FinishReason.STOP]
    # EOS from the model config stops unless ignore_eos
    eos_cfg = dataclasses.replace(cfg, eos_token_ids=(stop,))
    eng = JaxEngine(eos_cfg, params, F32)
    assert eng.generate(prompt, SamplingConfig(temperature=0.0, max_tokens=10)).token_lists()[0] == free[: first + 1]
    assert eng.generate(prompt, dataclasses.replace(GREEDY, max_tokens=10)).token_lists()[0] == free
    # max_seq_len (64; F32's own, so its programs): a prompt of 57 stops at 64 tokens in all, with the 7 tokens
    # it generates when max_tokens says 7
    long = _prompts(rng, cfg.vocab_size, [57])
    eng = JaxEngine(cfg, params, F32)
    seven = eng.generate(long, GREEDY)
    out = eng.generate(long, dataclasses.replace(GREEDY, max_tokens=50))
    assert seven.finish_reasons == [FinishReason.LENGTH]
    assert out.lengths.tolist() == [7] and out.finish_reasons == [FinishReason.MAX_LEN]
    assert out.token_lists() == seven.token_lists()


def test_bad_requests_name_the_request_and_run_nothing():
    cfg = tiny_qwen3
    eng = JaxEngine(cfg, init_params(cfg, jax.random.key(4), jnp.float32), F32)
    ok = [1, 2, 3]
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        eng.generate([ok, []], GREEDY)
    with pytest.raises(ValueError, match=r"request 2: token id 256 is outside the vocabulary \[0, 256\)"):
        eng.generate([ok, ok, [5, 256]], GREEDY)
    with pytest.raises(ValueError, match="request 0: prompt of 64 tokens leaves no room under max_seq_len 64"):
        eng.generate([[3] * 64], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingConfig(max_tokens=0)
    small = JaxEngine(cfg, init_params(cfg, jax.random.key(4), jnp.float32), dataclasses.replace(F32, num_pages=2))
    with pytest.raises(ValueError, match="request 0: needs up to .* KV slots but the pool holds 8"):
        small.generate([ok], GREEDY)


def test_kv_budget_in_gib_and_fp8_weights():
    cfg = tiny_qwen3
    params = init_params(cfg, jax.random.key(5), jnp.float32)
    eng = JaxEngine(cfg, params, dataclasses.replace(F32, num_pages=0, kv_budget_gib=0.001))
    page_bytes = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert eng.num_pages == int(0.001 * 2**30 // page_bytes)
    assert eng.sequences_that_fit == eng.num_pages // 16
    # 16 x 16 FP8 blocks: the W8A8 engine of test_engine_modes.py (its compiled programs are shared)
    w8 = JaxEngine(cfg, params, dataclasses.replace(F32, precision=Fp8Mode.W8A8, fp8_block=(16, 16)))
    out = w8.generate([[1, 2, 3, 4]], GREEDY)
    assert out.lengths.tolist() == [7] and np.all(out.logprobs[0] <= 0)


def test_generate_reports_device_call_stats():
    """``engine.stats`` of the last generate: prefill tokens are the prompts (no preemption here),
    every generated token after a request's first came from a decode step of a running slot, and
    the KV tokens read per step cover the contexts of the running rows."""
    cfg = tiny_qwen3
    eng = JaxEngine(cfg, init_params(cfg, jax.random.key(5), jnp.float32), F32)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    out = eng.generate(prompts, GREEDY)
    st = eng.stats
    assert out.preemptions == 0 and st["prefill_tokens"] == sum(map(len, prompts)) and st["prefill_calls"] == 2
    assert st["decode_steps"] == st["decode_calls"] * F32.steps_per_call
    assert st["decode_slot_steps"] >= int(out.lengths.sum()) - len(prompts)
    assert st["decode_kv_tokens"] >= st["decode_slot_steps"] * min(map(len, prompts))
    assert st["decode_s"] > 0 and st["prefill_s"] > 0
    eng.generate(prompts[:1], GREEDY)
    assert eng.stats["prefill_tokens"] == 3  # per generate, not cumulative


def test_kv_budget_as_a_fraction_of_free_device_memory(monkeypatch):
    """``kv_budget_fraction``: the pool takes that share of what the allocator can still give
    (limit minus in use, the weights placed first), the emptiest device deciding; a backend without
    memory statistics (this CPU) is a clear error."""
    cfg = tiny_qwen3
    params = init_params(cfg, jax.random.key(5), jnp.float32)
    frac = dataclasses.replace(F32, num_pages=0, kv_budget_fraction=0.5)
    with pytest.raises(ValueError, match="kv_budget_fraction needs a backend that reports device memory"):
        JaxEngine(cfg, params, frac)

    class Dev:
        platform = "gpu"

        def __init__(self, limit, used):
            self.stats = {"bytes_limit": limit, "bytes_in_use": used}

        def memory_stats(self):
            return self.stats

    # the fuller device leaves 2**18 bytes: half of it is F32's 64 pages (the shapes, so the programs, of F32)
    devices = [Dev(2**22, 2**20), Dev(2**22, 2**22 - 2**18)]
    monkeypatch.setattr(kv_pool.KvPool, "devices", property(lambda self: devices))
    eng = JaxEngine(cfg, params, frac)
    page_bytes = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert eng.num_pages == int(0.5 * (2**22 - (2**22 - 2**18)) // page_bytes) == F32.num_pages  # the fuller device sets it
    assert eng.generate([[1, 2, 3]], GREEDY).lengths.tolist() == [7]
    with pytest.raises(ValueError, match="kv_budget_fraction must be in"):
        dataclasses.replace(F32, kv_budget_fraction=1.5)


def _trained_like(cfg, seed):
    params = init_params(cfg, jax.random.key(seed), jnp.float32)
    return jax.tree.map(lambda w: w * 50 / np.sqrt(w.shape[-1]) if w.ndim >= 2 else w, params)


def test_fp8_kv_engine_tracks_the_float_engine():
    """FP8 KV (E4M3 pages, scales calibrated on the prompts) against the float32 engine: the first
    generated token (same context) agrees, and its logprob moves by little (measured 0.025 nats
    on average here; bound 0.1). Later tokens diverge once one differs, so only the first is
    compared token for token."""
    cfg, rng = tiny_qwen3, np.random.default_rng(0)
    params = _trained_like(cfg, 0)
    prompts = _prompts(rng, cfg.vocab_size, [12, 20, 7, 15, 9, 30])
    ref = JaxEngine(cfg, params, F32).generate(prompts, GREEDY)
    eng = JaxEngine(cfg, params, dataclasses.replace(F32, precision=Fp8Mode.KV))
    assert eng.cache.k_pages[0].dtype == jnp.float8_e4m3fn
    out = eng.generate(prompts, GREEDY)
    assert np.mean(out.tokens[:, 0] == ref.tokens[:, 0]) >= 5 / 6
    assert np.mean(np.abs(out.logprobs[:, 0] - ref.logprobs[:, 0])) < 0.1


def test_kv_scales_follow_every_weight_update():
    """Inference-side calibration: doubling K (k_norm weight) and V (v_proj) doubles layer 0's
    scales at the next generate, every layer's scales change, none is reused across an update;
    the values equal an independent percentile over the K written into a paged cache."""
    cfg, rng = tiny_qwen3, np.random.default_rng(1)
    params = _trained_like(cfg, 1)
    prompts = _prompts(rng, cfg.vocab_size, [9, 14, 5])
    eng = JaxEngine(cfg, params, dataclasses.replace(F32, precision=Fp8Mode.KV))
    eng.generate(prompts, GREEDY)
    k1, v1 = np.asarray(eng.cache.k_scale), np.asarray(eng.cache.v_scale)
    doubled = jax.tree_util.tree_map_with_path(
        lambda path, w: w * 2 if any(getattr(k, "key", None) in ("k_norm", "v_proj") for k in path) else w, params)
    eng.update_weights(doubled)
    assert not eng.kv_scales_fresh
    eng.generate(prompts, GREEDY)
    # layer 0 sees the same inputs, so its K and V exactly double; later layers see changed inputs
    np.testing.assert_allclose(float(eng.cache.k_scale[0]), 2 * k1[0], rtol=1e-5)
    np.testing.assert_allclose(float(eng.cache.v_scale[0]), 2 * v1[0], rtol=1e-5)
    assert np.all(np.asarray(eng.cache.k_scale) != k1) and np.all(np.asarray(eng.cache.v_scale) != v1)
    # the scales are p99.9 * 1.05 / 448 of |K| and |V| on the prompts, read here from a paged cache
    T = 16
    tokens = np.zeros((3, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts])
    paged = PagedKVCache.init(cfg.num_layers, 3 * 4, 4, cfg.num_kv_heads, cfg.head_dim, 3, 4, jnp.float32).replace(
        page_table=jnp.arange(12, dtype=jnp.int32).reshape(3, 4))
    _, paged = jax.jit(lambda p, t, c, n: forward(p, t, config=cfg, policy=DensePolicy("float32"), cache=c,
                                                  num_new=n))(doubled, tokens, paged, jnp.asarray(lengths))
    for layer in range(cfg.num_layers):
        k = np.asarray(paged.k_pages[layer]).reshape(3, T, -1)
        valid = np.concatenate([np.abs(k[b, : lengths[b]]).ravel() for b in range(3)])
        np.testing.assert_allclose(float(eng.cache.k_scale[layer]), np.percentile(valid, 99.9) * 1.05 / 448, rtol=1e-4)
    k_t, v_t = calibrate_kv_scales(doubled, jnp.asarray(tokens), jnp.asarray(lengths), config=cfg,
                                   policy=DensePolicy("float32"))
    np.testing.assert_allclose(np.asarray(k_t), np.asarray(eng.cache.k_scale), rtol=1e-5)


def test_trainer_side_calibration_must_sync_after_each_update():
    cfg, rng = tiny_qwen3, np.random.default_rng(2)
    params = _trained_like(cfg, 2)
    prompts = _prompts(rng, cfg.vocab_size, [6, 11])
    eng = JaxEngine(cfg, params, dataclasses.replace(F32, precision=Fp8Mode.ALL, kv_calibration=KvCalibration.TRAINER))
    with pytest.raises(RuntimeError, match="stale"):
        eng.generate(prompts, GREEDY)
    calib = jnp.asarray(rng.integers(2, cfg.vocab_size, (4, 16)), jnp.int32)
    k, v = calibrate_kv_scales(params, calib, jnp.full((4,), 16), config=cfg, policy=DensePolicy("float32"))
    eng.set_kv_scales(k, v)
    assert eng.generate(prompts, GREEDY).lengths.tolist() == [7, 7]
    eng.update_weights(params)
    with pytest.raises(RuntimeError, match="stale"):
        eng.generate(prompts, GREEDY)
    with pytest.raises(ValueError, match="finite and positive"):
        eng.set_kv_scales(k * 0, v)


def test_progress_hook_reports_every_device_call():
    """``engine.progress`` sees monotone counters after each prefill / decode call, ending at the
    batch's totals (preemptions included: a tight page budget)."""
    cfg, rng = tiny_qwen3, np.random.default_rng(8)
    params = init_params(cfg, jax.random.key(7), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [9, 6, 11])
    sampling = SamplingConfig(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)
    eng = JaxEngine(cfg, params, dataclasses.replace(F32, num_pages=8))
    seen = []
    eng.progress = seen.append
    batch = eng.generate(prompts, sampling)
    assert len(seen) == eng.stats["prefill_calls"] + eng.stats["decode_calls"]
    for key in ("generated_tokens", "finished", "decode_steps", "prefill_calls", "preemptions"):
        values = [p[key] for p in seen]
        assert values == sorted(values), key
    last = seen[-1]
    assert last["generated_tokens"] == int(batch.lengths.sum()) and last["finished"] == 3 == last["requests"]
    assert last["preemptions"] == batch.preemptions > 0 and last["queued"] == 0


def test_warmup_compiles_everything_and_changes_nothing():
    """``warmup`` leaves the cache bit for bit as it was, the next generate equals a cold engine's
    (FP8 KV with inference-side calibration, a page budget that forces preemption and recompute)
    and compiles no prefill, decode or calibration program of its own."""
    cfg, rng = tiny_qwen3, np.random.default_rng(4)
    params = init_params(cfg, jax.random.key(3), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [9, 6, 11, 3])
    sampling = SamplingConfig(temperature=0.8, max_tokens=12, ignore_eos=True, seed=4)
    # shapes no other test compiles (the jitted programs are module-level, their caches shared)
    ec = dataclasses.replace(F32, precision=Fp8Mode.KV, num_pages=9, steps_per_call=2, kv_calibration_prompts=3,
                             prefill_buckets=(8, 16, 64), decode_buckets=(1,))
    eng = JaxEngine(cfg, params, ec)
    before = jax.tree.map(np.array, eng.cache)
    assert eng.warmup(min_prompt_len=3, max_prompt_len=11) > 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, eng.cache), before)
    jitted = (programs.prefill_jit, programs.decode_jit, calibrate_kv_scales_jit, programs.continue_rows_jit)
    sizes = [f._cache_size() for f in jitted]
    warm = eng.generate(prompts, sampling)
    assert warm.preemptions > 0
    assert [f._cache_size() for f in jitted] == sizes
    cold = JaxEngine(cfg, params, ec).generate(prompts, sampling)
    assert warm.token_lists() == cold.token_lists()
    np.testing.assert_array_equal(warm.logprobs, cold.logprobs)
    stages = []
    eng.warmup(min_prompt_len=3, max_prompt_len=11, recompute=False, progress=lambda w, s: stages.append(w))
    # no recompute buckets: prefill buckets 8 and 16 only (bucket(11) = 16; max_seq_len's is 64)
    assert [w for w in stages if w.startswith("prefill")] == [f"prefill {ec.prefill_batch}x{t}" for t in (8, 16)]
    assert [w for w in stages if w.startswith("decode")] == [  # every row bucket, and the continuation merge
        "decode 1x2", "decode 3x2", "decode continuation", "decode continuation (moved rows)"]
    assert any(w.startswith("kv calibration") for w in stages)
    # with swap preemption: its copy programs too (the scales stay fresh: the params did not change)
    swap = JaxEngine(cfg, params, dataclasses.replace(ec, swap_space_gib=1.0))
    stages.clear()
    swap.warmup(min_prompt_len=3, max_prompt_len=11, recompute=False, progress=lambda w, s: stages.append(w))
    assert "swap copies" in stages
    copies = (kv_pool.gather_pages_jit, kv_pool.scatter_pages_jit)
    sizes = [f._cache_size() for f in copies]
    out = swap.generate(prompts, sampling)
    assert swap.stats["swap_outs"] > 0 and [f._cache_size() for f in copies] == sizes
    assert out.token_lists() == cold.token_lists()
    with pytest.raises(ValueError, match="min_prompt_len"):
        eng.warmup(min_prompt_len=0)
    with pytest.raises(ValueError, match="max_prompt_len"):
        eng.warmup(min_prompt_len=8, max_prompt_len=4)


@pytest.mark.gpu
def test_decode_program_keeps_xla_split_k_out():
    """XLA:GPU splits the K of a BF16 GEMM whose tiles fill few SMs (Qwen3-8B's o_proj, down_proj and fused q/k/v at
    256 rows) into a batched GEMM with float32 partial sums plus a reduction kernel (0.32 ms of an 8B kv decode
    step). The engine's decode program forbids it. One layer at Qwen3-8B's widths, 256 slots, mode kv (BF16
    linears): the optimized HLO of XLA's heuristic has split GEMMs, that of `decode_program()` has none."""
    cfg = dataclasses.replace(qwen3_8b, num_layers=1, vocab_size=8192, bos_token_id=None, eos_token_ids=(1,))
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    ec = EngineConfig(max_slots=256, page_size=16, num_pages=256 * 4 + 8, max_seq_len=64, steps_per_call=1,
                      precision=Fp8Mode.KV, dtype="bfloat16")
    engine = JaxEngine(cfg, params, ec)
    B = ec.max_slots
    sampling, stops, remaining = engine.runner.row_inputs([None] * B)
    last, active = engine.runner.put((np.zeros((B,), np.int32), np.ones((B,), bool)))

    def gemms(program):
        hlo = program.lower(engine.params, engine.cache, last, active, sampling, stops, remaining, steps=1,
                            truncation=False, **engine.runner.static).compile().as_text()
        lines = [ln for ln in hlo.splitlines() if "custom_call_target=\"__cublas" in ln]
        split = [ln for ln in lines if re.search(r"f32\[\d+,256,\d+\]", ln.split("custom-call(")[0])]
        return lines, split

    heuristic, heuristic_split = gemms(programs.decode_xla_split_k_jit)
    ours, ours_split = gemms(programs.decode_program())
    assert programs.decode_program() is programs.decode_jit
    assert heuristic_split, "XLA's heuristic no longer splits these GEMMs: the forced option may be moot; recheck"
    assert ours and not ours_split, ours_split


def test_swap_space_is_pinned_once_with_a_clear_error(monkeypatch):
    """`JaxEngine.reserve_swap_space` pins ``swap_space_gib`` of host memory in blocks once per engine (XLA's
    pinned-host allocator grows by doubling regions, and growing it inside a generate stalls it); the
    second call and engines without swap space pin nothing (a sleeping engine pins too: the space is host
    memory); a host that cannot pin it gets an error naming the setting, and the engine stays usable."""
    cfg = tiny_qwen3
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    pinned = []
    real = kv_pool.to_host

    def counting(x):
        pinned.append(x.nbytes)
        return real(x)

    monkeypatch.setattr(kv_pool, "to_host", counting)
    eng = JaxEngine(cfg, params, dataclasses.replace(F32, swap_space_gib=0.75), asleep=True)  # no KV pool yet
    assert eng.swap_reserve_s is None
    assert eng.reserve_swap_space() >= 0 and eng.swap_reserve_s is not None
    assert len(pinned) == 3 and sum(pinned) == 0.75 * 2**30  # three 256 MiB blocks
    assert eng.reserve_swap_space() == 0.0 and len(pinned) == 3
    JaxEngine(cfg, params, F32).reserve_swap_space()
    assert len(pinned) == 3

    def failing(x):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")

    monkeypatch.setattr(kv_pool, "to_host", failing)
    broken = JaxEngine(cfg, params, dataclasses.replace(F32, swap_space_gib=2.0))
    with pytest.raises(RuntimeError, match="swap_space_gib = 2.0 GiB"):
        broken.generate([[1, 2, 3]], SamplingConfig(max_tokens=2))
    monkeypatch.setattr(kv_pool, "to_host", real)
    assert len(broken.generate([[1, 2, 3]], SamplingConfig(max_tokens=2)).token_lists()[0]) == 2
