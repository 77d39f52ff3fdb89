"""Trainer-side logprobs (and PPO values) of token sequences from one full-sequence forward.

* **Token alignment.** ``logp[:, t] = log p(tokens[t] | tokens[:t])``; ``logp[:, 0] = 0`` and
  position 0 is never trained (it has no context). ``old_logprobs``, ``rollout_logprobs``,
  ``ref_logprobs`` and ``advantages`` use the same alignment. Right padding needs no attention
  mask: a causal model never lets a real token see a later padded one.
* **FP32 master weights, BF16 compute.** :func:`trainer_logprobs` (and the loss) cast the float32
  parameters to ``TrainerConfig.compute_dtype`` before the forward; the cast is differentiable,
  so gradients stay float32. The policy's compute dtype must match (checked).
* **Chunked vocabulary projection.** ``TrainerConfig.logits_chunk`` tokens of the micro-batch at a
  time (:func:`head_logprobs`, rematerialized in the backward): ``[B, T, V]`` float32 logits with
  Qwen3's 152k vocabulary are ~600 KB per token, and autodiff keeps several copies of them.
* **MoE routing replay.** ``routing`` (``[B, T, L_moe, k]`` int32, recorded by the generator,
  ``-1`` = not recorded) sends each token through the experts the rollout chose; the router's
  softmax still weights them and receives the gradient (``models.qwen3.forward_with_routing``).
  ``routing=None`` routes by top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.models import MatmulPolicy, ModelConfig, bind
from fp8rl_jax.rl.algos import entropy_from_logits
from fp8rl_jax.rl.state import PolicyValueParams, model_params, token_values
from fp8rl_jax.rl.trainer_config import TrainerConfig

Array = jax.Array


def token_logprobs(params: nnx.State, tokens: Array, *, config: ModelConfig, policy: MatmulPolicy,
                   with_entropy: bool = False, remat: bool = False, routing: Array | None = None,
                   logits_chunk: int | None = None) -> tuple[Array, Array | None]:
    """``(logp, entropy)``: ``logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`` ``[B, T]`` float32
    from one full-sequence forward, ``logp[:, 0] = 0``; ``entropy[b, t]`` is the entropy of the
    distribution that predicts position ``t`` (None unless ``with_entropy``). ``params`` are used
    as given (cast them first for BF16 compute, as :func:`trainer_logprobs` does). ``routing``
    [B, T, L_moe, k] int32 replays MoE expert choices (``TrainBatch.routing``). ``logits_chunk``:
    the LM head and log-softmax run over that many tokens at a time, rematerialized in the
    backward pass (:func:`head_logprobs`), so ``[B, T, V]`` float32 logits never exist at once."""
    logp, ent, _ = _logprobs_and_hidden(model_params(params), tokens, config=config, policy=policy,
                                        with_entropy=with_entropy, remat=remat, routing=routing,
                                        logits_chunk=logits_chunk)
    return logp, ent


def head_logprobs(logits_fn: Callable[[Array], Array], hidden: Array, targets: Array, *, with_entropy: bool = False,
                  chunk: int | None = None) -> tuple[Array, Array | None]:
    """``logp[b, s] = log softmax(logits_fn(hidden[b, s]))[targets[b, s]]`` ``[B, S]`` float32 (and
    the entropy of that distribution when ``with_entropy``), computed ``chunk`` tokens at a time
    (the ``B x S`` tokens taken row after row) when there are more than ``chunk`` of them.

    The vocabulary projection dominates activation memory at RL lengths: Qwen3's 152k-entry
    vocabulary makes ``[B, S, V]`` float32 logits ~600 KB per token, and autodiff keeps several
    such tensors (logits, softmax, their cotangents). Chunked, the forward holds one
    ``[chunk, V]`` block at a time and ``jax.checkpoint`` makes the backward recompute each
    chunk's logits from ``hidden`` instead of storing them: peak memory falls from
    ``O(B S V)`` to ``O(chunk V)``, whatever the micro-batch's row count, for one extra LM-head GEMM.
    Each token's result is the same math as the unchunked path (rows of a GEMM are independent),
    up to the GEMM's summation order."""
    B, S = targets.shape

    def block(h, t):
        z = logits_fn(h).astype(jnp.float32)
        lp = jnp.take_along_axis(z, t[..., None].astype(jnp.int32), axis=-1)[..., 0] - jax.nn.logsumexp(z, axis=-1)
        return lp, (entropy_from_logits(z) if with_entropy else jnp.zeros_like(lp))

    if chunk is None or B * S <= chunk:
        lp, ent = block(hidden, targets)
    else:
        n = -(-(B * S) // chunk)
        pad = n * chunk - B * S
        h = jnp.pad(hidden.reshape(B * S, -1), ((0, pad), (0, 0))).reshape(n, chunk, -1)
        t = jnp.pad(targets.reshape(B * S), (0, pad)).reshape(n, chunk)
        lp, ent = jax.lax.map(jax.checkpoint(lambda ht: block(*ht)), (h, t))
        lp, ent = (x.reshape(n * chunk)[:B * S].reshape(B, S) for x in (lp, ent))
    return lp, (ent if with_entropy else None)


def _logprobs_and_hidden(params, tokens, *, config, policy, with_entropy, remat, routing, logits_chunk=None):
    model = bind(params, config, policy)
    hidden, _ = model.hidden_states(tokens, remat=remat, routing=routing)
    # position t-1 predicts token t
    logp, ent = head_logprobs(model.logits, hidden[:, :-1], tokens[:, 1:], with_entropy=with_entropy,
                              chunk=logits_chunk)
    pad = functools.partial(jnp.pad, pad_width=((0, 0), (1, 0)))
    return pad(logp), (pad(ent) if with_entropy else None), hidden


def token_logprobs_and_values(params: PolicyValueParams, tokens: Array, *, config: ModelConfig,
                              policy: MatmulPolicy, with_entropy: bool = False, remat: bool = False,
                              routing: Array | None = None, logits_chunk: int | None = None
                              ) -> tuple[Array, Array | None, Array]:
    """``(logp, entropy, values)`` from one full-sequence forward: :func:`token_logprobs` of
    ``params.model`` and :func:`token_values` of ``params.value_head`` on the same final hidden
    states (entry ``t`` of both belongs to ``tokens[t]``; ``values[:, 0] = 0``)."""
    if not isinstance(params, PolicyValueParams):
        raise TypeError(f"token_logprobs_and_values needs PolicyValueParams (with_value_head), "
                        f"got {type(params).__name__}")
    logp, ent, hidden = _logprobs_and_hidden(params.model, tokens, config=config, policy=policy,
                                             with_entropy=with_entropy, remat=remat, routing=routing,
                                             logits_chunk=logits_chunk)
    return logp, ent, token_values(params.value_head, hidden)


def _compute_params(params: Any, cfg: TrainerConfig) -> Any:
    """The model params cast to the compute dtype (differentiably); a value head stays float32."""
    dt = jnp.dtype(cfg.compute_dtype.value)
    cast = jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p, model_params(params))
    return params.replace(model=cast) if isinstance(params, PolicyValueParams) else cast


