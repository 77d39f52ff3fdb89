"""experiments/mismatch_ablation.py: the arms differ only where they should, main() runs end to end
on a tiny config, and the mismatch attribution agrees with an independent computation."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.models import DensePolicy, PagedKVCache, calibrate_kv_scales, forward, init_params
from fp8rl_jax.quant.policy import W8A8Policy, quantize_params

from conftest import load_experiment as _load


abl = _load("mismatch_ablation")


def test_arms_differ_only_in_precision_and_correction():
    base = abl.AblationConfig().quickstart
    a = abl.arm_config(base, abl.Arm.BF16, 0)
    b = abl.arm_config(base, abl.Arm.FP8_MIS, 0)
    assert sorted(abl.config_differences(a, b)) == sorted(abl.ARM_FIELDS)
    assert a.rl.precision.rollout.value == "none" and b.rl.precision.rollout.value == "all"
    assert b.rl.algorithm.loss.correction is abl.Correction.TOKEN_MIS
    assert abl.config_differences(a, abl.arm_config(base, abl.Arm.BF16, 2)) == ["rl.seed"]
    abl.check_arms(abl.AblationConfig())  # all four arms, three seeds


def _tiny_quickstart():
    q = abl.AblationConfig().quickstart
    # one decoder layer: the compilations dominate a run this short; a KV pool and slot count sized
    # for these 16-sequence rollouts (the preset's 10k-page pool is touched whole every decode step
    # on the CPU, seconds per rollout)
    q = abl.rlconfig.override(q, ["sft_steps=10", "eval_prompts=16", "data.steps=3", "data.prompts_per_step=4",
                                  "data.eval_every=3", "rollout.n_samples=4", "model.num_layers=1",
                                  "rollout.engine.max_slots=16", "rollout.engine.prefill_batch=16",
                                  "rollout.engine.kv_budget_gib=0.001"])
    return q


def test_main_tiny(tmp_path):
    # one arm end to end (the arms differ only in config fields: test_arms_differ_only_in_precision_and_correction)
    cfg = abl.AblationConfig(quickstart=_tiny_quickstart(), arms=(abl.Arm.FP8_TIS,), seeds=(0,),
                             final_window=2, attribution_prompts=4, attribution_samples=2, out=tmp_path, tag="test",
                             workers=1)
    res = abl.main(cfg)
    for name in ("mismatch_ablation_test.json", "mismatch_ablation_test.md", "mismatch_ablation_test.png",
                 "mismatch_attribution_test.json", "mismatch_attribution_test.md"):
        assert (tmp_path / name).exists(), name
    saved = json.loads((tmp_path / "mismatch_ablation_test.json").read_text())
    assert saved["environment"]["jax"] == jax.__version__ and saved["seeds"] == [0]
    st = saved["stats"]["fp8_tis"]
    assert st["final_reward"]["n"] == 1 and 0.0 <= st["final_reward"]["mean"] <= 1.0
    assert st["kl_k3_mean"]["mean"] > 0.0  # an FP8 rollout against the BF16 trainer
    assert saved["runs"]["fp8_tis_s0"]["summary"]["precision"] == "all" and set(saved["stats"]) == {"fp8_tis"}
    att = res["attribution"]
    assert att["rows"]["none"]["kl_exact"] == 0.0 and att["rows"]["all"]["kl_exact"] > 0.0
    assert set(att["rows"]) == {"none", "bf16_paged", "linears", "kv", "all", "linear_0", "kv_0"}
    # a second call reuses the finished runs
    again = abl.run_all(dataclasses.replace(cfg, attribution=False))
    assert all(s["reused"] for s in again.values())


def _np_logprobs(logits, tokens):
    z = np.asarray(logits, np.float64)[:, :-1]
    z = z - z.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp = np.take_along_axis(logsm, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return np.pad(lp, ((0, 0), (1, 0))), np.pad(logsm, ((0, 0), (1, 0), (0, 0)))


@pytest.fixture(scope="module")
def scored():
    cfg = abl.model_config_of(abl.AblationConfig().quickstart)
    params = init_params(cfg, jax.random.key(3), jnp.float32)
    # larger weights than the 0.02 init, so the FP8 error is well above float32 rounding
    params = jax.tree.map(lambda p: (p * 8.0 if p.ndim == 2 else p).astype(jnp.bfloat16), params)
    rng = np.random.default_rng(0)
    B, T = 6, 16
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (B, T)), jnp.int32)
    mask = jnp.asarray((np.arange(T)[None, :] >= 4) & (np.arange(T)[None, :] < rng.integers(8, T + 1, (B, 1))),
                       jnp.float32)
    k_scale, v_scale = calibrate_kv_scales(params, tokens, jnp.full((B,), T), config=cfg, policy=DensePolicy("bfloat16"))
    rows = abl.attribute(params, tokens, mask, k_scale, v_scale, config=cfg)
    return cfg, params, tokens, mask, k_scale, v_scale, rows


@functools.cache
def _bf16_forward(cfg):
    """The jitted BF16 logits of ``cfg`` (one compilation, shared by the three comparisons)."""
    return jax.jit(lambda p, t: forward(p, t, config=cfg, policy=DensePolicy("bfloat16"))[0])


def _independent(cfg, params, tokens, mask, k_scale, v_scale, *, w8a8: bool, kv: bool):
    """K1, K3 and exact KL of the FP8 scoring as ``fp8rl score --fp8 ...`` runs it (16-token pages,
    every layer), in float64 NumPy from the logits."""
    # jitted like the RL loop's trainer and engine: eager BF16 rounds after every op, a fused
    # jitted graph does not, and that alone moves these logprobs by up to 0.1
    ref_logits = _bf16_forward(cfg)(params, tokens)

    @jax.jit
    def fp8_logits(params, tokens):
        p = quantize_params(params, cfg) if w8a8 else params
        policy = W8A8Policy("bfloat16") if w8a8 else DensePolicy("bfloat16")
        cache = None
        if kv:
            B, T = tokens.shape
            pages = -(-T // 16)
            cache = PagedKVCache.init(cfg.num_layers, B * pages, 16, cfg.num_kv_heads, cfg.head_dim, B, pages,
                                      jnp.float8_e4m3fn)
            cache = cache.replace(page_table=jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages),
                                  k_scale=k_scale, v_scale=v_scale)
        return forward(p, tokens, config=cfg, policy=policy, cache=cache)[0]

    logits = fp8_logits(params, tokens)
    ref_lp, ref_logsm = _np_logprobs(ref_logits, tokens)
    lp, logsm = _np_logprobs(logits, tokens)
    m = np.asarray(mask, bool)
    d = (ref_lp - lp)[m]
    exact = (np.exp(logsm) * (logsm - ref_logsm)).sum(-1)[m]
    return {"kl_k1": float(np.mean(-d)), "kl_k3": float(np.mean(np.expm1(d) - d)), "kl_exact": float(exact.mean())}


@pytest.mark.parametrize("name,w8a8,kv", [("all", True, True), ("linears", True, False), ("kv", False, True)])
def test_attribution_matches_independent_fp8_scoring(scored, name, w8a8, kv):
    cfg, params, tokens, mask, ks, vs, rows = scored
    want = _independent(cfg, params, tokens, mask, ks, vs, w8a8=w8a8, kv=kv)
    got = rows[name]
    assert want["kl_exact"] > 1e-5  # the check has something to measure
    for key in ("kl_k3", "kl_exact"):
        np.testing.assert_allclose(got[key], want[key], rtol=2e-3, err_msg=f"{name} {key}")
    np.testing.assert_allclose(got["kl_k1"], want["kl_k1"], rtol=2e-3, atol=1e-6, err_msg=f"{name} kl_k1")


def test_attribution_bf16_is_zero_and_parts_are_partial(scored):
    cfg, *_, rows = scored
    assert all(rows["none"][k] == 0.0 for k in ("kl_k1", "kl_k3", "kl_exact", "max_abs_log_ratio"))
    L = cfg.num_layers
    for l in range(L):
        # one layer in FP8 changes the scores, and less than every layer does
        for part, whole in ((f"linear_{l}", "linears"), (f"kv_{l}", "kv")):
            assert 0.0 < rows[part]["kl_exact"] < rows[whole]["kl_exact"], (part, rows[part], rows[whole])
    assert rows["bf16_paged"]["kl_exact"] < 1e-3 * rows["kv"]["kl_exact"]
