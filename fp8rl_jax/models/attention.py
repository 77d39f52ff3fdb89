"""Rotary embeddings and grouped-query attention (pure jnp).

This is the reference attention every faster kernel is tested against: softmax in float32,
``-inf``-free masking (masked logits get the float32 minimum, so a row is never all-NaN),
GQA by reshaping the N query heads into K groups of G. The KV caches live in ``kv_cache.py``.

A full-sequence forward (training, scoring, the trainer's logprob pass) attends causally within its
``T`` tokens through :func:`causal_attention`. Up to ``QUERY_BLOCK`` tokens that is ``dot_attention``
with the ``[B, T, T]`` causal mask; longer sequences go ``QUERY_BLOCK`` queries at a time, each block
building its own mask and ``[B, N, block, T]`` float32 scores under ``jax.checkpoint``, so the
forward and the backward hold one block's scores, not ``T^2`` of them (an RL response of 20k tokens
would need hundreds of GiB per sequence otherwise). Each row's math is ``dot_attention``'s: scores
over every key, the same masking and softmax.

On a GPU, a causal forward with no padded keys (the trainer's: its rows are right-padded, and a causal
query never sees a later key) runs cuDNN's fused flash attention instead (``jax.nn.dot_product_attention``,
``implementation="cudnn"``): no scores are stored at all, in the forward or the backward, and the
trainer's attention memory is linear in ``T`` at every length. ``FP8RL_TRAIN_ATTENTION=reference`` keeps
the jnp path there too (for comparisons); where cuDNN does not take the shapes, the jnp path runs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from fp8rl_jax.models.policy import matmul_precision

_MASK_VALUE = float(jnp.finfo(jnp.float32).min)
QUERY_BLOCK = 1024  # queries per block of causal_attention beyond this length


class CausalMask(NamedTuple):
    """The mask of a full-sequence forward, kept small: causal within the sequence, and ``key_valid``
    [B, T] bool (False: a padded key no query sees; None: every key is real)."""

    key_valid: jax.Array | None


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, H] in float32 for integer positions [B, T] (HF's non-interleaved layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H]; cos/sin [B, T, H] are cast to x's dtype first, as HF does."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = cos[:, :, None, :].astype(x.dtype)
    s = sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s


def dot_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA.

    q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S] (True = may attend) -> [B, T, N, H].
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    chex.assert_shape(k, (B, None, K, H))
    chex.assert_equal_shape([k, v])
    chex.assert_shape(mask, (B, T, k.shape[1]))
    qg = q.reshape(B, T, K, N // K, H)
    prec = matmul_precision(q.dtype)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=prec, preferred_element_type=jnp.float32) * (H**-0.5)
    logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, precision=prec, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, T, N, H)


def flash_attention_applies(q: jax.Array, key_valid: jax.Array | None) -> bool:
    """Whether :func:`causal_attention` hands ``q`` to cuDNN's flash attention (module note): a GPU backend,
    no padded keys, 16-bit activations, a head size cuDNN takes, and no ``FP8RL_TRAIN_ATTENTION=reference``."""
    return (key_valid is None and jax.default_backend() == "gpu"
            and os.environ.get("FP8RL_TRAIN_ATTENTION", "auto") != "reference"
            and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array | None = None, *,
                     block: int = QUERY_BLOCK) -> jax.Array:
    """Causal self-attention of a full sequence: q [B, T, N, H], k/v [B, T, K, H], ``key_valid`` [B, T]
    bool or None -> [B, T, N, H]; cuDNN's flash attention on a GPU (:func:`flash_attention_applies`), else
    ``block`` queries at a time when ``T > block`` (module note)."""
    B, T, N, H = q.shape
    if flash_attention_applies(q, key_valid):
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            pass  # shapes or a cuDNN version it does not take: the jnp path below
    if T <= block:
        return dot_attention(q, k, v, causal_mask(T, key_valid, B))
    n = -(-T // block)
    blocks = jnp.pad(q, ((0, 0), (0, n * block - T), (0, 0), (0, 0))).reshape(B, n, block, N, H).swapaxes(0, 1)
    keys = jnp.arange(T, dtype=jnp.int32)

    def one(args):
        qb, start = args
        mask = (start + jnp.arange(block, dtype=jnp.int32))[:, None] >= keys[None, :]
        mask = jnp.broadcast_to(mask[None], (B, block, T))
        if key_valid is not None:
            mask = mask & key_valid.astype(bool)[:, None, :]
        return dot_attention(qb, k, v, mask)

    out = jax.lax.map(jax.checkpoint(one), (blocks, jnp.arange(n, dtype=jnp.int32) * block))
    return out.swapaxes(0, 1).reshape(B, n * block, N, H)[:, :T]


def causal_mask(T: int, attention_mask: jax.Array | None, batch: int) -> jax.Array:
    """[B, T, T] causal mask; ``attention_mask`` [B, T] (1 = real token) masks padded keys."""
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))[None]
    if attention_mask is None:
        return jnp.broadcast_to(mask, (batch, T, T))
    return mask & attention_mask.astype(bool)[:, None, :]
