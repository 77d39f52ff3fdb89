"""Tests for :mod:`fp8rl_jax.rollout.sampling` (CPU, fresh random inputs from fixed numpy seeds).

The statistical tests compare empirical token frequencies with the exact truncated,
renormalized ``softmax(logits / T)`` computed in float64 numpy, by a chi-square test at
``ALPHA = 1e-6`` each, for each draw (`Draw`: Gumbel-max, inverse CDF). There are
``len(STAT_CASES) = 7`` such tests per draw, plus the 2 of ``test_distribution_untruncated_path``
per draw and the 2 of ``test_inverse_cdf_across_chunks``, 20 in all, so for a sampler that is correct the
chance that a random choice of seeds fails any of them is at most ``20 * 1e-6 = 2e-5`` (the seeds
here are fixed, so the outcome is deterministic run to run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from fp8rl_jax.rollout import sampling as sampling_mod
from fp8rl_jax.rollout.sampling import Draw, SamplingConfig, SlotSampling, row_keys, sample, truncates

ALPHA = 1e-6
N_DRAWS = 20_000
sample_jit = jax.jit(sample, static_argnames=("draw", "truncation"))
row_keys_jit = jax.jit(row_keys)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Exact float64 truncated, renormalized softmax(logits / T): rank by value desc, id asc;
    keep the first top_k; keep rank r iff the renormalized mass before it is < top_p."""
    z = np.asarray(logits, np.float64) / temperature
    v = z.shape[0]
    order = np.lexsort((np.arange(v), -z))
    p = np.exp(log_softmax64(z))[order]
    k = v if top_k <= 0 or top_k >= v else top_k
    p[k:] = 0.0
    p /= p.sum()
    before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    if top_p < 1.0:
        p[before >= top_p] = 0.0
    p /= p.sum()
    out = np.zeros(v)
    out[order] = p
    return out


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit over the support of ``probs``; bins expected < 5 are pooled."""
    n = counts.sum()
    support = probs > 0
    obs, exp = counts[support].astype(np.float64), probs[support] * n
    small = exp < 5
    if small.sum() > 0:
        obs = np.concatenate([obs[~small], [obs[small].sum()]])
        exp = np.concatenate([exp[~small], [exp[small].sum()]])
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def draw(logits_row: np.ndarray, configs: list[SamplingConfig], n: int, position: int = 0,
         how: Draw = Draw.GUMBEL):
    """n draws per config in one call (rows = configs x draws, distinct seeds); counts [C, V]."""
    v = logits_row.shape[0]
    # the rows of SlotSampling.from_configs([replace(c, seed=1000 * i + j) for each config i, draw j]), stacked from
    # one row per config (a SamplingConfig per row costs ~60 us to validate: seconds for 140k rows)
    per_config = SlotSampling.from_configs(configs)
    seeds = (1000 * np.arange(len(configs))[:, None] + np.arange(n)[None, :]).ravel()
    assert seeds.max() < 2**31
    sp = jax.tree.map(lambda a: jnp.asarray(np.repeat(np.asarray(a), n)), per_config).replace(
        seed=jnp.asarray(seeds, jnp.uint32))
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (len(seeds), v))
    keys = row_keys_jit(sp.seed, jnp.full((len(seeds),), position, jnp.int32))
    tokens, _ = sample_jit(logits, sp, keys, draw=how)
    tokens = np.asarray(tokens).reshape(len(configs), n)
    return np.stack([np.bincount(t, minlength=v) for t in tokens])


# --- logprob convention ---------------------------------------------------------------------


def test_logprob_convention_full_distribution_before_truncation():
    rng = np.random.default_rng(0)
    b, v = 64, 1000
    logits = (rng.normal(size=(b, v)) * 3.0).astype(np.float32)
    temps = [0.0, 0.7, 1.0, 1.3]
    truncs = [(0, 1.0), (5, 1.0), (0, 0.5), (20, 0.9)]
    configs = [SamplingConfig(temperature=temps[i % 4], top_k=truncs[(i // 4) % 4][0],
                              top_p=truncs[(i // 4) % 4][1], seed=i) for i in range(b)]
    sp = SlotSampling.from_configs(configs)
    tokens, logprobs = sample_jit(jnp.asarray(logits), sp, row_keys_jit(sp.seed, jnp.arange(b)))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert tokens.dtype == np.int32 and logprobs.dtype == np.float32
    n_differs = 0
    for i, c in enumerate(configs):
        t = c.temperature if c.temperature > 0 else 1.0
        full = log_softmax64(logits[i] / np.float64(t))
        np.testing.assert_allclose(logprobs[i], full[tokens[i]], rtol=1e-5, atol=2e-5, err_msg=f"row {i} {c}")
        if c.temperature > 0 and (c.top_k or c.top_p < 1):
            p_trunc = reference_probs(logits[i], c.temperature, c.top_k, c.top_p)
            assert p_trunc[tokens[i]] > 0, f"row {i} sampled a truncated token"
            if abs(np.log(p_trunc[tokens[i]]) - full[tokens[i]]) > 1e-2:
                n_differs += 1  # the returned value is not the truncated-renormalized logprob
    assert n_differs >= 20


def test_truncation_does_not_change_logprob():
    """The same token under truncated and untruncated settings gets the identical logprob."""
    rng = np.random.default_rng(1)
    b, v = 32, 500
    logits = jnp.asarray((rng.normal(size=(b, v)) * 4.0).astype(np.float32))
    keys = row_keys_jit(jnp.arange(b, dtype=jnp.uint32), jnp.full((b,), 7))
    plain = SlotSampling.from_configs([SamplingConfig(temperature=0.9, seed=i) for i in range(b)])
    trunc = SlotSampling.from_configs([SamplingConfig(temperature=0.9, top_k=3, top_p=0.8, seed=i)
                                       for i in range(b)])
    t_plain, lp_plain = map(np.asarray, sample_jit(logits, plain, keys))
    t_trunc, lp_trunc = map(np.asarray, sample_jit(logits, trunc, keys))
    same = t_plain == t_trunc
    assert same.sum() >= 8  # at T=0.9 with scale-4 logits most draws hit the top tokens
    np.testing.assert_array_equal(lp_plain[same], lp_trunc[same])
    # every logprob is the full-distribution one, whatever the truncation
    full = log_softmax64(np.asarray(logits) / 0.9)
    np.testing.assert_allclose(lp_trunc, full[np.arange(b), t_trunc], rtol=1e-5, atol=2e-5)


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax_lowest_index_on_ties():
    rng = np.random.default_rng(2)
    b, v = 16, 300
    logits = (rng.normal(size=(b, v)) * 2.0).astype(np.float32)
    logits[3, [10, 200]] = logits[3].max() + 1.0  # tie -> lowest id
    logits[4, :] = 0.0  # all tied, mixed signs of zero
    logits[4, ::2] = -0.0
    logits[5, :50] = -np.inf  # masked entries
    configs = [SamplingConfig(temperature=0.0, top_k=(i % 3) * 2, top_p=[1.0, 0.3][i % 2], seed=i)
               for i in range(b)]
    sp = SlotSampling.from_configs(configs)
    keys = row_keys_jit(sp.seed, jnp.arange(b) * 13)
    tokens, logprobs = map(np.asarray, sample_jit(jnp.asarray(logits), sp, keys))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=1))
    assert tokens[3] == 10 and tokens[4] == 0
    full = log_softmax64(logits)
    np.testing.assert_allclose(logprobs, full[np.arange(b), tokens], rtol=1e-5, atol=2e-5)
    # keys do not matter for greedy rows
    tokens2, _ = sample_jit(jnp.asarray(logits), sp, row_keys_jit(sp.seed + 1, jnp.arange(b)))
    np.testing.assert_array_equal(tokens2, tokens)


# --- distribution -----------------------------------------------------------------------------

STAT_LOGITS = (np.random.default_rng(4).normal(size=10) * 0.7).astype(np.float32)
STAT_CASES = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.5": SamplingConfig(temperature=0.5),
    "top_k3": SamplingConfig(temperature=1.0, top_k=3),
    "top_p0.6": SamplingConfig(temperature=1.0, top_p=0.6),
    "top_k5_top_p0.7_T0.8": SamplingConfig(temperature=0.8, top_k=5, top_p=0.7),
    "off_explicit_T1.3": SamplingConfig(temperature=1.3, top_k=0, top_p=1.0),
    "top_k_ge_V": SamplingConfig(temperature=1.0, top_k=10, top_p=1.0),
}


@pytest.fixture(scope="module", params=list(Draw), ids=lambda d: d.value)
def stat_counts(request):
    """All cases in one call per draw: truncating rows force the sorted path for every row."""
    return draw(STAT_LOGITS, list(STAT_CASES.values()), N_DRAWS, how=request.param)


@pytest.mark.parametrize("name", list(STAT_CASES))
def test_distribution_matches_truncated_softmax(name, stat_counts):
    c = STAT_CASES[name]
    counts = stat_counts[list(STAT_CASES).index(name)]
    probs = reference_probs(STAT_LOGITS, c.temperature, c.top_k, c.top_p)
    if c.top_p < 1:  # the fixture must not sit on a top-p boundary
        p_k = reference_probs(STAT_LOGITS, c.temperature, c.top_k, 1.0)
        before = np.concatenate([[0.0], np.cumsum(np.sort(p_k)[::-1])[:-1]])
        assert np.min(np.abs(before - c.top_p)) > 0.02
    expected_kept = {"top_k3": 3}.get(name)
    if expected_kept:
        assert (probs > 0).sum() == expected_kept
    assert counts.sum() == N_DRAWS
    assert counts[probs == 0].sum() == 0, f"{name}: truncated tokens were sampled: {counts}"
    p = chi_square_pvalue(counts, probs)
    assert p > ALPHA, f"{name}: chi-square p={p:.3g}; counts={counts}, expected={probs * N_DRAWS}"


def test_topk_topp_cases_truncate():
    """Guards the fixture: the truncating cases really drop tokens, the 'off' ones do not."""
    kept = {n: int((reference_probs(STAT_LOGITS, c.temperature, c.top_k, c.top_p) > 0).sum())
            for n, c in STAT_CASES.items()}
    assert kept["top_k3"] == 3 and 1 < kept["top_p0.6"] < 10 and 1 < kept["top_k5_top_p0.7_T0.8"] < 5
    assert kept["T1"] == kept["off_explicit_T1.3"] == kept["top_k_ge_V"] == 10


@pytest.mark.parametrize("how", list(Draw), ids=lambda d: d.value)
def test_distribution_untruncated_path(how):
    """A batch with no truncating row skips the sort; its draws still follow softmax(z / T)."""
    configs = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.5)]
    counts = draw(STAT_LOGITS, configs, N_DRAWS, position=5, how=how)
    for c, cnt in zip(configs, counts):
        probs = reference_probs(STAT_LOGITS, c.temperature, 0, 1.0)
        p = chi_square_pvalue(cnt, probs)
        assert p > ALPHA, f"T={c.temperature}: chi-square p={p:.3g}; counts={cnt}"


@pytest.mark.parametrize("how", list(Draw), ids=lambda d: d.value)
def test_top_p_keeps_at_least_top_token(how):
    logits = np.array([5.0, 1.0, 0.0, -1.0], np.float32)
    counts = draw(logits, [SamplingConfig(top_p=1e-6), SamplingConfig(top_p=0.5, top_k=2)], 200, how=how)
    assert counts[0, 0] == 200 and counts[1, 0] == 200


def test_inverse_cdf_across_chunks():
    """The inverse-CDF draw over a vocabulary of several 128-token chunks (and a partial last one),
    with the mass in a few far-apart places, -inf tokens (vocabulary padding) and top-k: the
    frequencies follow the truncated softmax, and no token of zero mass is ever drawn."""
    rng = np.random.default_rng(8)
    v = 700  # 5 full chunks and one of 60
    logits = np.full(v, -4.0, np.float32) + rng.normal(size=v).astype(np.float32) * 0.3
    hot = [3, 127, 128, 400, 641, 699]  # chunk edges and the last token
    logits[hot] = rng.normal(size=len(hot)).astype(np.float32) + 2.0
    logits[130:250] = -np.inf
    configs = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.9, top_k=4)]
    counts = draw(logits, configs, N_DRAWS // 2, position=3, how=Draw.INVERSE_CDF)
    for c, cnt in zip(configs, counts):
        probs = reference_probs(logits, c.temperature, c.top_k, c.top_p)
        assert cnt[probs == 0].sum() == 0, np.flatnonzero(cnt * (probs == 0))
        p = chi_square_pvalue(cnt, probs)
        assert p > ALPHA, f"top_k={c.top_k}: chi-square p={p:.3g}"


def test_inverse_cdf_pick_at_the_ends_of_the_mass():
    """u = 0 picks the first token of positive mass and u at the largest float32 below 1 the last
    whose mass moves the float32 total (token 201's e^-30 does not: its probability, 5e-14, is below
    the draw's resolution); a pick never lands on a token of zero mass, even where float32 prefix
    sums rise past the target at one (a scan's rounding need not be monotone) or stay below it to
    the end (the last token of positive mass then)."""
    v = 300
    z = np.full((3, v), -np.inf, np.float32)
    z[:, [5, 200, 201]] = [0.0, 1e-3, -30.0]
    z[2, 5] = -np.inf
    z = jnp.asarray(z)
    no_cut = (jnp.full((3,), -jnp.inf), jnp.full((3,), v, jnp.int32))
    u = jnp.array([0.0, np.nextafter(np.float32(1), np.float32(0)), 0.0], jnp.float32)
    got = np.asarray(jax.jit(sampling_mod._inverse_cdf)(z, jnp.max(z, axis=1), *no_cut, u)[0])
    assert got.tolist() == [5, 200, 200], got
    first_above = jax.jit(sampling_mod._first_above)
    mass = jnp.array([[0.0, 0.5, 0.0, 0.1], [0.0, 1.0, 0.0, 1e-30]])
    cum = jnp.array([[0.0, 0.5, 0.6, 0.6], [0.0, 1.0, 1.0, 1.0]])  # row 0: index 2 rose with no mass
    assert np.asarray(first_above(cum, jnp.array([0.55, 1.0]), mass)).tolist() == [3, 3]


def test_ties_at_boundaries_break_by_lower_id():
    """Four tied logits and a small fifth: top_k=2 keeps ids 0 and 1 (tie at the k-th value ->
    lower ids). top_p=0.5: each tie has p = 1 / (4 + e^-3) = 0.247, so the mass before rank 2 is
    0.494 < 0.5 (kept) and before rank 3 is 0.741 (dropped): ids {0, 1, 2}, never id 3."""
    logits = np.array([0.0, 0.0, 0.0, 0.0, -3.0], np.float32)
    configs = [SamplingConfig(top_k=2), SamplingConfig(top_p=0.5)]
    counts = draw(logits, configs, 2000)
    for c, cnt in zip(configs, counts):
        probs = reference_probs(logits, 1.0, c.top_k, c.top_p)
        assert cnt[probs == 0].sum() == 0, cnt
        assert cnt[probs > 0].min() > 0, cnt
    assert set(np.flatnonzero(counts[0])) == {0, 1}
    assert set(np.flatnonzero(counts[1])) == {0, 1, 2}


# --- seeds and determinism --------------------------------------------------------------------


def test_same_seed_and_position_reproduce():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(8, 100)).astype(np.float32))
    sp = SlotSampling.from_configs([SamplingConfig(temperature=1.0, top_p=0.95, seed=77)] * 8)
    keys = row_keys_jit(sp.seed, jnp.full((8,), 12))
    a = sample_jit(logits, sp, keys)
    b = sample_jit(logits, sp, row_keys_jit(sp.seed, jnp.full((8,), 12)))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert jax.random.key_data(keys[0]).tolist() == jax.random.key_data(row_keys(jnp.array([77]),
                                                                                  jnp.array([12]))[0]).tolist()


def test_different_positions_and_seeds_give_different_streams():
    v, t = 1000, 64
    logits = jnp.zeros((t, v), jnp.float32)  # uniform: each draw is a fresh uniform id

    def stream(seed):
        sp = SlotSampling.from_configs([SamplingConfig(temperature=1.0, seed=seed)] * t)
        return np.asarray(sample_jit(logits, sp, row_keys_jit(sp.seed, jnp.arange(t)))[0])

    s1, s2, s1_again = stream(1), stream(2), stream(1)
    np.testing.assert_array_equal(s1, s1_again)
    assert len(set(s1.tolist())) > t // 2  # positions decorrelate draws within a request
    assert (s1 != s2).mean() > 0.9  # seeds decorrelate requests
    keys = jax.random.key_data(row_keys(jnp.array([1, 1, 2, 2]), jnp.array([0, 1, 0, 1])))
    assert len({tuple(k) for k in np.asarray(keys).tolist()}) == 4


@pytest.mark.parametrize("how", list(Draw), ids=lambda d: d.value)
def test_batch_composition_and_slot_do_not_matter(how):
    """Request R alone (no truncation anywhere: sort skipped) and R scattered over rows of a
    bigger batch with greedy and truncating neighbours (sorted path) give identical results."""
    rng = np.random.default_rng(5)
    t, v = 48, 64
    r_logits = (rng.normal(size=(t, v)) * 2.0).astype(np.float32)
    r_cfg = SamplingConfig(temperature=1.0, seed=123)
    alone = SlotSampling.from_configs([r_cfg] * t)
    tok_a, lp_a = map(np.asarray, sample_jit(jnp.asarray(r_logits), alone, row_keys_jit(alone.seed, jnp.arange(t)),
                                             draw=how))

    big = 3 * t
    slots = rng.permutation(big)[:t]
    logits = (rng.normal(size=(big, v)) * 2.0).astype(np.float32)
    logits[slots] = r_logits
    others = [SamplingConfig(temperature=float(rng.choice([0.0, 0.6, 1.0])), top_k=int(rng.integers(0, 8)),
                             top_p=float(rng.choice([0.5, 0.9, 1.0])), seed=int(rng.integers(0, 2**31)))
              for _ in range(big)]
    configs = list(others)
    positions = rng.integers(0, 1000, size=big)
    for pos, s in enumerate(slots):
        configs[s] = r_cfg
        positions[s] = pos
    sp = SlotSampling.from_configs(configs)
    tok_b, lp_b = map(np.asarray, sample_jit(jnp.asarray(logits), sp, row_keys_jit(sp.seed, jnp.asarray(positions)),
                                             draw=how))
    np.testing.assert_array_equal(tok_b[slots], tok_a)
    np.testing.assert_allclose(lp_b[slots], lp_a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", list(Draw), ids=lambda d: d.value)
def test_truncation_decided_on_the_host_changes_nothing(how):
    """``truncation`` given by the caller (no device conditional) draws what the ``lax.cond`` draws:
    ``True`` on a batch with truncating rows, both ``True`` and ``False`` on one without; `truncates`
    is the host's verdict per config (the engine's), and the compiled program without truncation
    has no conditional and no sort."""
    rng = np.random.default_rng(17)
    b, v = 40, 96
    logits = jnp.asarray((rng.normal(size=(b, v)) * 2.5).astype(np.float32))
    plain = [SamplingConfig(temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([0, v, v + 5])),
                            seed=int(rng.integers(0, 2**31))) for _ in range(b)]
    mixed = list(plain)
    for i in rng.permutation(b)[:7]:
        mixed[i] = SamplingConfig(temperature=1.0, top_k=int(rng.integers(1, 12)), top_p=float(rng.choice([0.6, 1.0])),
                                  seed=int(rng.integers(0, 2**31)))
    assert not any(truncates(c, v) for c in plain) and any(truncates(c, v) for c in mixed)
    assert not truncates(SamplingConfig(temperature=0.0, top_k=3, top_p=0.5), v)  # greedy never truncates
    assert truncates(SamplingConfig(top_p=0.999), v) and truncates(SamplingConfig(top_k=v - 1), v)
    positions = jnp.asarray(rng.integers(0, 4096, size=b), jnp.int32)
    for configs, flags in ((plain, (False, True)), (mixed, (True,))):
        sp = SlotSampling.from_configs(configs)
        keys = row_keys_jit(sp.seed, positions)
        tok, lp = map(np.asarray, sample_jit(logits, sp, keys, draw=how))
        for flag in flags:
            tok_h, lp_h = map(np.asarray, sample_jit(logits, sp, keys, draw=how, truncation=flag))
            np.testing.assert_array_equal(tok_h, tok)
            np.testing.assert_array_equal(lp_h, lp)
    sp = SlotSampling.from_configs(plain)
    hlo = sample_jit.lower(logits, sp, row_keys_jit(sp.seed, positions), draw=how,
                           truncation=False).compile().as_text()
    assert " conditional(" not in hlo and " sort(" not in hlo
    assert " conditional(" in sample_jit.lower(logits, sp, row_keys_jit(sp.seed, positions),
                                               draw=how).compile().as_text()
    with pytest.raises(ValueError, match="truncation"):
        sample(logits, sp, row_keys_jit(sp.seed, positions), truncation=1)


def test_steps_per_round_trip_do_not_matter():
    """A fused lax.scan over 6 positions draws what 6 separate calls draw."""
    rng = np.random.default_rng(6)
    b, v, steps = 4, 50, 6
    logits = jnp.asarray(rng.normal(size=(steps, b, v)).astype(np.float32))
    sp = SlotSampling.from_configs([SamplingConfig(temperature=0.8, top_k=10, seed=s) for s in (0, 5, 9, 5)])
    start = jnp.array([3, 3, 40, 100])

    @jax.jit
    def fused(logits):
        def step(pos, lg):
            return pos + 1, sample(lg, sp, row_keys(sp.seed, pos))[0]
        return jax.lax.scan(step, start, logits)[1]

    separate = [np.asarray(sample_jit(logits[i], sp, row_keys_jit(sp.seed, start + i))[0]) for i in range(steps)]
    np.testing.assert_array_equal(np.asarray(fused(logits)), np.stack(separate))


# --- shapes, containers, validation -------------------------------------------------------------


def test_full_size_shapes():
    b, v = 256, 151936
    sp = jax.eval_shape(lambda: SlotSampling.empty(b))
    keys = jax.eval_shape(row_keys, sp.seed, jax.ShapeDtypeStruct((b,), jnp.int32))
    tokens, logprobs = jax.eval_shape(sample, jax.ShapeDtypeStruct((b, v), jnp.float32), sp, keys)
    assert tokens.shape == (b,) and tokens.dtype == jnp.int32
    assert logprobs.shape == (b,) and logprobs.dtype == jnp.float32


@pytest.mark.parametrize("how", list(Draw), ids=lambda d: d.value)
def test_real_vocab_smoke(how):
    """Qwen3 vocabulary size, a few rows mixing every mode."""
    b, v = 4, 151936
    logits = jax.random.normal(jax.random.key(0), (b, v)) * 3.0
    sp = SlotSampling.from_configs([SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.7, top_k=50),
                                    SamplingConfig(temperature=1.0, top_p=0.9), SamplingConfig(temperature=1.2)])
    tokens, logprobs = map(np.asarray, sample_jit(logits, sp, row_keys_jit(sp.seed, jnp.arange(b)), draw=how))
    z = np.asarray(logits, np.float64) / np.array([1.0, 0.7, 1.0, 1.2])[:, None]
    np.testing.assert_allclose(logprobs, log_softmax64(z)[np.arange(b), tokens], rtol=1e-5, atol=5e-5)
    assert tokens[0] == int(np.argmax(np.asarray(logits)[0]))
    assert tokens[1] in np.argsort(-z[1])[:50]


def test_slot_sampling_containers():
    cfgs = [SamplingConfig(temperature=0.5, top_p=0.9, top_k=7, seed=2**31 - 1), SamplingConfig()]
    sp = SlotSampling.from_configs(cfgs)
    assert sp.temperature.dtype == jnp.float32 and sp.top_p.dtype == jnp.float32
    assert sp.top_k.dtype == jnp.int32 and sp.seed.dtype == jnp.uint32
    np.testing.assert_array_equal(sp.top_k, [7, 0])
    assert int(sp.seed[0]) == 2**31 - 1
    e = SlotSampling.empty(3)
    np.testing.assert_array_equal(e.temperature, [0, 0, 0])
    np.testing.assert_array_equal(e.top_p, [1, 1, 1])
    assert jax.tree_util.tree_structure(e) == jax.tree_util.tree_structure(sp)
    with pytest.raises(ValueError, match="at least one"):
        SlotSampling.from_configs([])
    with pytest.raises(TypeError, match="SamplingConfig"):
        SlotSampling.from_configs([{"temperature": 1.0}])
    with pytest.raises(ValueError, match="batch"):
        SlotSampling.empty(0)


def test_sampling_config_defaults_and_coercion():
    c = SamplingConfig(stop_token_ids=[3, 4])
    assert c.stop_token_ids == (3, 4) and hash(c)
    assert (c.temperature, c.top_p, c.top_k, c.max_tokens, c.ignore_eos, c.seed) == (1.0, 1.0, 0, 256, False, 0)
    SamplingConfig(temperature=0, top_p=1, top_k=5, max_tokens=1, seed=np.int64(5))


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 3.0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**31}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_sampling_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)
