"""RL maths for GRPO / DAPO / PPO: pure, jittable functions over ``[B, T]`` arrays.

Advantages (:func:`compute_advantages`: GRPO, Dr.GRPO, GAE), the clipped policy loss
(:func:`policy_loss`), the clipped value loss of PPO's critic (:func:`value_loss`), KL and
entropy terms, rollout corrections and mismatch diagnostics.

Shapes: ``B`` sequences, ``T`` response tokens, ``V`` vocabulary. Every token-level
input comes with ``mask [B, T]`` (1 = real response token, 0 = padding). Modes are
enums, never strings; enum and ``None``-valued arguments are Python-static (pass them
through ``functools.partial`` or ``static_argnames`` when jitting a function alone;
inside a jitted train step they are just Python values).

Design choices, and why
-----------------------
* **float32 everywhere.** Inputs narrower than float32 (bf16, fp16, fp8 log-probs)
  are upcast to float32 before any arithmetic; float64 inputs stay float64 so the
  tests can check gradients by finite differences.
* **Padding never leaks.** Every token-level input is replaced by 0 at padded
  positions (``jnp.where``, so even NaN/inf garbage there changes neither values
  nor gradients) before anything else touches it, and every output is 0 there.
* **The loss denominator counts real tokens, not surviving tokens.** With
  ``LossAgg.TOKEN_MEAN`` the loss is ``sum(mask * w * l) / sum(mask)``, also when a
  rollout correction sets some weights ``w`` to 0. The correction estimates
  ``E_rollout[w * l]`` over *all* sampled tokens: a rejected token contributes 0 to
  that expectation, it does not leave the sample. Dividing by the count of
  surviving tokens instead (a known bug elsewhere) rescales every kept token by
  ``1 / keep_fraction``, so the effective learning rate grows with the mismatch,
  the estimator is biased, and micro-batches with different rejection rates are
  weighted inconsistently. The same rule holds for the sequence aggregations
  (a fully rejected sequence still counts in the number of sequences).
* **Exact gradient accumulation.** ``denominator`` fixes the divisor (tokens for
  ``TOKEN_MEAN``, sequences for the ``SEQ_*`` modes) so that summing micro-batch
  losses computed with the full batch's denominator reproduces the full-batch loss
  and gradient exactly. ``TOKEN_MEAN`` with ``denominator = B * T_max`` is
  Dr.GRPO's constant normalization.
* **All-padding rows** (fillers for static shapes) contribute nothing and are not
  counted as sequences by the default ``SEQ_*`` denominators.
* **GRPO std** is the sample std (``ddof=1``, what ``torch.std`` gives verl and
  TRL; pass ``ddof=0`` for the population std). A group whose rewards are all
  equal, including a group of one, gets advantage exactly 0 (never NaN, and never
  ``rounding_error / eps`` from a mean that is off by one ulp).
* **Rollout correction weights are stop-gradient** and multiply the clipped PPO
  token loss (after clipping). Several corrections compose by multiplying their
  weights (pass a tuple, e.g. ``(Correction.SEQ_TIS, Correction.SEQ_MASK_GEO)``).
* **IcePop / token MIS keeps the ratio** (``w = r`` inside ``[lo, hi]``, else 0), as
  in IcePop's masking function; the pure-rejection modes (geometric-mean and KL
  rejection) keep weight 1 and only mask.
* **Direction of the trainer/rollout ratio.** ``r = pi_trainer / pi_rollout =
  exp(trainer_logp - rollout_logp)`` on tokens sampled from the rollout engine, so
  ``E_rollout[r * f] = E_trainer[f]``; divergences are reported as
  ``KL(pi_rollout || pi_trainer)``, the one these samples estimate directly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
Metrics = dict[str, Array]

# A log-ratio beyond this is clamped inside the PPO ratio only: exp(20) ~ 5e8 is far
# outside any clip range, so the clamp changes no clipped loss and prevents inf * 0.
_MAX_LOG_RATIO = 20.0


class AdvantageEstimator(enum.Enum):
    """How advantages are computed (:func:`compute_advantages`)."""

    GRPO = "grpo"
    """Outcome reward normalized within its group: ``(r - mean_g) / (std_g + eps)``."""
    GRPO_NO_STD = "grpo_no_std"
    """Dr.GRPO: ``r - mean_g`` (no std division, avoiding its difficulty bias)."""
    GAE = "gae"
    """Generalized advantage estimation from token rewards and a value model."""


class LossAgg(enum.Enum):
    """How the token losses ``l[b, t]`` of a batch become one scalar (:func:`aggregate_loss`)."""

    TOKEN_MEAN = "token_mean"
    """``sum_bt m l / sum_bt m``: every real token weighs the same (DAPO)."""
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    """``sum_b (sum_t m l) / n_seq``: sum over tokens, mean over sequences."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """``sum_b (sum_t m l / sum_t m) / n_seq``: every sequence weighs the same (GRPO paper)."""


class KLEstimator(enum.Enum):
    """Schulman's per-sample estimators of ``KL(pi || ref)`` on samples from ``pi``
    (``x = ref_logp - logp``)."""

    K1 = "k1"
    """``-x = logp - ref_logp``: unbiased, high variance, can be negative."""
    K2 = "k2"
    """``x^2 / 2``: biased, low variance, >= 0."""
    K3 = "k3"
    """``exp(x) - x - 1``: unbiased, low variance, >= 0."""


class Correction(enum.Enum):
    """Training/inference mismatch correction (:func:`rollout_correction_weights`).

    ``r_t = exp(old_logp_trainer - rollout_logp)`` per real token.
    """

    NONE = "none"
    """``w = 1`` on real tokens."""
    TOKEN_TIS = "token_tis"
    """Truncated IS: ``w_t = min(r_t, C)``."""
    TOKEN_MIS = "token_mis"
    """Masked IS (IcePop): ``w_t = r_t`` if ``lo <= r_t <= hi`` else 0."""
    TOKEN_MASK = "token_mask"
    """Token ratio mask: ``w_t = 1`` if ``lo <= r_t <= hi`` else 0 (the bounds of MIS, without the ratio)."""
    SEQ_TIS = "seq_tis"
    """Sequence truncated IS: ``w_b = min(prod_t r_t, C)`` on every token of ``b``."""
    SEQ_MASK_GEO = "seq_mask_geo"
    """Geometric-mean rejection: ``w_b = 1`` if ``lo <= exp(mean_t log r_t) <= hi`` else 0."""
    TOKEN_KL_REJECT = "token_kl_reject"
    """Token rejection: ``w_t = 1`` if ``k_t <= threshold`` else 0, ``k`` = k2 or k3 of
    ``KL(pi_rollout || pi_trainer)``."""
    SEQ_KL_REJECT = "seq_kl_reject"
    """Sequence rejection: ``w_b = 1`` if ``mean_t k_t <= threshold`` else 0."""


# --------------------------------------------------------------------------- helpers


def _float(x) -> Array:
    """At least float32 (bf16/fp16/fp8 are upcast; float64 stays float64)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32)) if jnp.issubdtype(x.dtype, jnp.floating) \
        else x.astype(jnp.float32)


