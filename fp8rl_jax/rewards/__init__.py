"""Reward functions for the RL loop's "score" stage, chosen by enum.

A reward function maps one ``(response, ground_truth)`` pair of strings to a
float; batching, grouping and advantage computation happen elsewhere, so the
functions stay pure and trivially parallel (one process per scoring worker:
see :mod:`fp8rl_jax.rewards.math_reward` on why not threads).

The registry is a plain dict from :class:`RewardKind` to function. A new task
adds an enum member and a :func:`register_reward_fn` call next to its
implementation; configs name a ``RewardKind``, never a string.
"""

import enum
from typing import Protocol

from fp8rl_jax.rewards.math_reward import extract_answer, math_reward, normalize_answer


class RewardFn(Protocol):
    """``(response, ground_truth) -> reward``; must not raise on any input."""

    def __call__(self, response: str, ground_truth: str) -> float: ...


class RewardKind(enum.Enum):
    """Which reward function scores a task."""

    MATH = "math"
    """Binary 1.0/0.0: final ``\\boxed{}`` / answer line equivalent to the ground truth."""


_REGISTRY: dict[RewardKind, RewardFn] = {RewardKind.MATH: math_reward}


def register_reward_fn(kind: RewardKind, fn: RewardFn, *, replace: bool = False) -> None:
    """Bind ``fn`` to ``kind``; rebinding an existing kind needs ``replace=True``."""
    if not isinstance(kind, RewardKind):
        raise TypeError(f"kind must be a RewardKind, got {type(kind).__name__} {kind!r}")
    if kind in _REGISTRY and not replace:
        raise ValueError(f"{kind} already has reward fn {_REGISTRY[kind]!r}; pass replace=True")
    _REGISTRY[kind] = fn


def get_reward_fn(kind: RewardKind) -> RewardFn:
    """The reward function registered for ``kind``."""
    if not isinstance(kind, RewardKind):
        raise TypeError(
            f"kind must be a RewardKind, got {type(kind).__name__} {kind!r}"
            f" (e.g. RewardKind({kind!r}) for a value read from a file)"
        )
    if kind not in _REGISTRY:
        raise KeyError(f"no reward fn registered for {kind}; known: {sorted(k.name for k in _REGISTRY)}")
    return _REGISTRY[kind]


__all__ = [
    "RewardFn",
    "RewardKind",
    "extract_answer",
    "get_reward_fn",
    "math_reward",
    "normalize_answer",
    "register_reward_fn",
]