def _check_static(params: nnx.State, policy: MatmulPolicy, cfg: TrainerConfig) -> None:
    if not isinstance(cfg, TrainerConfig):
        raise TypeError(f"trainer_config must be a TrainerConfig, got {type(cfg).__name__}")
    if jnp.dtype(policy.compute_dtype) != jnp.dtype(cfg.compute_dtype.value):
        raise ValueError(f"policy compute dtype {jnp.dtype(policy.compute_dtype).name} differs from "
                         f"TrainerConfig.compute_dtype {cfg.compute_dtype}; use e.g. DensePolicy"
                         f"({cfg.compute_dtype.value!r})")
    bad = [jax.tree_util.keystr(k) for k, p in jax.tree_util.tree_leaves_with_path(params)
           if jnp.issubdtype(p.dtype, jnp.floating) and p.dtype != jnp.float32]
    if bad:
        raise ValueError(f"trainer params must be float32 master weights (init_train_state upcasts); "
                         f"not float32: {bad[:3]}{' ...' if len(bad) > 3 else ''}")


def trainer_logprobs(params: nnx.State, tokens: Array, *, model_config: ModelConfig, policy: MatmulPolicy,
                     trainer_config: TrainerConfig, routing: Array | None = None) -> Array:
    """``[B, T]`` trainer-side logprobs with the loss's exact numerics (same parameter cast,
    same micro-batch shapes): what ``TrainBatch.old_logprobs`` should hold, so that the first
    update on a fresh rollout starts at ratio 1. ``routing``: ``TrainBatch.routing`` (replay).
    A value head in ``params`` is ignored (:func:`trainer_logprobs_and_values` uses it)."""
    _check_static(params, policy, trainer_config)
    p = _compute_params(model_params(params), trainer_config)
    fn = functools.partial(token_logprobs, config=model_config, policy=policy,
                           logits_chunk=trainer_config.logits_chunk)
    return _micro_map(lambda t, r: fn(p, t, routing=r)[0], tokens, routing, trainer_config.micro_batches)