def _mask(mask) -> Array:
    return jnp.asarray(mask) != 0


def _clean(x, m: Array) -> Array:
    """``x`` as float with padded positions replaced by 0 (NaN-safe for values and grads)."""
    x = _float(x)
    return jnp.where(m, x, jnp.zeros((), x.dtype))


def _check_bt(name: str, x, shape) -> None:
    if jnp.shape(x) != tuple(shape):
        raise ValueError(f"{name} must have shape [B, T] = {tuple(shape)} like mask, got {jnp.shape(x)}")


def _token_inputs(mask, **inputs) -> tuple[Array, ...]:
    """The boolean ``[B, T]`` mask, then each input checked against its shape with padding zeroed."""
    m = _mask(mask)
    if m.ndim != 2:
        raise ValueError(f"mask must have shape [B, T], got {m.shape}")
    for name, x in inputs.items():
        _check_bt(name, x, m.shape)
    return (m, *(_clean(x, m) for x in inputs.values()))


def _check_enum(name: str, value, cls: type[enum.Enum]) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__} {value!r}"
                        f" (e.g. {cls.__name__}({value!r}) for a value read from a file)")


def masked_mean(x, mask, axis=None) -> Array:
    """``sum(m x) / max(sum(m), 1)`` over ``axis`` (0 where nothing is real)."""
    m = _mask(mask)
    x = _clean(x, m)
    return jnp.sum(x, axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1).astype(x.dtype)


def _masked_max(x: Array, m: Array) -> Array:
    return jnp.where(jnp.any(m), jnp.max(jnp.where(m, x, -jnp.inf)), 0.0).astype(x.dtype)


def _masked_min(x: Array, m: Array) -> Array:
    return jnp.where(jnp.any(m), jnp.min(jnp.where(m, x, jnp.inf)), 0.0).astype(x.dtype)


