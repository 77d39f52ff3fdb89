"""Qwen3 and Qwen3-MoE in Flax NNX: one definition for the trainer and the generator.

The module tree mirrors the Hugging Face parameter names (``embed_tokens``, ``layers[i].self_attn
.q_proj``, ``mlp.experts`` ...), so the checkpoint table in ``fp8rl_jax.checkpoint`` is a plain
path mapping. Weights are stored ``[out, in]`` as in HF; MoE experts are stacked ``[E, out, in]``
and computed by sort-and-ragged-dot (``MatmulPolicy.ragged_dot``), never by a Python loop over
experts.

Two entry points share every layer:
- full sequence (training / scoring): ``model(tokens, positions, attention_mask)``;
- cached (decoding): ``model(tokens, cache=cache, num_new=...)`` with a ``KVCache`` or a
  ``PagedKVCache`` (BF16 or FP8; see ``kv_cache.py`` for the contract).

Precision is injected: each linear layer calls the ``MatmulPolicy`` with its ``Site``. Norms,
RoPE, softmax and the router softmax run in float32 and cast back, following HF's numerics.

The pure-function API at the bottom (``init_params``, ``abstract_params``, ``forward``) is what
the rest of the stack uses: parameters are an ``nnx.State`` pytree; the graph definition is
derived from (config, policy) and cached.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.models.attention import apply_rope, causal_mask, dot_attention, rope_cos_sin
from fp8rl_jax.models.kv_cache import KVCache, PagedKVCache
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.policy import DensePolicy, MatmulPolicy, Proj, Site, matmul_precision

_INIT_STD = 0.02  # HF's initializer_range for Qwen3


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); the normalization runs in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


class Linear(nnx.Module):
    """A bias-free projection, weight [out, in], multiplied through the policy."""

    def __init__(self, d_in: int, d_out: int, site: Site, policy: MatmulPolicy, *, param_dtype: Any, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (d_out, d_in), param_dtype))
        self.site = site
        self.policy = policy

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.policy.dot(x, self.weight.get_value(), self.site)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, policy: MatmulPolicy, *, param_dtype: Any, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        lin = functools.partial(Linear, policy=policy, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = lin(D, N * H, Site(layer, Proj.Q))
        self.k_proj = lin(D, K * H, Site(layer, Proj.K))
        self.v_proj = lin(D, K * H, Site(layer, Proj.V))
        self.o_proj = lin(N * H, D, Site(layer, Proj.O))
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.shape = (N, K, H)
        self.layer = layer

    def __call__(self, x, cos, sin, mask, cache, num_new):
        B, T, _ = x.shape
        N, K, H = self.shape
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(B, T, N, H)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(B, T, K, H)), cos, sin)
        v = self.v_proj(x).reshape(B, T, K, H)
        if cache is None:
            out = dot_attention(q, k, v, mask)
        else:
            out, cache = cache.attend(self.layer, q, k, v, num_new)
        return self.o_proj(out.reshape(B, T, N * H)), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int, f: int, layer: int, policy: MatmulPolicy, *, param_dtype: Any, rngs: nnx.Rngs):
        lin = functools.partial(Linear, policy=policy, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = lin(d, f, Site(layer, Proj.GATE))
        self.up_proj = lin(d, f, Site(layer, Proj.UP))
        self.down_proj = lin(f, d, Site(layer, Proj.DOWN))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nnx.Module):
    """E SwiGLU experts, weights stacked [E, out, in]; rows arrive sorted by expert."""

    def __init__(self, e: int, d: int, i: int, layer: int, policy: MatmulPolicy, *, param_dtype: Any, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(_normal(rngs, (e, i, d), param_dtype))
        self.up_proj = nnx.Param(_normal(rngs, (e, i, d), param_dtype))
        self.down_proj = nnx.Param(_normal(rngs, (e, d, i), param_dtype))
        self.layer = layer
        self.policy = policy

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        rd, layer = self.policy.ragged_dot, self.layer
        g = rd(x, self.gate_proj.get_value(), group_sizes, Site(layer, Proj.EXPERT_GATE))
        u = rd(x, self.up_proj.get_value(), group_sizes, Site(layer, Proj.EXPERT_UP))
        return rd(jax.nn.silu(g) * u, self.down_proj.get_value(), group_sizes, Site(layer, Proj.EXPERT_DOWN))


class MoE(nnx.Module):
    """Softmax router, top-k (optionally renormalized), sort-and-segment grouped expert matmuls."""

    def __init__(self, cfg: ModelConfig, layer: int, policy: MatmulPolicy, *, param_dtype: Any, rngs: nnx.Rngs):
        D, E = cfg.hidden_size, cfg.num_experts
        self.gate = Linear(D, E, Site(layer, Proj.ROUTER), policy, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(E, D, cfg.moe_intermediate_size, layer, policy, param_dtype=param_dtype, rngs=rngs)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.num_experts = E

    def __call__(self, x: jax.Array) -> jax.Array:
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        probs = jax.nn.softmax(self.gate(xf).astype(jnp.float32), axis=-1)  # [M, E]
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [M, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        flat = experts.reshape(-1)  # [M * k], assignment a belongs to token a // k
        order = jnp.argsort(flat, stable=True)
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        y_sorted = self.experts(xf[order // self.top_k], group_sizes)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        y = y_sorted[inverse].reshape(B * T, self.top_k, D)
        out = jnp.einsum("mkd,mk->md", y, weights.astype(x.dtype), precision=matmul_precision(x.dtype),
                         preferred_element_type=jnp.float32)
        return out.astype(x.dtype).reshape(B, T, D)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, policy: MatmulPolicy, *, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, layer, policy, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if cfg.layer_is_moe(layer):
            self.mlp = MoE(cfg, layer, policy, **kw)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, layer, policy, **kw)

    def __call__(self, x, cos, sin, mask, cache, num_new):
        a, cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, num_new)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Embed(nnx.Module):
    def __init__(self, v: int, d: int, *, param_dtype: Any, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (v, d), param_dtype))

    def __call__(self, tokens: jax.Array, dtype: Any) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0).astype(dtype)


def _remat_layer(layer: DecoderLayer, x, cos, sin, mask) -> jax.Array:
    """``layer`` on the full sequence under ``jax.checkpoint``: its activations are recomputed
    in the backward pass instead of being stored (the layer's weights enter as explicit inputs)."""
    gdef, state = nnx.split(layer)

    @jax.checkpoint
    def run(state, x, cos, sin, mask):
        return nnx.merge(gdef, state)(x, cos, sin, mask, None, None)[0]

    return run(state, x, cos, sin, mask)


class Qwen3(nnx.Module):
    """Qwen3 / Qwen3-MoE causal LM. ``policy`` decides the precision of every matmul."""

    def __init__(
        self,
        config: ModelConfig,
        policy: MatmulPolicy = DensePolicy(),
        *,
        param_dtype: Any = jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        cfg = config
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.config = cfg
        self.policy = policy
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nnx.List([DecoderLayer(cfg, i, policy, **kw) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, Site(None, Proj.LM_HEAD), policy, **kw)

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: KVCache | PagedKVCache | None = None,
        num_new: jax.Array | None = None,
        *,
        remat: bool = False,
    ) -> tuple[jax.Array, KVCache | PagedKVCache | None]:
        """Final-norm hidden states [B, T, D] (compute dtype) and the updated cache.

        Full sequence (``cache is None``): causal attention within ``tokens``; ``attention_mask``
        [B, T] (1 = real) hides padded keys; ``positions`` default to 0..T-1.
        Cached: the T tokens continue each row at ``cache.lengths``; ``positions`` default to
        ``lengths + 0..T-1``; ``num_new`` [B] (default T) real tokens per row advance the cache.
        ``remat`` (full sequence only) rematerializes each decoder layer in the backward pass
        (``jax.checkpoint`` per layer: only the layer inputs are kept for the gradient).
        """
        cfg = self.config
        if remat and cache is not None:
            raise ValueError("remat is for full-sequence (training) calls; a cached call has no backward pass")
        chex.assert_rank(tokens, 2)
        chex.assert_type(tokens, int)
        B, T = tokens.shape
        if cache is not None and attention_mask is not None:
            raise ValueError("attention_mask is for full-sequence calls; a cached call uses num_new for padding")
        start = 0 if cache is None else cache.lengths[:, None]
        if positions is None:
            positions = start + jnp.arange(T, dtype=jnp.int32)[None, :]
        positions = jnp.broadcast_to(positions, (B, T))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        mask = causal_mask(T, attention_mask, B) if cache is None else None
        num_new = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.broadcast_to(num_new, (B,))
        x = self.embed_tokens(tokens, self.policy.compute_dtype)
        for layer in self.layers:
            if remat:
                x = _remat_layer(layer, x, cos, sin, mask)
            else:
                x, cache = layer(x, cos, sin, mask, cache, num_new)
        if cache is not None:
            cache = cache.advance(num_new)
        return self.norm(x), cache

    def logits(self, h: jax.Array) -> jax.Array:
        """float32 logits [..., V] from final hidden states."""
        if self.config.tie_word_embeddings:
            w = self.embed_tokens.weight.get_value()
            return self.policy.dot(h, w, Site(None, Proj.LM_HEAD)).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, tokens, positions=None, attention_mask=None, cache=None, num_new=None, *, remat=False):
        h, cache = self.hidden_states(tokens, positions, attention_mask, cache, num_new, remat=remat)
        return self.logits(h), cache

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        cfg = self.config
        dtype = self.policy.compute_dtype if dtype is None else dtype
        return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)