def trainer_logprobs_and_values(params: PolicyValueParams, tokens: Array, *, model_config: ModelConfig,
                                policy: MatmulPolicy, trainer_config: TrainerConfig,
                                routing: Array | None = None) -> tuple[Array, Array]:
    """``(logprobs [B, T], values [B, T])`` from one forward per micro-batch, with the loss's
    exact numerics (:func:`trainer_logprobs`): ``old_logprobs`` and ``V_old`` (``TrainBatch.values``)
    of the parameters that produced a rollout. Alignment as :func:`token_values`."""
    _check_static(params, policy, trainer_config)
    if not isinstance(params, PolicyValueParams):
        raise TypeError(f"trainer_logprobs_and_values needs PolicyValueParams (with_value_head), "
                        f"got {type(params).__name__}")
    p = _compute_params(params, trainer_config)

    def fn(t, r):
        logp, _, v = token_logprobs_and_values(p, t, config=model_config, policy=policy, routing=r,
                                               logits_chunk=trainer_config.logits_chunk)
        return logp, v

    return _micro_map(fn, tokens, routing, trainer_config.micro_batches)


def _micro_map(fn: Callable, tokens: Array, routing: Array | None, M: int) -> Any:
    """``fn(tokens, routing)`` over ``M`` micro-batches by ``lax.map``, outputs reshaped to ``[B, ...]``."""
    if jnp.ndim(tokens) != 2:
        raise ValueError(f"tokens must have shape [B, T], got {jnp.shape(tokens)}")
    B, T = jnp.shape(tokens)
    if B % M:
        raise ValueError(f"micro_batches = {M} does not divide the batch size B = {B}")
    if routing is None:
        out = jax.lax.map(lambda t: fn(t, None), tokens.reshape(M, B // M, T))
    else:
        if jnp.ndim(routing) != 4 or jnp.shape(routing)[:2] != (B, T):
            raise ValueError(f"routing must have shape [B, T, L_moe, top_k] with [B, T] = {(B, T)}, "
                             f"got {jnp.shape(routing)}")
        out = jax.lax.map(lambda tr: fn(tr[0], tr[1]),
                          (tokens.reshape(M, B // M, T), routing.reshape(M, B // M, *jnp.shape(routing)[1:])))
    return jax.tree.map(lambda x: x.reshape(B, *x.shape[2:]), out)


def make_logprob_fn(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig
                    ) -> Callable[..., Array]:
    """Jitted :func:`trainer_logprobs` ``(params, tokens, routing=None) -> [B, T]`` (for
    ``old_logprobs``; ``routing`` replays MoE expert choices)."""
    return jax.jit(functools.partial(trainer_logprobs, model_config=model_config, policy=policy,
                                     trainer_config=trainer_config))


def make_logprob_value_fn(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig
                          ) -> Callable[..., tuple[Array, Array]]:
    """Jitted :func:`trainer_logprobs_and_values` ``(params, tokens, routing=None) -> (logp, values)``
    (``old_logprobs`` and ``V_old`` from one forward; params with a value head)."""
    return jax.jit(functools.partial(trainer_logprobs_and_values, model_config=model_config, policy=policy,
                                     trainer_config=trainer_config))


__all__ = ["head_logprobs", "make_logprob_fn", "make_logprob_value_fn", "token_logprobs", "token_logprobs_and_values",
           "trainer_logprobs", "trainer_logprobs_and_values"]