def broadcast_to_tokens(seq_values, mask) -> Array:
    """``[B] -> [B, T]``: ``out[b, t] = v[b] * m[b, t]``."""
    m = _mask(mask)
    v = _float(seq_values)
    if v.shape != m.shape[:1]:
        raise ValueError(f"seq_values must have shape [B] = {m.shape[:1]}, got {v.shape}")
    return jnp.where(m, v[:, None], jnp.zeros((), v.dtype))


def outcome_to_token_rewards(rewards, mask) -> Array:
    """``[B] -> [B, T]``: the outcome reward ``r_b`` on the last real token of ``b``, 0 elsewhere
    (the token-reward input of :func:`gae_advantages`; all-padding rows get nothing)."""
    m = _mask(mask)
    r = _float(rewards)
    T = m.shape[1]
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=1)  # index of the last True per row
    at_last = (jnp.arange(T)[None, :] == last[:, None]) & m
    return jnp.where(at_last, r[:, None], jnp.zeros((), r.dtype))


def overlong_penalty(lengths, max_len: int, buffer: int, penalty: float = 1.0) -> Array:
    """DAPO's soft overlong punishment, ``[B]`` to add to the outcome reward of responses of ``lengths`` tokens:
    0 up to ``max_len - buffer`` tokens, then ``-penalty (L - (max_len - buffer)) / buffer``, reaching
    ``-penalty`` at ``max_len`` (and staying there beyond). ``buffer = 0`` punishes nothing."""
    if not (isinstance(buffer, int) and 0 <= buffer <= max_len):
        raise ValueError(f"the overlong buffer must be an int in [0, max_len = {max_len}], got {buffer!r}")
    n = _float(lengths)
    if buffer == 0:
        return jnp.zeros_like(n)
    return -penalty * jnp.clip((n - (max_len - buffer)) / buffer, 0.0, 1.0)


# --------------------------------------------------------------------------- advantages


