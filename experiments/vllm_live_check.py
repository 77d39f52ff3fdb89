"""Live checks of the vLLM backend on one GPU, with vLLM 0.26 importable (the fp8rl_jax[vllm] extra).

    python experiments/vllm_live_check.py --phase small --out small.json   # agreement, update effect
    python experiments/vllm_live_check.py --phase sync8b --out sync.json   # Qwen3-8B-shaped sync time

``small``: a random 4-layer Qwen3 (1.7B widths, 8k vocabulary) in block FP8. vLLM starts from the
checkpoint ``fp8rl quantize`` would write; then
  1. greedy tokens of 8 ragged prompts from vLLM against our engine's FP8 (W8A8) greedy tokens, as
     position agreement, and teacher-forced: our W8A8 forward's argmax at each of vLLM's positions;
  2. vLLM's per-token logprobs against our W8A8 forward's log-softmax of vLLM's tokens (|delta|);
  3. ``update_weights`` with other weights: vLLM's tokens change, and agree with our engine's under
     the new weights; updating back gives the first tokens exactly;
  4. ``set_kv_scales`` writes every layer (read back).
``sync8b``: random Qwen3-8B-shaped weights; vLLM starts from their FP8 checkpoint with an FP8 KV
cache; ``update_weights`` (our quantization kernel + DLPack views + vLLM's in-place reload) is timed
(median of repeats, after one warm-up), with ``set_kv_scales``; tokens change after an update to
other weights. Both phases write JSON (``--out``); the GPU test ``tests/test_vllm_backend.py``
asserts on ``small_check``'s result.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# JAX's share of the GPU must be set before JAX starts (the rest is vLLM's): see VLLMConfig.
_JAX_FRACTION = 0.45
os.environ.update({"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": str(_JAX_FRACTION)})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs.models import qwen3_1_7b, qwen3_8b  # noqa: E402
from fp8rl_jax.checkpoint.hf import save_checkpoint  # noqa: E402
from fp8rl_jax.environment import run_environment  # noqa: E402
from fp8rl_jax.models.calibration import calibrate_kv_scales_jit  # noqa: E402
from fp8rl_jax.models.policy import DensePolicy, Fp8Mode  # noqa: E402
from fp8rl_jax.models.qwen3 import forward, init_params  # noqa: E402
from fp8rl_jax.quant.policy import W8A8Policy, quantize_params  # noqa: E402
from fp8rl_jax.rollout import vllm_backend as vb  # noqa: E402
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine  # noqa: E402
from fp8rl_jax.rollout.sampling import SamplingConfig  # noqa: E402

SMALL = dataclasses.replace(qwen3_1_7b, num_layers=4, vocab_size=8192, bos_token_id=1, eos_token_ids=(2,),
                            tie_word_embeddings=False)  # untied, as Qwen3-8B: no copy-the-last-token bias


def _prompts(vocab: int, n: int, seed: int, lo: int = 5, hi: int = 64) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Position agreement of two greedy runs of the same prompts, and where they first part."""
    same = total = 0
    first = []
    for a, b in zip(ours, theirs):
        n = max(len(a), len(b))
        total += n
        same += sum(x == y for x, y in zip(a, b))
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first.append(d)
    return {"position_agreement": same / max(total, 1), "identical_sequences": sum(a == b for a, b in zip(ours, theirs)),
            "sequences": len(ours), "first_divergence": first}


def _logprob_rows(logits: np.ndarray) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


@functools.cache
def _forward(config, dtype: str):
    """The jitted W8A8 forward (one per config and dtype: the three checks share its compiles)."""
    return jax.jit(lambda p, t: forward(p, t, config=config, policy=W8A8Policy(dtype))[0])


