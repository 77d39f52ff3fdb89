"""Rotary embeddings, grouped-query attention and the contiguous KV cache (pure jnp).

This is the reference attention every faster kernel is tested against: softmax in float32,
``-inf``-free masking (masked logits get the float32 minimum, so a row is never all-NaN),
GQA by reshaping the N query heads into K groups of G.

``KVCache`` is the cached-decode state of the one model: per layer ``k``/``v`` buffers
[B, S, K, H] and per-row ``lengths`` [B] (tokens already written). A cached forward writes the
T new tokens of row b at ``lengths[b] .. lengths[b] + T - 1`` and lets query t see keys
``j <= lengths[b] + t``. Right-padded chunks are allowed: the caller advances ``lengths`` by
each row's count of real tokens, so the padding written past it is overwritten by the next
step before any real query can see it. The paged cache of the rollout engine replaces the
buffers, not this contract.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

_MASK_VALUE = float(jnp.finfo(jnp.float32).min)


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
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * (H**-0.5)
    logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, T, N, H)


def causal_mask(T: int, attention_mask: jax.Array | None, batch: int) -> jax.Array:
    """[B, T, T] causal mask; ``attention_mask`` [B, T] (1 = real token) masks padded keys."""
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))[None]
    if attention_mask is None:
        return jnp.broadcast_to(mask, (batch, T, T))
    return mask & attention_mask.astype(bool)[:, None, :]


@struct.dataclass
class KVCache:
    """Contiguous KV cache for cached decoding with the one model definition.

    Attributes:
      k: per layer, keys [B, S, K, H] after k-norm and RoPE.
      v: per layer, values [B, S, K, H].
      lengths: [B] int32, tokens already in the cache per row (the next write position).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, max_len, num_kv_heads, head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def advance(self, num_new: jax.Array) -> "KVCache":
        """Counts ``num_new`` [B] (or a scalar) real tokens as written."""
        return self.replace(lengths=self.lengths + jnp.asarray(num_new, jnp.int32))


def cached_attention(
    q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes k/v_new [B, T, K, H] at ``lengths`` and attends q [B, T, N, H] over the cache.

    The write is clamped by ``dynamic_update_slice`` when ``lengths + T > S``: callers must keep
    ``lengths + T <= S`` (the engine checks its capacity on the host).
    Returns (out [B, T, N, H], new k cache, new v cache).
    """
    B, T = q.shape[:2]
    S = k_cache.shape[1]
    write = jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, 0, 0)))
    k_cache = write(k_cache, k_new, lengths)
    v_cache = write(v_cache, v_new, lengths)
    q_pos = lengths[:, None] + jnp.arange(T)[None, :]
    mask = jnp.arange(S)[None, None, :] <= q_pos[:, :, None]
    out = dot_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
    return out, k_cache, v_cache