def grpo_advantages(rewards, group_ids=None, *, group_size: int | None = None, eps: float = 1e-6,
                    normalize_std: bool = True, ddof: int = 1) -> Array:
    """Group-relative outcome advantage, ``[B] -> [B]``.

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` with ``normalize_std`` (GRPO), else
    ``A_i = r_i - mean_g(r)`` (Dr.GRPO), where ``g`` is the group (same prompt) of ``i``
    and ``std_g = sqrt(sum_g (r - mean_g)^2 / (n_g - ddof))``. Groups whose rewards are
    all equal (including groups of one) get ``A = 0`` exactly.

    Groups are given either by ``group_ids`` (int ``[B]``, any values, any order) or by
    ``group_size`` (``G``: rows ``[k G, (k+1) G)`` form group ``k``; ``B % G == 0``).
    """
    r = _float(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards must have shape [B], got {r.shape}")
    (B,) = r.shape
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids and group_size")
    if group_size is not None:
        if B % group_size:
            raise ValueError(f"batch size {B} is not a multiple of group_size {group_size}")
        ids = jnp.arange(B) // group_size
    else:
        if jnp.shape(group_ids) != (B,):
            raise ValueError(f"group_ids must have shape [B] = {(B,)}, got {jnp.shape(group_ids)}")
        # Dense ids 0..n_groups-1 for arbitrary labels; size=B keeps it static under jit.
        _, ids = jnp.unique(jnp.asarray(group_ids), return_inverse=True, size=B)
        ids = ids.reshape(B)
    count = jax.ops.segment_sum(jnp.ones_like(r), ids, num_segments=B)
    mean = (jax.ops.segment_sum(r, ids, num_segments=B) / jnp.maximum(count, 1))[ids]
    centered = r - mean
    constant = (jax.ops.segment_max(r, ids, num_segments=B) == jax.ops.segment_min(r, ids, num_segments=B))[ids]
    centered = jnp.where(constant, 0.0, centered)
    if not normalize_std:
        return centered
    var = jax.ops.segment_sum(centered**2, ids, num_segments=B)[ids] / jnp.maximum(count[ids] - ddof, 1)
    return jnp.where(constant, 0.0, centered / (jnp.sqrt(var) + eps))


def gae_advantages(rewards, values, mask, *, gamma: float = 1.0, lam: float = 1.0) -> tuple[Array, Array]:
    """Generalized advantage estimation over real tokens, ``[B, T] -> ([B, T], [B, T])``.

    Over the real tokens ``t`` of a row, with ``t'`` the next real token after ``t``
    (``V_{t'} = 0, A_{t'} = 0`` after the last one, i.e. no bootstrap past the response)::

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                      (value-function target)

    Computed by a reverse ``jax.lax.scan`` over ``T`` that carries ``(V_{t'}, A_{t'})``
    through padded positions unchanged, so right padding (and masked holes, e.g. tool
    output in multi-turn rollouts, which are skipped) never leaks. Outputs are 0 at padding.
    With ``gamma = lam = 1``: ``A_t = sum_{s >= t} r_s - V_t``.
    """
    m, r, v = _token_inputs(mask, rewards=rewards, values=values)
    dtype = jnp.promote_types(r.dtype, v.dtype)
    r, v = r.astype(dtype), v.astype(dtype)
    gamma, lam = jnp.asarray(gamma, dtype), jnp.asarray(lam, dtype)

    def step(carry, xs):
        next_v, next_a = carry
        r_t, v_t, m_t = xs
        a_t = r_t + gamma * next_v - v_t + gamma * lam * next_a
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return carry, jnp.where(m_t, a_t, 0.0)

    zeros = jnp.zeros(m.shape[:1], dtype)
    _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv.T
    return adv, jnp.where(m, adv + v, 0.0)


def compute_advantages(estimator: AdvantageEstimator, rewards, mask, *, group_ids=None,
                       group_size: int | None = None, values=None, gamma: float = 1.0, lam: float = 1.0,
                       eps: float = 1e-6) -> tuple[Array, Array]:
    """Token advantages and returns ``[B, T]`` for ``estimator``.

    * ``GRPO`` / ``GRPO_NO_STD``: ``rewards [B]`` outcome rewards ->
      ``A[b, t] = grpo_advantages(r)[b] * m[b, t]``; returns = advantages (no critic).
    * ``GAE``: ``rewards [B, T]`` token rewards (see :func:`outcome_to_token_rewards`)
      and ``values [B, T]`` -> :func:`gae_advantages`.
    """
    _check_enum("estimator", estimator, AdvantageEstimator)
    if estimator is AdvantageEstimator.GAE:
        if values is None:
            raise ValueError("AdvantageEstimator.GAE needs values [B, T]")
        return gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    a = grpo_advantages(rewards, group_ids, group_size=group_size, eps=eps,
                        normalize_std=estimator is AdvantageEstimator.GRPO)
    a = broadcast_to_tokens(a, mask)
    return a, a


# --------------------------------------------------------------------------- losses


def aggregate_loss(token_loss, mask, agg: LossAgg, *, denominator: float | Array | None = None) -> Array:
    """Scalar loss from token losses ``l [B, T]``; ``m`` = mask, ``n_b = sum_t m[b, t]``.

    * ``TOKEN_MEAN``:          ``sum_bt m l / D``,           ``D = sum_bt m`` (real tokens)
    * ``SEQ_MEAN_TOKEN_SUM``:  ``sum_b (sum_t m l) / D``,    ``D = #{b : n_b > 0}``
    * ``SEQ_MEAN_TOKEN_MEAN``: ``sum_b (sum_t m l / n_b) / D``, same ``D``

    ``denominator`` replaces ``D`` (use the full batch's ``D`` on every micro-batch so
    the sum of micro-batch losses equals the full-batch loss). Default ``D`` is at
    least 1, so an all-padding batch gives 0. Weights folded into ``l`` (rollout
    correction) never change ``D``: see the module docstring.
    """
    _check_enum("agg", agg, LossAgg)
    m = _mask(mask)
    _check_bt("token_loss", token_loss, m.shape)
    l = _clean(token_loss, m)
    n_b = jnp.sum(m, axis=1)
    if agg is LossAgg.TOKEN_MEAN:
        num, default = jnp.sum(l), jnp.sum(n_b)
    else:
        seq = jnp.sum(l, axis=1)
        if agg is LossAgg.SEQ_MEAN_TOKEN_MEAN:
            seq = seq / jnp.maximum(n_b, 1).astype(l.dtype)
        num, default = jnp.sum(seq), jnp.sum(n_b > 0)
    den = jnp.maximum(default, 1).astype(l.dtype) if denominator is None else jnp.asarray(denominator, l.dtype)
    return num / den


def policy_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: float | None = None, agg: LossAgg = LossAgg.TOKEN_MEAN, weights=None,
                denominator: float | Array | None = None) -> tuple[Array, Metrics]:
    """Clipped PPO surrogate (GRPO/DAPO/PPO), with DAPO clip-higher and dual clip.

    Per real token, ``r = exp(logp - old_logp)`` (log-ratio clamped to +-20), ``A`` the
    advantage, ``w`` the stop-gradient correction weight (1 if ``weights`` is None)::

        l_clip = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        l      = min(l_clip, -A c)   if dual_clip = c (> 1) and A < 0, else l_clip
        loss   = aggregate_loss(w * l, mask, agg, denominator)

    Dual clip bounds each negative-advantage token's loss by ``c |A|`` however large
    ``r`` grows. Gradients flow only through ``logp``; ``old_logp``, ``advantages`` and
    ``weights`` are stop-gradient.

    Metrics (means over real tokens): ``clip_frac`` (clipped branch active),
    ``clip_frac_low`` / ``clip_frac_high`` (active at ``r < 1 - clip_low`` / ``r > 1 + clip_high``),
    ``dual_clip_frac``, ``approx_kl`` (k1 ``old_logp - logp``), ``approx_kl_k3``,
    ``ratio_mean``, ``ratio_max``.
    """
    _check_enum("agg", agg, LossAgg)
    if isinstance(dual_clip, (int, float)) and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss at c * |A|), got {dual_clip}")
    m, logp, old, adv = _token_inputs(mask, logp=logp, old_logp=old_logp, advantages=advantages)
    old, adv = jax.lax.stop_gradient(old), jax.lax.stop_gradient(adv)
    log_ratio = jnp.clip(logp - old, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    token_loss = jnp.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped) & m
    dual = jnp.zeros_like(m)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (token_loss > bound) & m
        token_loss = jnp.where(adv < 0, jnp.minimum(token_loss, bound), token_loss)
    if weights is not None:
        _check_bt("weights", weights, m.shape)
        token_loss = token_loss * jax.lax.stop_gradient(_clean(weights, m))
    loss = aggregate_loss(token_loss, m, agg, denominator=denominator)

    sg = jax.lax.stop_gradient
    k1 = sg(old - logp)
    metrics = {
        "clip_frac": masked_mean(clipped, m),
        "clip_frac_low": masked_mean(clipped & (ratio < 1.0 - clip_low), m),
        "clip_frac_high": masked_mean(clipped & (ratio > 1.0 + clip_high), m),
        "dual_clip_frac": masked_mean(dual, m),
        "approx_kl": masked_mean(k1, m),
        "approx_kl_k3": masked_mean(jnp.expm1(-k1) + k1, m),
        "ratio_mean": masked_mean(sg(ratio), m),
        "ratio_max": _masked_max(sg(ratio), m),
    }
    return loss, metrics


