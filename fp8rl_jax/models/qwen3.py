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

MoE routing replay: ``forward_with_routing`` also returns the experts every token chose
(``[B, T, L_moe, k]`` int32), and ``forward(..., routing=...)`` sends the tokens through given
experts instead of the router's top-k, with the gate weights still taken from the router's
softmax (design note in ``forward_with_routing``). With ``routing=None`` nothing changes.

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

from fp8rl_jax.models.attention import CausalMask, apply_rope, causal_attention, rope_cos_sin
from fp8rl_jax.models.kv_cache import KVCache, PagedKVCache
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.fusion import FusedWeight, fused_ragged_dot, split_fused
from fp8rl_jax.models.policy import DensePolicy, MatmulPolicy, Proj, Site, matmul_precision, rms_norm

_INIT_STD = 0.02  # HF's initializer_range for Qwen3


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); the normalization runs in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


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
        """Attention of the layer's normalized input ``x`` [B, T, D]: ``(out, cache)``."""
        wq = self.q_proj.weight.get_value()
        if isinstance(wq, FusedWeight):  # the generator's layout: [q; k; v] in one GEMM (fusion.py)
            return self._attend_fused(self.q_proj.policy.dot(x, wq.w, self.q_proj.site), wq, cos, sin, mask, cache,
                                      num_new)
        return self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, mask, cache, num_new)

    def norm_call(self, x, norm: RMSNorm, residual, cos, sin, mask, cache, num_new):
        """``(h, out, cache)``: the residual stream ``h = x + residual`` (``x`` when None) and the attention of
        ``norm(h)``. The fused layout's q/k/v GEMM takes the add and the norm through ``policy.norm_dot`` (an FP8
        policy runs them in its input quantization); otherwise the same ops as ``self(norm(h))``."""
        wq = self.q_proj.weight.get_value()
        if isinstance(wq, FusedWeight):
            h, y = self.q_proj.policy.norm_dot(x, norm.weight[...], norm.eps, wq.w, self.q_proj.site, residual)
            out, cache = self._attend_fused(y, wq, cos, sin, mask, cache, num_new)
        else:
            h = x if residual is None else x + residual
            xn = norm(h)
            out, cache = self._attend(self.q_proj(xn), self.k_proj(xn), self.v_proj(xn), cos, sin, mask, cache, num_new)
        return h, out, cache

    def _attend_fused(self, y, wq: FusedWeight, cos, sin, mask, cache, num_new):
        """`_attend` of the fused q/k/v GEMM's output ``y`` [B, T, (N + 2K) H]. A decode step over a paged cache
        that allows it (`PagedKVCache.qkv_kernel`) runs the q/k norms, RoPE and the KV write as one kernel on
        ``y`` itself; otherwise ``y`` is split and the separate ops run."""
        B, T, _ = y.shape
        N, K, H = self.shape
        if isinstance(cache, PagedKVCache) and cache.qkv_kernel(T, N, H):
            out, cache = cache.attend_qkv(self.layer, y, self.q_norm.weight[...], self.k_norm.weight[...],
                                          (self.q_norm.eps, self.k_norm.eps), cos, sin, num_new, N)
            return self.o_proj(out.reshape(B, T, N * H)), cache
        return self._attend(*split_fused(y, wq), cos, sin, mask, cache, num_new)

    def _attend(self, q, k, v, cos, sin, mask, cache, num_new):
        B, T, _ = q.shape
        N, K, H = self.shape
        q = apply_rope(self.q_norm(q.reshape(B, T, N, H)), cos, sin)
        k = apply_rope(self.k_norm(k.reshape(B, T, K, H)), cos, sin)
        v = v.reshape(B, T, K, H)
        if cache is None:
            out = causal_attention(q, k, v, mask.key_valid)
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
        wg = self.gate_proj.weight.get_value()
        if isinstance(wg, FusedWeight):  # the generator's layout: [gate; up] in one GEMM (fusion.py)
            if wg.sizes[0] != wg.sizes[1]:
                raise ValueError(f"fused gate/up parts must be equal, got sizes {wg.sizes}")
            gu = self.gate_proj.policy.dot(x, wg.w, self.gate_proj.site)  # [g | u]
            return self.down_proj.policy.swiglu_dot(gu, self.down_proj.weight.get_value(), self.down_proj.site)
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(jax.nn.silu(g) * u)

    def norm_call(self, x: jax.Array, norm: RMSNorm, residual: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """``(h, y)``: ``h = x + residual`` (``x`` when None) and the MLP of ``norm(h)``; the fused layout's gate/up
        GEMM takes the add and the norm through ``policy.norm_dot`` (`Attention.norm_call`)."""
        wg = self.gate_proj.weight.get_value()
        if isinstance(wg, FusedWeight):
            if wg.sizes[0] != wg.sizes[1]:
                raise ValueError(f"fused gate/up parts must be equal, got sizes {wg.sizes}")
            h, gu = self.gate_proj.policy.norm_dot(x, norm.weight[...], norm.eps, wg.w, self.gate_proj.site, residual)
            return h, self.down_proj.policy.swiglu_dot(gu, self.down_proj.weight.get_value(), self.down_proj.site)
        h = x if residual is None else x + residual
        return h, self(norm(h))


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
        wg = self.gate_proj.get_value()
        if isinstance(wg, FusedWeight):  # the generator's layout: [gate; up] of each expert in one grouped GEMM
            g, u = fused_ragged_dot(self.policy, x, wg, group_sizes, Site(layer, Proj.EXPERT_GATE))
        else:
            g = rd(x, wg, group_sizes, Site(layer, Proj.EXPERT_GATE))
            u = rd(x, self.up_proj.get_value(), group_sizes, Site(layer, Proj.EXPERT_UP))
        return rd(jax.nn.silu(g) * u, self.down_proj.get_value(), group_sizes, Site(layer, Proj.EXPERT_DOWN))


class MoE(nnx.Module):
    """Softmax router, top-k (optionally renormalized), sort-and-segment grouped expert matmuls.

    Routing replay (``apply``): ``replay`` [B, T, k] int32 expert ids replace the router's top-k
    for the tokens where they are valid (k distinct ids in ``[0, E)``); elsewhere (padding, ``-1``
    = "not recorded", malformed rows) the router's own top-k decides. The router softmax always
    runs, and the gate weights are the router probabilities *of the selected experts*,
    renormalized over them when ``norm_topk_prob`` (HF's top-k renormalization applied to the
    replayed set), so the gradient reaches the router exactly as it would had top-k picked them.
    The ids are used in the order given (the recording order is top-k's, descending), which keeps
    a replay of the model's own choices bitwise identical to no replay.
    """

    def __init__(self, cfg: ModelConfig, layer: int, policy: MatmulPolicy, *, param_dtype: Any, rngs: nnx.Rngs):
        D, E = cfg.hidden_size, cfg.num_experts
        self.gate = Linear(D, E, Site(layer, Proj.ROUTER), policy, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(E, D, cfg.moe_intermediate_size, layer, policy, param_dtype=param_dtype, rngs=rngs)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.num_experts = E

    def route(self, xf: jax.Array, replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Gate weights [M, k] float32 and expert ids [M, k] int32 of tokens ``xf`` [M, D];
        ``replay`` [M, k] int32 (optional) overrides top-k on its valid rows (class docstring)."""
        probs = jax.nn.softmax(self.gate(xf).astype(jnp.float32), axis=-1)  # [M, E]
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [M, k]
        experts = experts.astype(jnp.int32)
        if replay is not None:
            replay = replay.astype(jnp.int32)
            ordered = jnp.sort(replay, axis=-1)
            valid = (jnp.all((replay >= 0) & (replay < self.num_experts), axis=-1)
                     & jnp.all(ordered[:, 1:] != ordered[:, :-1], axis=-1))
            experts = jnp.where(valid[:, None], replay, experts)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts

    def apply(self, x: jax.Array, replay: jax.Array | None = None, token_mask: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array]:
        """``(y [B, T, D], experts [B, T, k] int32)``: the block's output and the experts each
        token used (``-1`` where ``token_mask`` [B, T] is false: padding chose nothing worth
        recording). ``replay`` [B, T, k]: see the class docstring."""
        B, T, D = x.shape
        if replay is not None and replay.shape != (B, T, self.top_k):
            raise ValueError(f"routing replay for this MoE layer must have shape [B, T, top_k] = "
                             f"{(B, T, self.top_k)}, got {replay.shape}")
        xf = x.reshape(B * T, D)
        weights, experts = self.route(xf, None if replay is None else replay.reshape(B * T, self.top_k))
        flat = experts.reshape(-1)  # [M * k], assignment a belongs to token a // k
        order = jnp.argsort(flat, stable=True)
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        y_sorted = self.experts(xf[order // self.top_k], group_sizes)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        y = y_sorted[inverse].reshape(B * T, self.top_k, D)
        out = jnp.einsum("mkd,mk->md", y, weights.astype(x.dtype), precision=matmul_precision(x.dtype),
                         preferred_element_type=jnp.float32)
        experts = experts.reshape(B, T, self.top_k)
        if token_mask is not None:
            experts = jnp.where(token_mask[..., None], experts, -1)
        return out.astype(x.dtype).reshape(B, T, D), experts

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.apply(x)[0]


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
        x, cache, _ = self.routed(x, cos, sin, mask, cache, num_new)
        return x, cache

    def routed(self, x, cos, sin, mask, cache, num_new, replay=None, token_mask=None):
        """``__call__`` that also returns the experts of an MoE layer ([B, T, k] int32; None for a
        dense MLP) and replays ``replay`` [B, T, k] (``MoE.apply``)."""
        x, y, cache, experts = self.deferred(x, None, cos, sin, mask, cache, num_new, replay, token_mask)
        return x + y, cache, experts

    def deferred(self, x, residual, cos, sin, mask, cache, num_new, replay=None, token_mask=None):
        """`routed` with the residual adds moved to the consumers: the layer's input is ``x + residual`` (``x``
        when None) and it returns ``(h, y, cache, experts)``, its output being ``h + y``. The model's layer loop
        hands ``y`` on as the next layer's ``residual``, so every add lands in front of an RMSNorm, where an FP8
        policy fuses add, norm and quantization into one kernel (`MatmulPolicy.norm_dot`); otherwise these are the
        same ops in the same order as before."""
        x, a, cache = self.self_attn.norm_call(x, self.input_layernorm, residual, cos, sin, mask, cache, num_new)
        if isinstance(self.mlp, MoE):
            x = x + a
            y, experts = self.mlp.apply(self.post_attention_layernorm(x), replay, token_mask)
        else:
            (x, y), experts = self.mlp.norm_call(x, self.post_attention_layernorm, a), None
        return x, y, cache, experts


class Embed(nnx.Module):
    def __init__(self, v: int, d: int, *, param_dtype: Any, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (v, d), param_dtype))

    def __call__(self, tokens: jax.Array, dtype: Any) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0).astype(dtype)


def _remat_layer(layer: DecoderLayer, x, cos, sin, mask, replay=None, token_mask=None):
    """``layer.routed`` on the full sequence under ``jax.checkpoint``: its activations are
    recomputed in the backward pass instead of being stored (the layer's weights enter as
    explicit inputs). Returns ``(x, experts)``."""
    gdef, state = nnx.split(layer)

    @jax.checkpoint
    def run(state, x, cos, sin, mask, replay, token_mask):
        y, _, experts = nnx.merge(gdef, state).routed(x, cos, sin, mask, None, None, replay, token_mask)
        return y, experts

    return run(state, x, cos, sin, mask, replay, token_mask)


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
        routing: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | PagedKVCache | None]:
        """Final-norm hidden states [B, T, D] (compute dtype) and the updated cache.

        Full sequence (``cache is None``): causal attention within ``tokens``; ``attention_mask``
        [B, T] (1 = real) hides padded keys; ``positions`` default to 0..T-1.
        Cached: the T tokens continue each row at ``cache.lengths``; ``positions`` default to
        ``lengths + 0..T-1``; ``num_new`` [B] (default T) real tokens per row advance the cache.
        ``remat`` (full sequence only) rematerializes each decoder layer in the backward pass
        (``jax.checkpoint`` per layer: only the layer inputs are kept for the gradient).
        ``routing`` [B, T, L_moe, k] int32 (MoE only, optional): experts to replay per token and
        MoE layer instead of the router's top-k (``MoE`` docstring; ``-1`` = let the router decide).
        """
        h, cache, _ = self.hidden_states_and_routing(tokens, positions, attention_mask, cache, num_new, remat=remat,
                                                     routing=routing)
        return h, cache

    def hidden_states_and_routing(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: KVCache | PagedKVCache | None = None,
        num_new: jax.Array | None = None,
        *,
        remat: bool = False,
        routing: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | PagedKVCache | None, jax.Array | None]:
        """:meth:`hidden_states` plus the experts every token used, ``[B, T, L_moe, k]`` int32 in
        the order of :func:`moe_layers` (None for a dense model); ``-1`` on padding (positions
        where ``attention_mask`` is 0, or at/after ``num_new`` in a cached call)."""
        cfg = self.config
        if remat and cache is not None:
            raise ValueError("remat is for full-sequence (training) calls; a cached call has no backward pass")
        chex.assert_rank(tokens, 2)
        chex.assert_type(tokens, int)
        B, T = tokens.shape
        if cache is not None and attention_mask is not None:
            raise ValueError("attention_mask is for full-sequence calls; a cached call uses num_new for padding")
        if routing is not None:
            check_routing_shape(routing, cfg, B, T)
        start = 0 if cache is None else cache.lengths[:, None]
        if positions is None:
            positions = start + jnp.arange(T, dtype=jnp.int32)[None, :]
        positions = jnp.broadcast_to(positions, (B, T))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        mask = None
        if cache is None:
            mask = CausalMask(None if attention_mask is None else jnp.broadcast_to(attention_mask, (B, T)) != 0)
        num_new = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.broadcast_to(num_new, (B,))
        if cache is None:
            token_mask = None if attention_mask is None else jnp.broadcast_to(attention_mask, (B, T)) != 0
        else:
            token_mask = jnp.arange(T, dtype=jnp.int32)[None, :] < num_new[:, None]
        x = self.embed_tokens(tokens, self.policy.compute_dtype)
        chosen, j = [], 0
        y = None  # the last layer's output is x + y (DecoderLayer.deferred); remat layers add it themselves
        for layer in self.layers:
            replay = None
            if routing is not None and isinstance(layer.mlp, MoE):
                replay = routing[:, :, j]
            if remat:
                x, experts = _remat_layer(layer, x, cos, sin, mask, replay, token_mask)
            else:
                x, y, cache, experts = layer.deferred(x, y, cos, sin, mask, cache, num_new, replay, token_mask)
            if experts is not None:
                chosen.append(experts)
                j += 1
        if cache is not None:
            cache = cache.advance(num_new)
        x = x if y is None else x + y
        return self.norm(x), cache, (jnp.stack(chosen, axis=2) if chosen else None)

    def logits(self, h: jax.Array) -> jax.Array:
        """float32 logits [..., V] from final hidden states."""
        if self.config.tie_word_embeddings:
            w = self.embed_tokens.weight.get_value()
            return self.policy.dot(h, w, Site(None, Proj.LM_HEAD)).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, tokens, positions=None, attention_mask=None, cache=None, num_new=None, *, remat=False,
                 routing=None, logits_at=None):
        h, cache = self.hidden_states(tokens, positions, attention_mask, cache, num_new, remat=remat, routing=routing)
        return self.logits(_rows_at(h, logits_at)), cache

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        cfg = self.config
        dtype = self.policy.compute_dtype if dtype is None else dtype
        return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)


def _rows_at(h: jax.Array, logits_at: jax.Array | None) -> jax.Array:
    """``h`` [B, T, D], or with ``logits_at`` [B] int32 only position ``logits_at[b]`` of each row
    ([B, 1, D]): a prefill needs the last prompt position's logits, not [B, T, V] of them."""
    if logits_at is None:
        return h
    chex.assert_shape(logits_at, (h.shape[0],))
    return jnp.take_along_axis(h, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)


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


@functools.lru_cache(maxsize=256)
def _leaf_init(shape: tuple[int, ...], dtype: str):
    """One jitted initializer per leaf shape: RMSNorm weights (the model's only 1-D parameters) are
    ones, every other weight normal(0, 0.02) drawn in float32, as :func:`_normal` does."""
    if len(shape) == 1:
        return jax.jit(lambda key: jnp.ones(shape, dtype))
    return jax.jit(lambda key: (_INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype))


def init_params(config: ModelConfig, key: jax.Array, param_dtype: Any = jnp.bfloat16) -> nnx.State:
    """Random parameters (HF's init: normal(0, 0.02) weights, ones for norms), one key per leaf.

    Leaf by leaf, each shape compiled once: the whole model's init as one program takes minutes to
    compile at Qwen3-30B-A3B size, and a model has only a handful of distinct leaf shapes. Also callable
    inside ``jax.jit``."""
    abstract = abstract_params(config, param_dtype)
    leaves, treedef = jax.tree.flatten(abstract)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [_leaf_init(tuple(x.shape), jnp.dtype(x.dtype).name)(keys[i])
                                        for i, x in enumerate(leaves)])


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
    routing: jax.Array | None = None,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | PagedKVCache | None]:
    """Pure forward: float32 logits [B, T, V] and the updated cache (None without one).
    ``logits_at`` [B] int32: only the logits at that position of each row, [B, 1, V] (a prefill
    samples from the last prompt position; the whole [B, T, V] would cost memory and FLOPs).
    ``remat``: recompute each layer's activations in the backward pass (training memory).
    ``routing`` [B, T, L_moe, k] int32: MoE routing replay (see :func:`forward_with_routing`);
    None (the default) routes by the router's top-k. Replay on/off is static under jit (None or
    an array), so each setting compiles once."""
    return bind(params, config, policy)(tokens, positions, attention_mask, cache, num_new, remat=remat,
                                        routing=routing, logits_at=logits_at)


