"""FP8 KV-cache scales calibrated from a forward pass of the model (above both the cache and the model).

The scales are dequantization multipliers per layer, ``percentile(|x|) * margin / fmt_max``, taken
where the cache stores K and V (after k-norm and RoPE). The trainer calls
:func:`calibrate_kv_scales` on its calibration batch; the engine and the vLLM backend call
:data:`calibrate_kv_scales_jit` on :func:`calibration_batch` of their first prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.models.kv_cache import KVCache
from fp8rl_jax.models.qwen3 import forward


def calibrate_kv_scales(params, tokens, lengths, *, config, policy, percentile: float = 99.9,
                        margin: float = 1.05, fmt_max: float = 448.0, rows_per_pass: int = 4
                        ) -> tuple[jax.Array, jax.Array]:
    """Per-layer FP8 K/V scales from a forward pass: ``percentile(|x|) * margin / fmt_max``.

    Runs the model on ``tokens`` [B, T] (``lengths`` [B] real tokens per row) with a contiguous
    cache, so K and V are taken exactly where the cache stores them: after k-norm and RoPE. The
    percentile (default p99.9, x1.05) ignores rare outliers that an amax would let set the
    scale; larger values saturate at the FP8 maximum. Trainer-side calibration calls this with
    the trainer's params and policy on a calibration batch; inference-side, the engine calls it
    with its own on the first prompts after a weight update. Returns (k_scale [L], v_scale [L]).

    Memory: the forward runs ``rows_per_pass`` rows at a time (``lax.map``; rows are padded with
    empty ones), the caches are kept in the compute dtype (the dtype K and V are computed in) and
    only one position's logits are made, so what stays live is the K/V of all rows (16 x 1024 tokens
    of Qwen3-8B: 2 x 1.2 GiB in BF16) and one pass's activations.
    """
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)
    B, T = tokens.shape
    r = min(rows_per_pass, B)
    passes = -(-B // r)
    pad = passes * r - B
    tok = jnp.pad(tokens, ((0, pad), (0, 0))).reshape(passes, r, T)
    lens = jnp.pad(lengths, (0, pad)).reshape(passes, r)  # padded rows: length 0, nothing valid

    def one_pass(args):
        t, n = args
        cache = KVCache.init(config.num_layers, r, T, config.num_kv_heads, config.head_dim, policy.compute_dtype)
        _, cache = forward(params, t, config=config, policy=policy, cache=cache, num_new=n,
                           logits_at=jnp.zeros((r,), jnp.int32))
        return jnp.stack(cache.k), jnp.stack(cache.v)  # [L, r, T, K, H] each

    k, v = jax.lax.map(one_pass, (tok, lens))  # [passes, L, r, T, K, H]
    valid = (jnp.arange(T)[None, None, :] < lens[:, :, None])[..., None, None]  # [passes, r, T, 1, 1]

    def scales(x):
        # one layer at a time (lax.map): a percentile sorts its input, and 2 x L sorts live at once
        # do not fit next to an FP8 KV pool at Qwen3-8B size
        per_layer = lambda xl: jnp.nanpercentile(  # noqa: E731
            jnp.where(valid, jnp.abs(xl.astype(jnp.float32)), jnp.nan), percentile)
        vals = jax.lax.map(per_layer, jnp.moveaxis(x, 1, 0))
        return jnp.maximum(vals * margin, 1e-12) / fmt_max

    return scales(k), scales(v)


calibrate_kv_scales_jit = jax.jit(calibrate_kv_scales, static_argnames=(
    "config", "policy", "percentile", "margin", "fmt_max", "rows_per_pass"))
"""``calibrate_kv_scales`` jitted once for every caller (engine, RL loop, vLLM backend, benchmarks)."""


def calibration_batch(prompts: Sequence[Sequence[int]], rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Inference-side calibration input: the first ``rows`` prompts right-padded to ``width``, as
    ([rows, width] int32 tokens, [rows] int32 lengths). Always ``rows`` rows (the missing ones of
    length 0, ignored by the percentile), so one compiled calibration serves every batch size at
    this width."""
    sample = [list(p)[:width] for p in prompts[:rows]]
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.zeros((rows,), np.int32)
    for i, p in enumerate(sample):
        tokens[i, : len(p)], lengths[i] = p, len(p)
    return tokens, lengths