def explained_variance(values, returns, mask) -> Array:
    """``1 - Var(R - V) / (Var(R) + 1e-5)`` over real tokens (population variances; verl's
    ``vf_explained_var``): 1 for a perfect critic, 0 for one that predicts the mean return,
    negative for one worse than that. 0 when nothing is real."""
    m, v, r = _token_inputs(mask, values=values, returns=returns)
    v, r = jax.lax.stop_gradient(v), jax.lax.stop_gradient(r)

    def var(x):
        return masked_mean((x - masked_mean(x, m)) ** 2, m)

    return jnp.where(jnp.any(m), 1.0 - var(r - v) / (var(r) + 1e-5), 0.0)


def value_loss(values, old_values, returns, mask, *, clip: float | None = None, agg: LossAgg = LossAgg.TOKEN_MEAN,
               denominator: float | Array | None = None) -> tuple[Array, Metrics]:
    """Clipped value-function loss (PPO / verl), ``[B, T] -> scalar``.

    Per real token, ``V`` the value being trained, ``V_old`` the value of the parameters that
    produced the batch, ``R`` the return target (e.g. :func:`gae_advantages`), ``eps = clip``::

        l = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)   (clip = eps)
        l = 0.5 * (V - R)^2                                                    (clip = None)
        loss = aggregate_loss(l, mask, agg, denominator)

    The clipped branch keeps ``V`` within ``eps`` of ``V_old`` the way the policy ratio is
    clipped: where it is the larger one (only possible when ``|V - V_old| > eps``) the token has
    no gradient; elsewhere ``dl/dV = V - R``.
    Same masking and normalization rules as :func:`policy_loss` (padding is replaced by 0
    before anything else, ``denominator`` fixes ``D`` for exact micro-batch accumulation).
    Gradients flow only through ``values``; ``old_values`` (may be None without ``clip``) and
    ``returns`` are stop-gradient.

    Metrics (means over real tokens): ``clip_frac`` (the clipped branch strictly larger),
    ``explained_var`` (:func:`explained_variance` of ``V`` for ``R``), ``value_mean``,
    ``return_mean``.
    """
    _check_enum("agg", agg, LossAgg)
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip must be > 0 or None, got {clip}")
    if clip is not None and old_values is None:
        raise ValueError("a clipped value loss needs old_values (V_old)")
    m, v, r = _token_inputs(mask, values=values, returns=returns)
    r = jax.lax.stop_gradient(r)
    token_loss = 0.5 * (v - r) ** 2
    clipped = jnp.zeros_like(m)
    if clip is not None:
        _check_bt("old_values", old_values, m.shape)
        old = jax.lax.stop_gradient(_clean(old_values, m))
        v_clipped = old + jnp.clip(v - old, -clip, clip)
        loss_clipped = 0.5 * (v_clipped - r) ** 2
        # max(l, l_clipped), taking the clipped branch only where it differs from the unclipped one
        # (|V - V_old| > eps): inside the range ``V_old + (V - V_old)`` is V up to rounding, which
        # must neither count as clipped nor perturb the gradient.
        clipped = (jnp.abs(v - old) > clip) & (loss_clipped > token_loss) & m
        token_loss = jnp.where(clipped, loss_clipped, token_loss)
    loss = aggregate_loss(token_loss, m, agg, denominator=denominator)
    metrics = {
        "clip_frac": masked_mean(clipped, m),
        "explained_var": explained_variance(v, r, m),
        "value_mean": masked_mean(jax.lax.stop_gradient(v), m),
        "return_mean": masked_mean(r, m),
    }
    return loss, metrics


