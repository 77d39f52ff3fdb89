"""The JAX rollout engine against full-sequence scoring, transformers' greedy generate, and itself
under other batch compositions, page sizes and preemption."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3, tiny_qwen3_moe
from conftest import ref_python, HF_REFERENCE
from fp8rl_jax.checkpoint import load_checkpoint
from fp8rl_jax.models import DensePolicy, Fp8Mode, forward, init_params
from fp8rl_jax.rollout.base import FinishReason
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig

F32 = EngineConfig(max_slots=3, page_size=4, num_pages=64, max_seq_len=64, steps_per_call=3, prefill_batch=2,
                   prefill_buckets=(8, 16, 32, 64), dtype="float32")
GREEDY = SamplingConfig(temperature=0.0, max_tokens=7, ignore_eos=True)


def _prompts(rng, vocab, lengths):
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


def _greedy_by_scoring(params, cfg, prompt, n):
    """Argmax of the full-sequence forward at every step, and its log-softmax logprob."""
    fwd = jax.jit(lambda p, t: forward(p, t, config=cfg, policy=DensePolicy("float32"))[0])
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


@pytest.mark.parametrize("name", ["dense", "moe_sharded"])
def test_greedy_equals_transformers_generate(hf_models, tmp_path, name):
    folder, _, _ = hf_models[name]
    ckpt = load_checkpoint(folder, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, ckpt.config.vocab_size, [5, 11, 2])
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    proc = subprocess.run([ref_python(), str(HF_REFERENCE), "greedy", "--model", str(folder), "--prompts",
                           str(tmp_path / "p.json"), "--max-new-tokens", "8", "--out", str(tmp_path / "o.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = json.loads((tmp_path / "o.json").read_text())
    cfg = dataclasses.replace(F32, max_seq_len=ckpt.config.max_position_embeddings)
    ours = JaxEngine(ckpt.config, ckpt.params, cfg).generate(prompts, dataclasses.replace(GREEDY, max_tokens=8))
    assert ours.token_lists() == hf


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0, top_p=0.9, top_k=20, max_tokens=7,
                                                             ignore_eos=True, seed=5)], ids=["greedy", "sampled"])
def test_results_do_not_depend_on_slots_pages_or_chunking(sampling):
    cfg, rng = tiny_qwen3, np.random.default_rng(2)
    params = init_params(cfg, jax.random.key(1), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [4, 10, 6, 2])
    seeds = [dataclasses.replace(sampling, seed=sampling.seed + i) for i in range(len(prompts))]
    runs = []
    for ec in [F32, dataclasses.replace(F32, max_slots=1, page_size=8, steps_per_call=1),
               dataclasses.replace(F32, max_slots=4, page_size=2, steps_per_call=5, prefill_batch=4)]:
        runs.append(JaxEngine(cfg, params, ec).generate(prompts, seeds))
    for other in runs[1:]:
        assert other.token_lists() == runs[0].token_lists()
        np.testing.assert_allclose(other.logprobs, runs[0].logprobs, atol=1e-5)


def test_tiny_page_budget_preempts_and_loses_nothing():
    cfg, rng = tiny_qwen3, np.random.default_rng(3)
    params = init_params(cfg, jax.random.key(2), jnp.float32)
    prompts = _prompts(rng, cfg.vocab_size, [9, 6, 11, 3])
    sampling = SamplingConfig(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)
    big = JaxEngine(cfg, params, F32).generate(prompts, sampling)
    tight = JaxEngine(cfg, params, dataclasses.replace(F32, num_pages=8)).generate(prompts, sampling)
    assert big.preemptions == 0 and tight.preemptions > 0
    assert tight.token_lists() == big.token_lists()
    np.testing.assert_allclose(tight.logprobs, big.logprobs, atol=1e-5)


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
    # max_seq_len: prompt 5 + generated stops at 12 tokens in all
    short = JaxEngine(cfg, params, dataclasses.replace(F32, max_seq_len=12))
    out = short.generate(prompt, dataclasses.replace(GREEDY, max_tokens=50))
    assert out.lengths.tolist() == [7] and out.finish_reasons == [FinishReason.MAX_LEN]
    assert out.token_lists()[0] == free[:7]


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
    w8 = JaxEngine(cfg, params, dataclasses.replace(F32, precision=Fp8Mode.W8A8))
    out = w8.generate([[1, 2, 3, 4]], GREEDY)
    assert out.lengths.tolist() == [7] and np.all(out.logprobs[0] <= 0)
    with pytest.raises(ValueError, match="FP8 KV"):
        EngineConfig(precision=Fp8Mode.KV)