# ---------------------------------------------------------------------------- functional API


@functools.lru_cache(maxsize=64)
def _graphdef_and_abstract(config: ModelConfig, policy: MatmulPolicy, param_dtype: str):
    model = nnx.eval_shape(lambda: Qwen3(config, policy, param_dtype=jnp.dtype(param_dtype), rngs=nnx.Rngs(0)))
    return nnx.split(model)


def graphdef(config: ModelConfig, policy: MatmulPolicy = DensePolicy()) -> nnx.GraphDef:
    """The static structure of the model for (config, policy); parameters live apart."""
    return _graphdef_and_abstract(config, policy, "float32")[0]


def abstract_params(config: ModelConfig, param_dtype: Any = jnp.bfloat16) -> nnx.State:
    """Parameter shapes and dtypes (``jax.ShapeDtypeStruct`` leaves) without allocating."""
    return _graphdef_and_abstract(config, DensePolicy(), jnp.dtype(param_dtype).name)[1]


def init_params(config: ModelConfig, key: jax.Array, param_dtype: Any = jnp.bfloat16) -> nnx.State:
    """Random parameters (HF's init: normal(0, 0.02) weights, ones for norms)."""

    @jax.jit
    def make(key):
        return nnx.state(Qwen3(config, param_dtype=param_dtype, rngs=nnx.Rngs(params=key)), nnx.Param)

    return make(key)


def bind(params: nnx.State, config: ModelConfig, policy: MatmulPolicy = DensePolicy()) -> Qwen3:
    """The model object for ``params`` under ``policy`` (call inside jit)."""
    return nnx.merge(graphdef(config, policy), params)


def forward(
    params: nnx.State,
    tokens: jax.Array,
    *,
    config: ModelConfig,
    policy: MatmulPolicy = DensePolicy(),
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    cache: KVCache | PagedKVCache | None = None,
    num_new: jax.Array | None = None,
    remat: bool = False,
) -> tuple[jax.Array, KVCache | PagedKVCache | None]:
    """Pure forward: float32 logits [B, T, V] and the updated cache (None without one).
    ``remat``: recompute each layer's activations in the backward pass (training memory)."""
    return bind(params, config, policy)(tokens, positions, attention_mask, cache, num_new, remat=remat)


def count_params(params: nnx.State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