def forward_with_routing(
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
    routing: jax.Array | None = None,
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | PagedKVCache | None, jax.Array]:
    """:func:`forward` that also returns the experts each token used: ``(logits, cache, experts)``
    with ``experts`` [B, T, L_moe, k] int32, ``L_moe = len(moe_layers(config))`` in layer order and
    the k ids of a token in the router's top-k order (descending probability); ``-1`` on padding
    (``attention_mask == 0``; cached calls: positions at or after ``num_new``).

    Routing replay design: the generator records ``experts`` while it samples, and the trainer
    passes them back as ``routing``, so both forwards send every token through the same experts
    and router disagreement (a top-k flip from a slightly different router input, e.g. FP8
    rollout vs BF16 trainer) drops out of the train/inference mismatch. The router still runs:
    the gate weights are its probabilities of the replayed experts (renormalized as HF does when
    ``norm_topk_prob``), so the router keeps learning. Per token, a replay row that is not k
    distinct ids in ``[0, E)`` (e.g. ``-1``: not recorded) falls back to the router's top-k. A
    dense model (no MoE layer) has nothing to record: ValueError."""
    if not moe_layers(config):
        raise ValueError("forward_with_routing needs an MoE model; this config has no MoE layer (num_experts = 0)")
    model = bind(params, config, policy)
    h, cache, experts = model.hidden_states_and_routing(tokens, positions, attention_mask, cache, num_new,
                                                        remat=remat, routing=routing)
    return model.logits(_rows_at(h, logits_at)), cache, experts


def moe_layers(config: ModelConfig) -> tuple[int, ...]:
    """Indices of the MoE decoder layers: axis 2 of a routing array follows this order."""
    return tuple(i for i in range(config.num_layers) if config.layer_is_moe(i))


def check_routing_shape(routing: Any, config: ModelConfig, batch: int, length: int) -> None:
    """Trace-time check that ``routing`` is an integer ``[B, T, L_moe, k]`` array for ``config``."""
    want = (batch, length, len(moe_layers(config)), config.num_experts_per_tok)
    if not moe_layers(config):
        raise ValueError("routing replay needs an MoE model; this config has no MoE layer (num_experts = 0)")
    if tuple(jnp.shape(routing)) != want or not jnp.issubdtype(jnp.result_type(routing), jnp.integer):
        raise ValueError(f"routing must be an integer [B, T, L_moe, top_k] = {want} array, got shape "
                         f"{tuple(jnp.shape(routing))} dtype {jnp.result_type(routing)}")


def count_params(params: nnx.State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