def masked_whiten(x, mask, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """``(x - mean) / sqrt(var + eps)`` over the real tokens of the whole batch, 0 on padding
    (PPO's advantage whitening; ``var`` the unbiased sample variance, as verl's
    ``masked_whiten``). ``shift_mean=False`` only rescales (the mean is added back)."""
    m = _mask(mask)
    x = _clean(x, m)
    n = jnp.sum(m).astype(x.dtype)
    mean = jnp.sum(x) / jnp.maximum(n, 1)
    var = jnp.sum(jnp.where(m, (x - mean) ** 2, 0.0)) / jnp.maximum(n - 1, 1)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m, out, jnp.zeros((), x.dtype))


def kl_penalty(logp, ref_logp, estimator: KLEstimator, mask=None) -> Array:
    """Per-token estimate of ``KL(pi || pi_ref)`` on tokens sampled from ``pi``, ``[B, T]``.

    With ``x = ref_logp - logp``: k1 = ``-x``, k2 = ``x^2 / 2``, k3 = ``exp(x) - x - 1``
    (``expm1`` for accuracy near 0). Gradients flow through both arguments; stop the
    reference's yourself if it is not already constant. With ``mask``, padded
    positions are 0 (and their inputs ignored). Reduce with :func:`aggregate_loss`.
    """
    _check_enum("estimator", estimator, KLEstimator)
    if jnp.shape(logp) != jnp.shape(ref_logp):
        raise ValueError(f"logp {jnp.shape(logp)} and ref_logp {jnp.shape(ref_logp)} differ in shape")
    if mask is not None:
        m = _mask(mask)
        _check_bt("logp", logp, m.shape)
        logp, ref_logp = _clean(logp, m), _clean(ref_logp, m)
    x = _float(ref_logp) - _float(logp)
    if estimator is KLEstimator.K1:
        return -x
    if estimator is KLEstimator.K2:
        return 0.5 * x**2
    return jnp.expm1(x) - x


def entropy_from_logits(logits) -> Array:
    """Entropy of ``softmax(z)`` per position, ``[B, T, V] -> [B, T]``:
    ``H = -sum_v p_v log p_v``, ``log p = log_softmax(z)`` (float32, stable for any logit
    scale; ``-inf`` logits, e.g. masked vocabulary, contribute 0 with finite gradients)."""
    logp = jax.nn.log_softmax(_float(logits), axis=-1)
    p = jnp.exp(logp)
    return -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1)


# --------------------------------------------------------------------------- rollout correction


