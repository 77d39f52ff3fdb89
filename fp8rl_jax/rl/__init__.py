"""RL maths for the "advantages" and "update" stages: pure functions in :mod:`fp8rl_jax.rl.algos`."""

from fp8rl_jax.rl.algos import (
    AdvantageEstimator,
    Correction,
    KLEstimator,
    LossAgg,
    aggregate_loss,
    broadcast_to_tokens,
    compute_advantages,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    outcome_to_token_rewards,
    policy_loss,
    rollout_correction_weights,
)

__all__ = [
    "AdvantageEstimator",
    "Correction",
    "KLEstimator",
    "LossAgg",
    "aggregate_loss",
    "broadcast_to_tokens",
    "compute_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "mismatch_metrics",
    "outcome_to_token_rewards",
    "policy_loss",
    "rollout_correction_weights",
]
