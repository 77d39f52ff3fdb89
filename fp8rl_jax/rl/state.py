"""The trainer's pytrees: :class:`TrainState` (one state in, a new one out), :class:`TrainBatch`
(one update's data) and :class:`PolicyValueParams` (the model plus a PPO value head).

* **One state pytree.** ``TrainState`` holds ``step``, ``params`` (an ``nnx.State`` of float32
  master weights), ``opt_state`` (optax) and ``rng``; ``train_step`` maps it to a new one and is
  jitted with the state donated.
* **PPO value head on the shared trunk.** For GAE, ``TrainState.params`` is a
  ``PolicyValueParams`` ``(model, value_head)``: ``model`` the unchanged ``nnx.State`` of the
  Qwen3 model (the generator's weights, :func:`model_params`), ``value_head`` a scalar linear head
  ``{"kernel": [D, 1], "bias": []}`` (float32, zero-initialized: ``V = 0`` at first and the value
  loss sends no gradient into the trunk on the first update) reading the final post-norm hidden
  state of the same forward that gives the logprobs (``models.Qwen3.hidden_states``). One
  optimizer and one gradient clip cover both (shared actor-critic); GRPO keeps plain model params.
* **Value alignment** follows the logprobs: ``values[:, t] = head(h[:, t - 1])``, the hidden state
  that predicts ``tokens[t]``, i.e. the value of the prefix ``tokens[:t]`` before token ``t`` is
  emitted; ``values[:, 0] = 0``. So ``TrainBatch.values``, ``returns`` and ``advantages`` at entry
  ``t`` all belong to action ``t``. The head runs in float32 on the (compute-dtype) hidden state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fp8rl_jax.models import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class PolicyValueParams:
    """Trainer parameters for PPO with a value head on the shared trunk.

    Attributes:
      model: ``nnx.State`` of the Qwen3 model, exactly what GRPO trains and what the generator
        receives (:func:`model_params`; ``loop.sync_weights`` strips the head).
      value_head: ``{"kernel": [D, 1], "bias": []}``: ``V = h @ kernel + bias`` on the final
        post-norm hidden state ``h`` (:func:`token_values`), outside the model's State so the
        model definition stays the generator's.
    """

    model: nnx.State
    value_head: dict[str, Array]


def init_value_head(config: ModelConfig, key: Array | None = None, scale: float = 0.0) -> dict[str, Array]:
    """A float32 value head for ``config``: ``kernel [D, 1] ~ scale * N(0, 1 / D)`` (zeros with the
    default ``scale = 0``, or without ``key``), ``bias [] = 0``."""
    D = config.hidden_size
    if key is None or scale == 0:
        kernel = jnp.zeros((D, 1), jnp.float32)
    else:
        kernel = (scale / math.sqrt(D)) * jax.random.normal(key, (D, 1), jnp.float32)
    return {"kernel": kernel, "bias": jnp.zeros((), jnp.float32)}


def with_value_head(params: nnx.State, config: ModelConfig, key: Array | None = None,
                    scale: float = 0.0) -> PolicyValueParams:
    """``PolicyValueParams(params, init_value_head(config, key, scale))`` (``params`` untouched)."""
    if isinstance(params, PolicyValueParams):
        raise TypeError("params already carry a value head")
    return PolicyValueParams(model=params, value_head=init_value_head(config, key, scale))


def model_params(params: Any) -> nnx.State:
    """The model's parameters: ``params.model`` of a :class:`PolicyValueParams`, else ``params``
    itself (GRPO). What the generator and every logprob-only forward take."""
    return params.model if isinstance(params, PolicyValueParams) else params


def has_value_head(params: Any) -> bool:
    return isinstance(params, PolicyValueParams)


def token_values(value_head: dict[str, Array], hidden: Array) -> Array:
    """``values [B, T]`` float32 from final hidden states ``hidden [B, T, D]``, aligned with the
    logprobs: ``values[:, t] = hidden[:, t - 1] @ kernel + bias`` (the state that predicts
    ``tokens[t]``), ``values[:, 0] = 0``. The head runs in float32 (highest matmul precision)."""
    k = jnp.asarray(value_head["kernel"], jnp.float32)
    if k.shape != (jnp.shape(hidden)[-1], 1):
        raise ValueError(f"value_head kernel must have shape [D, 1] = {(jnp.shape(hidden)[-1], 1)}, got {k.shape}")
    v = jnp.einsum("btd,d->bt", hidden[:, :-1].astype(jnp.float32), k[:, 0], precision=jax.lax.Precision.HIGHEST)
    v = v + jnp.asarray(value_head["bias"], jnp.float32)
    return jnp.pad(v, ((0, 0), (1, 0)))


@flax.struct.dataclass
class TrainState:
    """The whole trainer state; ``train_step`` maps it to a new one.

    Attributes:
      step: int32 scalar, updates done so far (the next update uses ``lr_schedule(step)``).
      params: ``nnx.State`` of float32 master weights (paths as in ``fp8rl_jax.models``), or a
        :class:`PolicyValueParams` (model + value head) for PPO with GAE.
      opt_state: the optax state of the optimizer the step was built with.
      rng: uint32 [2] raw PRNG key, split once per update (reserved for stochastic steps).
    """

    step: Array
    params: nnx.State
    opt_state: optax.OptState
    rng: Array


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, rng: Array) -> TrainState:
    """A fresh state: ``params`` copied as float32 master weights (bf16 checkpoints welcome; the
    state never aliases ``params``, so donating it to a train step leaves ``params`` usable), the
    optimizer initialized on them, ``step = 0``; ``rng`` is a typed or raw key."""
    params = jax.tree.map(lambda p: jnp.array(p, jnp.float32 if jnp.issubdtype(p.dtype, jnp.floating) else p.dtype,
                                              copy=True), params)
    if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    rng = jnp.asarray(rng, jnp.uint32)
    if rng.shape != (2,):
        raise ValueError(f"rng must be a typed key or a raw uint32 [2] key, got shape {rng.shape}")
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=rng)


@flax.struct.dataclass
class TrainBatch:
    """One RL update's data; every ``[B, T]`` field uses the token alignment of ``tokens``.

    Attributes:
      tokens: [B, T] int32, prompt + response token ids, right-padded (any valid id as padding).
      loss_mask: [B, T], 1 on the response tokens to train, 0 on prompt and padding. The entry
        for ``t`` means "the logprob of ``tokens[t]`` given ``tokens[:t]``"; column 0 is ignored.
      advantages: [B, T] float, advantage of each trained token (e.g. ``compute_advantages``).
      old_logprobs: [B, T] float, trainer-side ``log pi_old(tokens[t] | tokens[:t])`` of the
        parameters that produced the rollout (:func:`trainer_logprobs`), the PPO ratio's denominator.
      rollout_logprobs: [B, T] float, the generator's logprobs of the same tokens (FP8 rollout),
        for the rollout correction and the mismatch metrics.
      ref_logprobs: [B, T] float or None, reference-policy logprobs for the KL penalty.
      routing: [B, T, L_moe, k] int32 or None: MoE routing replay, the experts the generator chose
        for ``tokens[b, t]`` in each MoE layer (``RolloutBatch.routing``, aligned by
        ``loop.build_batch``); ``-1`` (padding, unrecorded) lets the router's top-k decide. None
        (the default) routes by top-k.
      values: [B, T] float or None: ``V_old``, the value of the parameters that produced the
        rollout (:func:`trainer_logprobs_and_values`), for the clipped value loss. Entry ``t`` is
        the value of the prefix ``tokens[:t]`` (from the hidden state at ``t - 1``, the one that
        predicts ``tokens[t]``), the alignment of the logprobs.
      returns: [B, T] float or None: value targets ``R = A + V_old`` (:func:`algos.gae_advantages`).
        When given, the loss adds ``vf_coef * value_loss`` and the params need a value head. None
        (GRPO) leaves the loss as it was.
      token_rewards: [B, T] float or None: per-token rewards, the GAE input
        (:func:`algos.outcome_to_token_rewards`, filled by ``loop.build_batch``); not read by the loss.
    """

    tokens: Array
    loss_mask: Array
    advantages: Array
    old_logprobs: Array
    rollout_logprobs: Array
    ref_logprobs: Array | None = None
    routing: Array | None = None
    values: Array | None = None
    returns: Array | None = None
    token_rewards: Array | None = None


def check_batch(batch: TrainBatch, micro_batches: int = 1) -> tuple[int, int]:
    """Shape checks (trace-time; no values are read); returns ``(B, T)``."""
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"batch must be a TrainBatch, got {type(batch).__name__}")
    shape = jnp.shape(batch.tokens)
    if len(shape) != 2 or not jnp.issubdtype(jnp.result_type(batch.tokens), jnp.integer):
        raise ValueError(f"tokens must be an integer [B, T] array, got shape {shape} dtype "
                         f"{jnp.result_type(batch.tokens)}")
    B, T = shape
    if T < 2:
        raise ValueError(f"tokens need T >= 2 (position 0 has no logprob), got T = {T}")
    for f in dataclasses.fields(batch):
        x = getattr(batch, f.name)
        if f.name == "routing" and x is not None:
            if len(jnp.shape(x)) != 4 or jnp.shape(x)[:2] != shape or not jnp.issubdtype(jnp.result_type(x),
                                                                                          jnp.integer):
                raise ValueError(f"TrainBatch.routing must be an integer [B, T, L_moe, top_k] array with "
                                 f"[B, T] = {shape}, got shape {jnp.shape(x)} dtype {jnp.result_type(x)}")
            continue
        if f.name != "tokens" and x is not None and jnp.shape(x) != shape:
            raise ValueError(f"TrainBatch.{f.name} has shape {jnp.shape(x)}, expected [B, T] = {shape} like tokens")
    if B % micro_batches:
        raise ValueError(f"micro_batches = {micro_batches} does not divide the batch size B = {B}")
    return B, T


__all__ = ["PolicyValueParams", "TrainBatch", "TrainState", "check_batch", "has_value_head", "init_train_state",
           "init_value_head", "model_params", "token_values", "with_value_head"]