def rollout_correction_weights(old_logp_trainer, rollout_logp, mask,
                               correction: Correction | Sequence[Correction], *, tis_cap: float = 2.0,
                               mis_low: float = 0.5, mis_high: float = 5.0, geo_low: float = 0.99,
                               geo_high: float = 1.01, kl_estimator: KLEstimator = KLEstimator.K3,
                               kl_threshold: float = 0.1, normalize: bool = False) -> tuple[Array, Metrics]:
    """Stop-gradient weights ``w [B, T]`` correcting the trainer/rollout-engine mismatch.

    ``s_t = old_logp_trainer - rollout_logp`` (log of ``r_t = pi_trainer / pi_rollout``) on
    real tokens, ``S_b = sum_t s_t``, ``n_b`` real tokens in row ``b``:

    * ``NONE``:            ``w = 1``
    * ``TOKEN_TIS``:       ``w_t = min(r_t, C) = exp(min(s_t, log C))``, ``C = tis_cap``
      (``C = inf``: plain importance sampling ``w = r``)
    * ``TOKEN_MIS``:       ``w_t = r_t`` if ``mis_low <= r_t <= mis_high`` else 0 (IcePop keeps the ratio)
    * ``TOKEN_MASK``:      ``w_t = 1`` if ``mis_low <= r_t <= mis_high`` else 0
    * ``SEQ_TIS``:         ``w_b = exp(min(S_b, log C))`` on all tokens of ``b``
    * ``SEQ_MASK_GEO``:    ``w_b = 1`` if ``geo_low <= exp(S_b / n_b) <= geo_high`` else 0
    * ``TOKEN_KL_REJECT``: ``w_t = 1`` if ``k_t <= kl_threshold`` else 0
    * ``SEQ_KL_REJECT``:   ``w_b = 1`` if ``mean_t k_t <= kl_threshold`` else 0

    where ``k_t = kl_penalty(rollout_logp, old_logp_trainer, kl_estimator)`` (K2 or K3)
    estimates ``KL(pi_rollout || pi_trainer)`` on the rollout's own samples. The
    thresholds compare in log space. A sequence of corrections multiplies their
    weights (e.g. ``(SEQ_TIS, SEQ_MASK_GEO)``: capped sequence IS plus geometric
    rejection). ``w = 0`` on padding. The geometric/KL defaults are illustrative; tune
    them to the mismatch you measure with :func:`mismatch_metrics`. ``normalize`` then divides the
    weights by their mean over every real token of the batch (``w / mean(w)``, mean 1; a batch
    whose weights are all 0 stays 0): the correction reweights tokens against each other without
    changing the update's overall scale. The metrics describe the weights as returned.

    Metrics: ``weight_mean``, ``weight_max`` (over real tokens), ``token_kept_frac``
    (real tokens with ``w > 0``), ``seq_kept_frac`` (non-empty rows with some ``w > 0``),
    ``capped_frac`` (real tokens whose TIS cap binds, 0 without TIS).
    """
    corrections = (correction,) if isinstance(correction, Correction) else tuple(correction)
    for c in corrections:
        _check_enum("correction", c, Correction)
    if kl_estimator not in (KLEstimator.K2, KLEstimator.K3):
        raise ValueError(f"kl_estimator must be KLEstimator.K2 or K3 (non-negative), got {kl_estimator!r}")
    m, old, roll = _token_inputs(mask, old_logp_trainer=old_logp_trainer, rollout_logp=rollout_logp)
    s = jax.lax.stop_gradient(old - roll)
    dtype = s.dtype
    n_b = jnp.sum(m, axis=1).astype(dtype)
    S_b = jnp.sum(s, axis=1)
    log_cap = jnp.log(jnp.asarray(tis_cap, dtype))
    w = jnp.ones_like(s)
    capped = jnp.zeros_like(m)

    for c in corrections:
        if c is Correction.NONE:
            continue
        if c is Correction.TOKEN_TIS:
            w = w * jnp.exp(jnp.minimum(s, log_cap))
            capped = capped | (s > log_cap)
        elif c in (Correction.TOKEN_MIS, Correction.TOKEN_MASK):
            keep = (s >= jnp.log(jnp.asarray(mis_low, dtype))) & (s <= jnp.log(jnp.asarray(mis_high, dtype)))
            ratio = jnp.exp(jnp.where(keep, s, 0.0)) if c is Correction.TOKEN_MIS else jnp.ones_like(s)
            w = w * jnp.where(keep, ratio, 0.0)
        elif c is Correction.SEQ_TIS:
            w = w * jnp.exp(jnp.minimum(S_b, log_cap))[:, None]
            capped = capped | (S_b > log_cap)[:, None]
        elif c is Correction.SEQ_MASK_GEO:
            log_geo = S_b / jnp.maximum(n_b, 1.0)
            keep = (log_geo >= jnp.log(jnp.asarray(geo_low, dtype))) & (log_geo <= jnp.log(jnp.asarray(geo_high, dtype)))
            w = w * keep[:, None].astype(dtype)
        else:  # KL rejection, token or sequence
            k = kl_penalty(roll, old, kl_estimator)
            if c is Correction.SEQ_KL_REJECT:
                k = (jnp.sum(jnp.where(m, k, 0.0), axis=1) / jnp.maximum(n_b, 1.0))[:, None]
            w = w * (k <= kl_threshold).astype(dtype)

    w = jnp.where(m, w, 0.0)
    if normalize:
        mean = masked_mean(w, m)
        w = jnp.where(mean > 0, w / jnp.where(mean > 0, mean, 1.0), w)
    w = jax.lax.stop_gradient(w)
    nonempty = n_b > 0
    metrics = {
        "weight_mean": masked_mean(w, m),
        "weight_max": _masked_max(w, m),
        "token_kept_frac": masked_mean(w > 0, m),
        "seq_kept_frac": jnp.sum(jnp.any(w > 0, axis=1) & nonempty) / jnp.maximum(jnp.sum(nonempty), 1),
        "capped_frac": masked_mean(capped & m, m),
    }
    return w, metrics