def teacher_forced(params_q, config, prompts, generated, logprobs) -> dict:
    """Our W8A8 forward (BF16 compute) over prompt + vLLM's tokens: how often its argmax is vLLM's
    greedy token, and |vLLM's logprob - our log-softmax| at each generated position. With the same
    measures between two roundings of our own FP8 model (BF16 against float32 compute, same FP8
    codes) as the noise floor: a random model's next-token distribution is nearly flat (top-2 gaps of
    ~0.1 logit), so even those two agree on only part of the argmaxes (CPU: 71%, 4-layer model)."""
    def run(dtype):
        p = jax.tree.map(lambda x: x.astype(jnp.float32) if dtype == "float32" and x.dtype == jnp.bfloat16 else x,
                         params_q)
        return p, _forward(config, dtype)

    (pb, fb), (pf, ff) = run("bfloat16"), run("float32")
    # one [rows, width] batch per dtype, right-padded (causal: padding after a row's tokens changes
    # none of its logits), width rounded up to 128: one compile per dtype for every call (a GPU compile
    # of the FP8 forward takes seconds; per-row shapes made this check run out of its time limit)
    seqs = [list(p) + list(g) for p, g in zip(prompts, generated)]
    width = -(-max(len(x) for x in seqs) // 128) * 128
    batch = jnp.asarray([x + [0] * (width - len(x)) for x in seqs], jnp.int32)
    all_b, all_f = np.asarray(fb(pb, batch), np.float64), np.asarray(ff(pf, batch), np.float64)
    hits = floor_hits = n = 0
    deltas, floor_deltas = [], []
    for i, (p, g, lp) in enumerate(zip(prompts, generated, logprobs)):
        if not g:
            continue
        rows = slice(len(p) - 1, len(p) - 1 + len(g))  # the positions predicting each generated token
        lb, lf = _logprob_rows(all_b[i, rows]), _logprob_rows(all_f[i, rows])
        idx = np.arange(len(g))
        hits += int((lb.argmax(-1) == np.asarray(g)).sum())
        floor_hits += int((lb.argmax(-1) == lf.argmax(-1)).sum())
        n += len(g)
        deltas.extend(np.abs(lb[idx, g] - np.asarray(lp, np.float64)).tolist())
        floor_deltas.extend(np.abs(lb[idx, g] - lf[idx, g]).tolist())

    def stats(d):
        d = np.asarray(d)
        return {"median": float(np.median(d)), "p99": float(np.quantile(d, 0.99)), "max": float(d.max()),
                "mean": float(d.mean())}

    return {"argmax_agreement": hits / max(n, 1), "positions": n, "logprob_abs_delta": stats(deltas),
            "floor_bf16_vs_f32": {"argmax_agreement": floor_hits / max(n, 1), "logprob_abs_delta": stats(floor_deltas)}}


def _engine(config, params, max_len: int) -> JaxEngine:
    return JaxEngine(config, params, EngineConfig(max_slots=8, page_size=16, num_pages=8 * max_len // 16 + 8,
                                                  max_seq_len=max_len, precision=Fp8Mode.W8A8, dtype="bfloat16"))


def small_check(workdir: Path, max_new: int = 48, enforce_eager: bool = True) -> dict:
    """Phase ``small`` (module docstring); returns its measurements."""
    config, max_len = SMALL, 256
    params = init_params(config, jax.random.key(0))
    other = init_params(config, jax.random.key(1))
    quant = jax.jit(lambda p: quantize_params(p, config))
    save_checkpoint(workdir, quant(params), config)
    vcfg = vb.VLLMConfig(str(workdir), max_model_len=max_len, enforce_eager=enforce_eager,
                         jax_memory_fraction=_JAX_FRACTION, gpu_memory_utilization=0.45)
    t0 = time.perf_counter()
    gen = vb.VLLMGenerator(config, vcfg)
    init_s = time.perf_counter() - t0
    prompts = _prompts(config.vocab_size, 8, seed=0)
    greedy = SamplingConfig(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    engine = _engine(config, params, max_len)

    theirs = gen.generate(prompts, greedy)
    ours = engine.generate(prompts, greedy)
    out = {"vllm_init_s": init_s, "model": {"layers": config.num_layers, "hidden": config.hidden_size,
                                            "vocab": config.vocab_size}, "max_new_tokens": max_new}
    out["greedy_vs_our_engine"] = agreement(ours.token_lists(), theirs.token_lists())
    out["teacher_forced"] = teacher_forced(quant(params), config, prompts, theirs.token_lists(),
                                           theirs.logprob_lists())
    # our engine's own logprobs against our forward, the same measure (the floor of the comparison)
    out["teacher_forced_our_engine"] = teacher_forced(quant(params), config, prompts, ours.token_lists(),
                                                      ours.logprob_lists())

    out["weight_update_path"] = gen.weight_update_path.value
    out["weight_update_reason"] = gen.weight_update_reason
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gen.update_weights(other)
        times.append(time.perf_counter() - t0)
    after = gen.generate(prompts, greedy)
    gen.update_weights(other, via=vb.WeightUpdate.RELOAD)  # vLLM's own reload of the same weights
    out["direct_equals_reload"] = gen.generate(prompts, greedy).token_lists() == after.token_lists()
    engine.update_weights(other)
    ours_after = engine.generate(prompts, greedy)
    changed = agreement(theirs.token_lists(), after.token_lists())
    out["after_update"] = {
        "changed_positions": 1 - changed["position_agreement"],
        "vs_our_engine": agreement(ours_after.token_lists(), after.token_lists()),
        "teacher_forced": teacher_forced(quant(other), config, prompts, after.token_lists(), after.logprob_lists()),
        "sync_ms": [t * 1e3 for t in times],
    }
    gen.update_weights(params)
    back = gen.generate(prompts, greedy)
    out["update_back_identical"] = back.token_lists() == theirs.token_lists()

    L = config.num_layers
    k, v = np.linspace(0.01, 0.02, L, dtype=np.float32), np.linspace(0.03, 0.04, L, dtype=np.float32)
    gen.set_kv_scales(k, v)
    got = gen.read_kv_scales()
    out["kv_scales_written"] = bool(np.allclose(got[0], k) and np.allclose(got[1], v))
    return out


def sync8b(workdir: Path, repeats: int = 5) -> dict:
    """Phase ``sync8b`` (module docstring)."""
    config = qwen3_8b
    params = init_params(config, jax.random.key(0), jnp.bfloat16)
    t0 = time.perf_counter()
    save_checkpoint(workdir, jax.jit(lambda p: quantize_params(p, config))(params), config)
    save_s = time.perf_counter() - t0
    vcfg = vb.VLLMConfig(str(workdir), max_model_len=2048, enforce_eager=True, kv_cache_dtype="fp8",
                         jax_memory_fraction=_JAX_FRACTION, gpu_memory_utilization=0.45)
    t0 = time.perf_counter()
    gen = vb.VLLMGenerator(config, vcfg)
    init_s = time.perf_counter() - t0
    prompts = _prompts(config.vocab_size, 4, seed=0, lo=64, hi=128)
    greedy = SamplingConfig(temperature=0.0, max_tokens=16, ignore_eos=True)
    toks = jnp.asarray(np.asarray([p[:64] for p in prompts], np.int32))
    def scales(p):  # trainer-side FP8 KV scales of params p (vLLM refuses to generate on stale ones)
        return calibrate_kv_scales_jit(p, toks, jnp.full((len(prompts),), 64, jnp.int32), config=config,
                                       policy=DensePolicy("bfloat16"))

    gen.set_kv_scales(*scales(params))
    before = gen.generate(prompts, greedy)
    other = init(jax.random.key(1))
    rows = {}
    paths = [vb.WeightUpdate.RELOAD] + ([vb.WeightUpdate.DIRECT] if gen.weight_update_path is vb.WeightUpdate.DIRECT
                                       else [])
    for via in paths:
        rows[via.value] = []
        for i in range(repeats + 1):  # the first includes the quantizer's compile (RELOAD's first)
            t0 = time.perf_counter()
            gen.update_weights(other if i % 2 == 0 else params, via=via)
            total = (time.perf_counter() - t0) * 1e3
            rows[via.value].append({"total_ms": total, "quantize_ms": gen.last_sync["quantize_s"] * 1e3,
                                    "load_ms": gen.last_sync["load_s"] * 1e3})
    k, v = scales(other)
    gen.update_weights(other, via=vb.WeightUpdate.RELOAD)
    gen.set_kv_scales(k, v)
    after_reload = gen.generate(prompts, greedy)
    gen.update_weights(other)
    t0 = time.perf_counter()
    gen.set_kv_scales(k, v)
    kv_ms = (time.perf_counter() - t0) * 1e3
    after = gen.generate(prompts, greedy)
    got = gen.read_kv_scales()
    return {
        "checkpoint_save_s": save_s, "vllm_init_s": init_s, "sync_runs": rows,
        "weight_update_path": gen.weight_update_path.value, "weight_update_reason": gen.weight_update_reason,
        "sync_ms_median": {path: {key: statistics.median(r[key] for r in runs[1:]) for key in runs[0]}
                           for path, runs in rows.items()},
        "set_kv_scales_ms": kv_ms,
        "kv_scales_written": bool(np.allclose(got[0], np.asarray(k)) and np.allclose(got[1], np.asarray(v))),
        "direct_equals_reload": after.token_lists() == after_reload.token_lists(),
        "tokens_changed_after_update": 1 - agreement(before.token_lists(), after.token_lists())["position_agreement"],
        "generated_after_update": [len(t) for t in after.token_lists()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=["small", "sync8b"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = small_check(Path(tmp)) if a.phase == "small" else sync8b(Path(tmp), a.repeats)
    res = {"environment": run_environment(), "phase": a.phase, **res}
    a.out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, default=str)[:4000])


if __name__ == "__main__":
    main()
