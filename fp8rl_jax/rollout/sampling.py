"""Token sampling for the rollout engine: temperature, top-k, top-p, per-row seeds.

Everything here runs inside the engine's jitted decode loop: per-row settings are
arrays (``B`` decode slots, ``V`` vocabulary), nothing branches in Python on a value,
and ``B`` and ``V`` are the only static quantities.

Logprob convention (the importance-sampling correction relies on it)
---------------------------------------------------------------------
The logprob returned for a sampled token is that of the FULL, UNTRUNCATED,
temperature-scaled distribution, in float32::

    logprob = log_softmax(logits / T)[token]     for T > 0
    logprob = log_softmax(logits)[token]         for T == 0 (greedy)

It is computed BEFORE top-k / top-p truncation and renormalization, so it is the
same number the trainer gets from ``log_softmax(logits / T)`` with the same ``T``,
whatever top-k / top-p the request used. (It is therefore *not* the log-probability
under the truncated distribution the token was actually drawn from; a correction
that needs that must account for truncation itself. With ``top_k = 0`` and
``top_p = 1`` the two coincide.)

Sampling
--------
* ``T == 0`` (greedy): ``argmax(logits)``, the lowest index on ties; top-k, top-p
  and the key are ignored.
* ``T > 0``: ``z = logits / T``; keep the ``top_k`` highest (``top_k = 0`` or
  ``top_k >= V``: all); then top-p on the top-k-renormalized distribution (the
  vLLM order); renormalize; draw. Two draws, both exact samples of ``softmax(z)``
  restricted to the kept set and renormalized (`Draw`):

  - ``Draw.GUMBEL``: Gumbel-max, ``token = argmax_{j kept}(z_j + g_j)``
    with ``g ~ Gumbel(0, 1)^V`` from the row's key: ``V`` threefry numbers per row.
  - ``Draw.INVERSE_CDF`` (the default): one uniform ``u`` per row from its key; the token is the
    first kept one (vocabulary order) whose cumulative unnormalized mass
    ``sum_{i <= j} exp(z_i - max z)`` exceeds ``u`` times the total, found in two
    levels: masses of 128-token chunks (one pass over ``[B, V]``, fused with the
    ``exp``; the same variadic reduction sums every token's mass for the logprobs'
    ``logsumexp``, and the max comes from the greedy ``argmax``), their prefix sums
    ``[B, V / 128]``, then the prefix sums inside the one chosen chunk (its 128 logits
    gathered again). A pick only ever lands on a token of positive mass (float32
    rounding of the prefix sums at ``u`` near 1 falls back to the last such token).
    It draws one random number per row where Gumbel draws ``V``, which made it the
    faster of the two in the decode step.

Design choices, and why
-----------------------
* **Ranking and ties.** Tokens are ranked by ``z`` descending, ties broken by the
  lower token id first (a stable sort over ``-z``). Top-k keeps exactly the first
  ``top_k`` ranks, so tokens tied with the k-th value at a higher id are dropped
  (vLLM keeps every tie; we prefer an exact, deterministic count).
* **Top-p boundary.** With ``p_r`` the top-k-renormalized probability at rank ``r``,
  rank ``r`` is kept iff the mass strictly before it is below ``top_p``:
  ``sum_{s < r} p_s < top_p``. That is the smallest prefix whose cumulative mass is
  ``>= top_p``; rank 0 is always kept (its prefix mass is 0 and ``top_p > 0``).
  Ties at the boundary follow the rank order above (lower id first). The prefix
  sums are float32 ``cumsum`` of unnormalized ``exp(z - max z)`` compared against
  ``top_p * total``, so a boundary within float32 rounding of ``top_p`` may fall
  either way, deterministically for given logits. ``top_p >= 1`` keeps everything
  exactly (no float32 cumsum may cut the far tail).
* **One sort per row, and only when needed.** The kept set is found in sorted space,
  then mapped back to vocabulary order by a threshold ``(value, id)`` comparison
  (no scatter). When no sampled row of the batch uses top-k or top-p (the usual RL
  setting, ``T = 1``), the ``[B, V]`` sort is skipped entirely: decided on the host
  when the caller says (``sample(..., truncation=False)``: the engine knows its rows'
  settings), else by a ``lax.cond``. A conditional on XLA:GPU copies its predicate to
  the host and blocks the launching thread until the GPU reaches it, so a jitted loop
  around one cannot be dispatched ahead of the device (see ``sample``). Because the
  Gumbel noise is applied in vocabulary order, the sorted and unsorted paths draw
  the same token for the same key, so a row's result never depends on its
  neighbours' settings. (The sort is a stable ``lax.sort`` of ``(-z, id)`` over
  ``[B, V]``, followed by one ``cumsum``; per-row ``top_k`` values differ, so
  ``lax.top_k`` with a static ``k`` does not apply. GPU cost not yet measured.)
* **Zeros are canonicalized** (``-0.0 -> 0.0``) before sorting: the sort uses a
  total order in which ``-0.0 < 0.0`` while ``==`` does not tell them apart, and
  the threshold comparison must agree with the sort. Logits must be finite or
  ``-inf`` (masked vocabulary padding); NaN rows give unspecified tokens.
* **Keys depend only on (request seed, absolute position)**; see :func:`row_keys`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = ["Draw", "SamplingConfig", "SlotSampling", "row_keys", "sample", "truncates"]

_SEED_LIMIT = 2**31
_CDF_CHUNK = 128  # tokens per chunk of the inverse-CDF draw's first level


class Draw(enum.Enum):
    """How a sampled (T > 0) row draws its token from the kept, renormalized ``softmax(z)``
    (module note): ``GUMBEL`` (V Gumbel numbers per row) or ``INVERSE_CDF`` (one uniform per row).
    Both are exact; for the same key they pick different tokens."""

    GUMBEL = "gumbel"
    INVERSE_CDF = "inverse_cdf"


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """User-facing sampling settings of one request.

    Attributes:
      temperature: softmax temperature ``T``; ``0`` means greedy (argmax).
      top_p: nucleus mass in ``(0, 1]``; ``1`` is off.
      top_k: keep the ``top_k`` most likely tokens; ``0`` is off.
      max_tokens: most new tokens to generate (``>= 1``).
      stop_token_ids: tokens that end the response (besides EOS unless ``ignore_eos``);
        the stop token itself is part of the response. A list is stored as a tuple.
      ignore_eos: keep generating past EOS (up to ``max_tokens`` or a stop token).
      seed: request seed in ``[0, 2**31)``; with the absolute token position it fixes
        every draw of the request (:func:`row_keys`). Several samples of one prompt
        (a GRPO group) need distinct seeds, or they are identical.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self):
        # Every invalid setting, wrong types included, raises ValueError: one type for callers to catch.
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if not _is_real(p) or not (0 < p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
            raise ValueError(  # noqa: TRY004
                f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        stops = tuple(self.stop_token_ids)
        bad = [s for s in stops if not _is_int(s) or s < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be ints >= 0, got invalid entries {bad!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")  # noqa: TRY004
        if not _is_int(self.seed) or not (0 <= self.seed < _SEED_LIMIT):
            raise ValueError(f"seed must be an int in [0, 2**31), got {self.seed!r}")


@flax.struct.dataclass
class SlotSampling:
    """Per-row sampling parameters of ``B`` decode slots (the jitted view of :class:`SamplingConfig`).

    Attributes:
      temperature: ``[B] float32``; ``0`` = greedy row.
      top_p: ``[B] float32`` in ``(0, 1]``; ``>= 1`` = off.
      top_k: ``[B] int32``; ``0`` (or ``>= V``) = off.
      seed: ``[B] uint32`` request seed, in ``[0, 2**31)``.
    """

    temperature: Array
    top_p: Array
    top_k: Array
    seed: Array

    @classmethod
    def from_configs(cls, configs: Sequence[SamplingConfig]) -> SlotSampling:
        """Stacks per-request configs into rows (row ``b`` = ``configs[b]``)."""
        if not configs:
            raise ValueError("from_configs needs at least one SamplingConfig")
        for i, c in enumerate(configs):
            if not isinstance(c, SamplingConfig):
                raise TypeError(f"configs[{i}] must be a SamplingConfig, got {type(c).__name__}")
        return cls(
            temperature=jnp.asarray(np.array([c.temperature for c in configs], np.float32)),
            top_p=jnp.asarray(np.array([c.top_p for c in configs], np.float32)),
            top_k=jnp.asarray(np.array([c.top_k for c in configs], np.int32)),
            seed=jnp.asarray(np.array([c.seed for c in configs], np.uint32)),
        )

    @classmethod
    def empty(cls, batch: int) -> SlotSampling:
        """``batch`` greedy rows (``T = 0``, no top-k / top-p, seed 0): the state of idle slots."""
        if not _is_int(batch) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        return cls(
            temperature=jnp.zeros((batch,), jnp.float32),
            top_p=jnp.ones((batch,), jnp.float32),
            top_k=jnp.zeros((batch,), jnp.int32),
            seed=jnp.zeros((batch,), jnp.uint32),
        )


def row_keys(seed: Array, position: Array) -> Array:
    """One PRNG key per row: ``key_b = fold_in(key(seed_b), position_b)``.

    ``seed [B]`` (uint32 or int32, in ``[0, 2**31)``) is the request seed and
    ``position [B]`` (int32) the absolute position in the sequence of the token
    being sampled. The key depends on nothing else, so a request's tokens are a
    function of (its logits, seed, position) only: independent of batch
    composition, slot index, preemption and recompute, and of how many decode steps
    run per host round trip. The same (seed, position) always gives the same key;
    distinct positions or seeds give independent streams. Uses JAX's default PRNG
    implementation (threefry2x32 unless configured otherwise).

    Returns a typed key array of shape ``[B]``.
    """
    seed = jnp.asarray(seed).astype(jnp.uint32)
    position = jnp.asarray(position).astype(jnp.uint32)
    if seed.ndim != 1 or seed.shape != position.shape:
        raise ValueError(f"seed and position must both be [B]; got {seed.shape} and {position.shape}")
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


def _kept_threshold(z: Array, top_k: Array, top_p: Array) -> tuple[Array, Array]:
    """``(z* [B], j* [B])``: the last kept (value, id) of each row after top-k then top-p;
    token ``j`` survives iff ``(z_j, -j) >= (z*, -j*)`` (`_keep`).

    One stable sort of ``-z`` per row ranks tokens (value descending, lower id first
    on ties). Rank ``r`` is kept iff ``r < k`` and ``sum_{s<r} e_s < top_p * sum_s e_s``
    with ``e = exp(z_sorted - max z) * [rank < k]``. The kept ranks are a prefix of
    length ``n``; ``(z*, j*)`` is the value and id at rank ``n - 1``.
    """
    _, v = z.shape
    ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    neg_sorted, sorted_ids = jax.lax.sort((-z, ids), dimension=1, num_keys=1, is_stable=True)
    z_sorted = -neg_sorted
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)[:, None]
    in_k = ids < k  # ids doubles as the rank iota here
    e = jnp.where(in_k, jnp.exp(z_sorted - z_sorted[:, :1]), 0.0)
    c = jnp.cumsum(e, axis=1)
    mass_before = jnp.concatenate([jnp.zeros_like(c[:, :1]), c[:, :-1]], axis=1)
    in_p = (mass_before < top_p[:, None] * c[:, -1:]) | (top_p[:, None] >= 1.0)
    n_keep = jnp.sum(in_k & in_p, axis=1, keepdims=True, dtype=jnp.int32)  # >= 1: rank 0 always kept
    z_star = jnp.take_along_axis(z_sorted, n_keep - 1, axis=1)[:, 0]
    id_star = jnp.take_along_axis(sorted_ids, n_keep - 1, axis=1)[:, 0]
    return z_star, id_star


def _keep(z: Array, z_star: Array, id_star: Array, ids: Array | None = None) -> Array:
    """``[B, n] bool``: ``(z_j, -j) >= (z*, -j*)`` per row, ``j`` the token ids of ``z``'s columns
    (``ids``, default ``0..n-1``). With ``(-inf, V)`` every token is kept."""
    if ids is None:
        ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    return (z > z_star[:, None]) | ((z == z_star[:, None]) & (ids <= id_star[:, None]))


def _first_above(cum: Array, target: Array, mass: Array) -> Array:
    """``[B]``: per row, the first index ``i`` with ``cum[i] > target`` and ``mass[i] > 0``; where
    float32 rounding leaves none (``target`` within rounding of the total), the last index with
    ``mass > 0``. ``cum`` is the prefix sums of ``mass >= 0``; a row must have some positive mass."""
    idx = jax.lax.broadcasted_iota(jnp.int32, mass.shape, 1)
    above = (cum > target[:, None]) & (mass > 0)
    first = jnp.argmax(above, axis=1).astype(jnp.int32)
    last = jnp.max(jnp.where(mass > 0, idx, 0), axis=1)
    return jnp.where(jnp.any(above, axis=1), first, last)


def _inverse_cdf(z: Array, z_max: Array, z_star: Array, id_star: Array, u: Array) -> tuple[Array, Array]:
    """``(tokens [B] int32, log_z [B])``: the `Draw.INVERSE_CDF` token of each row (module note) for
    uniforms ``u [B]`` in ``[0, 1)``, and ``logsumexp(z)`` over the whole vocabulary from the same pass
    (the chunk masses before truncation, beside the kept ones); ``z_max`` is each row's max (always
    kept, so every row has mass)."""
    b, v = z.shape
    c = -(-v // _CDF_CHUNK)

    def chunks(w):  # [B, C, 128], zero-padded
        return jnp.pad(w, ((0, 0), (0, c * _CDF_CHUNK - v))).reshape(b, c, _CDF_CHUNK)

    # both chunk masses, all tokens' and the kept ones', as one variadic reduction: one read of the logits
    # with the exp fused in, whatever XLA would do with two sibling reductions of a shared exp
    e = jnp.exp(z - z_max[:, None])
    mass_all, mass = jax.lax.reduce((chunks(e), chunks(jnp.where(_keep(z, z_star, id_star), e, 0.0))),
                                    (jnp.float32(0), jnp.float32(0)), lambda x, y: (x[0] + y[0], x[1] + y[1]), (2,))
    log_z = z_max + jnp.log(jnp.sum(mass_all, axis=1))
    cum = jnp.cumsum(mass, axis=1)
    target = u * cum[:, -1]
    chunk = _first_above(cum, target, mass)
    base = jnp.where(chunk > 0, jnp.take_along_axis(cum, jnp.maximum(chunk - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    cols = chunk[:, None] * _CDF_CHUNK + jax.lax.broadcasted_iota(jnp.int32, (b, _CDF_CHUNK), 1)
    zc = jnp.take_along_axis(z, jnp.minimum(cols, v - 1), axis=1)  # the chosen chunk's logits, again
    kept = (cols < v) & _keep(zc, z_star, id_star, cols)
    wc = jnp.where(kept, jnp.exp(zc - z_max[:, None]), 0.0)
    return chunk * _CDF_CHUNK + _first_above(base[:, None] + jnp.cumsum(wc, axis=1), target, wc), log_z


def truncates(config: SamplingConfig, vocab_size: int) -> bool:
    """Whether a request's draw is truncated (top-k below the vocabulary or top-p below 1, at
    ``T > 0``): when no row of a call truncates, ``sample(..., truncation=False)`` is exact for it."""
    return config.temperature > 0 and (0 < config.top_k < vocab_size or config.top_p < 1)


def sample(logits: Array, sampling: SlotSampling, keys: Array,
           draw: Draw = Draw.INVERSE_CDF, truncation: bool | None = None) -> tuple[Array, Array]:
    """Draws one token per row; returns ``(tokens [B] int32, logprobs [B] float32)``.

    Args:
      logits: ``[B, V]`` raw logits (upcast to float32); finite or ``-inf``.
      sampling: per-row parameters (:class:`SlotSampling` with ``[B]`` fields).
      keys: ``[B]`` typed PRNG keys, normally ``row_keys(sampling.seed, position)``.
      draw: how sampled rows draw (`Draw`); greedy rows and the logprobs do not depend on it.
      truncation: whether any row truncates (top-k / top-p), decided by the caller on the host
        (`truncates` of each row's config): ``True`` always finds the kept sets (the sort),
        ``False`` keeps every token, and must only be given when no row truncates. ``None``
        (default) decides on the device with a ``lax.cond``: on XLA:GPU that copies the
        predicate to the host and blocks the launching thread until the GPU gets there, so a
        jitted loop around it cannot run ahead of the device (the engine passes the flag).
        Same tokens and logprobs all three ways.

    ``logprobs[b] = log_softmax(logits[b] / T_b)[tokens[b]]`` (``T_b = 1`` for greedy
    rows), over the full vocabulary, before top-k / top-p truncation: see the module
    docstring. Greedy rows return ``argmax`` (lowest id on ties); other rows draw
    from ``softmax(logits / T)`` restricted to the top-k-then-top-p set and
    renormalized.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    b, v = logits.shape
    for name in ("temperature", "top_p", "top_k", "seed"):
        shape = getattr(sampling, name).shape
        if shape != (b,):
            raise ValueError(f"sampling.{name} must be [{b}] to match logits {logits.shape}, got {shape}")
    if keys.shape != (b,):
        raise ValueError(f"keys must be [{b}], got {keys.shape}")
    if not isinstance(draw, Draw):
        raise ValueError(f"draw must be a Draw, got {draw!r}")
    if truncation is not None and not isinstance(truncation, (bool, np.bool_)):
        raise ValueError(f"truncation must be None, True or False, got {truncation!r}")

    temperature = sampling.temperature.astype(jnp.float32)
    top_p = sampling.top_p.astype(jnp.float32)
    top_k = sampling.top_k.astype(jnp.int32)
    greedy = temperature <= 0.0

    def scaled(logits):
        z = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)[:, None]
        return jnp.where(z == 0.0, 0.0, z)  # -0.0 -> 0.0, so == agrees with the sort's total order

    z = scaled(logits)
    # per-row thresholds rather than a [B, V] mask: without truncation, (-inf, V) keeps every token and the
    # comparison fuses into the draw (a mask of ones would be its own [B, V] write every decode step).
    # `kept` scales the logits itself: as an operand of the device cond (truncation=None), z would be a
    # buffer, a float32 [B, V] write every step whether or not the branch runs.
    def kept():
        return _kept_threshold(scaled(logits), top_k, top_p)

    def everything():
        return jnp.full((b,), -jnp.inf, jnp.float32), jnp.full((b,), v, jnp.int32)

    if truncation is None:
        needs_truncation = ~greedy & (((top_k > 0) & (top_k < v)) | (top_p < 1.0))  # `truncates`, per row
        z_star, id_star = jax.lax.cond(jnp.any(needs_truncation), kept, everything)
    else:
        z_star, id_star = kept() if truncation else everything()
    top = jnp.argmax(z, axis=1).astype(jnp.int32)
    if draw is Draw.GUMBEL:
        log_z = jax.nn.logsumexp(z, axis=1)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys)
        drawn = jnp.argmax(jnp.where(_keep(z, z_star, id_star), z + gumbel, -jnp.inf), axis=1).astype(jnp.int32)
    else:  # the max from the argmax, logsumexp(z) from the draw's own pass over the vocabulary
        u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
        drawn, log_z = _inverse_cdf(z, jnp.take_along_axis(z, top[:, None], axis=1)[:, 0], z_star, id_star, u)
    tokens = jnp.where(greedy, top, drawn)

    logprobs = jnp.take_along_axis(z, tokens[:, None], axis=1)[:, 0] - log_z
    return tokens, logprobs
