"""The trainer's optimizer: global-norm clipping, then AdamW on a warmup + constant/cosine schedule.

* **Schedule convention.** Update ``k`` (0-based, ``= state.step``) uses
  ``lr_k = lr * min(1, (k + 1) / W)`` during warmup (the first update is not wasted on
  ``lr = 0``), then constant ``lr`` or cosine from ``lr`` to ``min_lr_ratio * lr`` over
  ``total_steps - W`` updates, flat afterwards.
* **Weight decay** (decoupled, AdamW) applies to matrices only (``ndim >= 2``: linear weights,
  embeddings, experts), not to the RMSNorm gains.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from fp8rl_jax.rl.trainer_config import OptimizerConfig, Schedule

Array = jax.Array


def lr_schedule(cfg: OptimizerConfig) -> Callable[[Array | int], Array]:
    """``step -> lr`` (float32) of update ``step`` (0-based); see the module docstring."""
    lr, W = cfg.lr, cfg.warmup_steps

    def schedule(step):
        k = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (k + 1.0) / W) if W > 0 else 1.0
        if cfg.schedule is Schedule.CONSTANT:
            after = jnp.float32(lr)
        else:
            p = jnp.clip((k - W) / (cfg.total_steps - W), 0.0, 1.0)
            after = lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * p)))
        return jnp.where(k < W, lr * warm, after).astype(jnp.float32)

    return schedule


def _decay_mask(params):
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def optimizer_parts(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation | None, optax.GradientTransformation]:
    """The two stages of :func:`make_optimizer`: the global-norm clip (None without ``max_grad_norm``) and AdamW,
    which is elementwise per leaf (what ``rl.offload`` streams a group at a time)."""
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=_decay_mask)
    return (None if cfg.max_grad_norm is None else optax.clip_by_global_norm(cfg.max_grad_norm)), adamw


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm)`` then AdamW on :func:`lr_schedule`:
    ``g <- g min(1, c / ||g||)``; ``m, v`` Adam moments with bias correction;
    ``p <- p - lr_k (m_hat / (sqrt(v_hat) + eps) + wd p)`` (``wd`` on matrices only)."""
    clip, adamw = optimizer_parts(cfg)
    return adamw if clip is None else optax.chain(clip, adamw)


__all__ = ["lr_schedule", "make_optimizer", "optimizer_parts"]