def mismatch_metrics(trainer_logp, rollout_logp, mask) -> Metrics:
    """Scalar diagnostics of the trainer/rollout-engine mismatch over real tokens.

    Tokens are sampled from the rollout engine; ``d_t = trainer_logp - rollout_logp``,
    ``r_t = exp(d_t)``, means ``E`` are over the ``N`` real tokens:

    * ``kl_k1 = E[-d]``, ``kl_k3 = E[r - 1 - d]``: estimates of ``KL(pi_rollout || pi_trainer)``
    * ``chi2 = E[(r - 1)^2]``: chi-square divergence ``chi^2(pi_trainer || pi_rollout)``
      (the variance of the token importance weight)
    * ``log_ratio_mean / _std / _max / _min``: statistics of ``d`` (std with ddof 0)
    * ``prob_mult_error = E[exp|d|]``: mean multiplicative probability error (>= 1)
    * ``ess_token = (sum r)^2 / (N sum r^2)``, ``ess_seq`` the same over sequence
      weights ``exp(sum_t d_t)`` of the non-empty rows (log space): normalized
      effective sample size in ``(0, 1]``
    * ``ppl_trainer = exp(-E[trainer_logp])``, ``ppl_rollout = exp(-E[rollout_logp])``,
      ``ppl_gap = ppl_trainer - ppl_rollout``, ``ppl_ratio = ppl_trainer / ppl_rollout``
    """
    m, lt, lr = _token_inputs(mask, trainer_logp=trainer_logp, rollout_logp=rollout_logp)
    lt, lr = jax.lax.stop_gradient(lt), jax.lax.stop_gradient(lr)
    d = lt - lr
    mean_d = masked_mean(d, m)

    def lse_masked(x, keep):  # log sum_{keep} exp(x); -inf when nothing is kept
        return jax.nn.logsumexp(jnp.where(keep, x, -jnp.inf))

    def ess(logw, keep):
        n = jnp.sum(keep).astype(logw.dtype)
        val = jnp.exp(2.0 * lse_masked(logw, keep) - lse_masked(2.0 * logw, keep) - jnp.log(n))
        return jnp.where(n > 0, val, 0.0)

    nonempty = jnp.any(m, axis=1)
    ppl_t, ppl_r = jnp.exp(-masked_mean(lt, m)), jnp.exp(-masked_mean(lr, m))
    return {
        "kl_k1": -mean_d,
        "kl_k3": masked_mean(jnp.expm1(d) - d, m),
        "chi2": masked_mean(jnp.expm1(d) ** 2, m),
        "log_ratio_mean": mean_d,
        "log_ratio_std": jnp.sqrt(masked_mean((d - mean_d) ** 2, m)),
        "log_ratio_max": _masked_max(d, m),
        "log_ratio_min": _masked_min(d, m),
        "prob_mult_error": masked_mean(jnp.exp(jnp.abs(d)), m),
        "ess_token": ess(d, m),
        "ess_seq": ess(jnp.sum(d, axis=1), nonempty),
        "ppl_trainer": ppl_t,
        "ppl_rollout": ppl_r,
        "ppl_gap": ppl_t - ppl_r,
        "ppl_ratio": ppl_t / ppl_r,
    }

