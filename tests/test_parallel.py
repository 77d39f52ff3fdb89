"""fp8rl_jax.parallel: logical axes, presets, and the sharded train step / FP8 forward on 8 CPU devices.

The multi-device checks need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax
starts, so they run once, together, in one subprocess (``python tests/test_parallel.py OUT``) and
the rest of the suite keeps its single device. The child draws fresh random parameters and
batches, computes every sharded result and its single-device reference (the same jitted
``train_step`` / ``forward`` without a mesh), and writes the errors and the observed shardings as
JSON; the tests below assert on them, one test per case. Compute is float32 throughout, so the
only difference allowed is the order of float32 sums (rtol 1e-5).

The plan tests (which axis goes where, fallbacks, errors, full Qwen3-8B / 30B-A3B shapes through
``jax.eval_shape``) need no devices and run in this process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_device_child
from flax import nnx
from jax.sharding import PartitionSpec as P

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # when run as the child script
    sys.path.insert(0, str(REPO))

from configs.models import qwen3_8b, qwen3_30b_a3b, tiny_qwen3, tiny_qwen3_moe
from fp8rl_jax.models import abstract_params
from fp8rl_jax.parallel import (
    FSDP_RULES,
    TENSOR_RULES,
    MeshAxis,
    MeshConfig,
    ShardingError,
    ShardingFallbackWarning,
    ShardingPreset,
    ShardingRules,
    logical_axes,
    param_axes,
    plan_params,
)
from fp8rl_jax.numerics.fp8 import QuantizedWeight
from fp8rl_jax.quant.policy import Kernels, LayerPolicy, quantize_params

DEVICES = 8
# Every sharded axis divides: V 64, D 32, F 64, N 4 heads, K 2 kv heads of H 8, E 8 experts of I 16.
DENSE = dataclasses.replace(tiny_qwen3, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                            num_heads=4, num_kv_heads=2, head_dim=8)
MOE = dataclasses.replace(tiny_qwen3_moe, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
FP8_BLOCK = (8, 8)  # small FP8 blocks so that the tiny weights split into whole blocks
RTOL = 1e-5
STEPS = 3

# (model, preset, mesh, micro-batches) per train-step case.
TRAIN_CASES = {
    "dp8": ("dense", ShardingPreset.DATA_PARALLEL, MeshConfig(data=8), 2),
    "fsdp8": ("dense", ShardingPreset.FSDP, MeshConfig(fsdp=8), 2),
    "fsdp4_dp2": ("dense", ShardingPreset.FSDP, MeshConfig(data=2, fsdp=4), 2),
    "tp2_dp4": ("dense", ShardingPreset.TENSOR_PARALLEL, MeshConfig(data=4, tensor=2), 2),
    "ep4_dp2_moe": ("moe", ShardingPreset.EXPERT_PARALLEL, MeshConfig(data=2, expert=4), 1),
}
# (model, preset, mesh) per W8A8 forward case.
FP8_CASES = {
    "tp2_dp4": ("dense", ShardingPreset.TENSOR_PARALLEL, MeshConfig(data=4, tensor=2)),
    "ep4_dp2_moe": ("moe", ShardingPreset.EXPERT_PARALLEL, MeshConfig(data=2, expert=4)),
}


# =========================================================================== plans (no devices)


def _specs(params, config, mesh, preset, **kw) -> dict[str, object]:
    plan = plan_params(params, config, mesh, preset, **kw)
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(plan.specs)}


@pytest.mark.parametrize("config", [qwen3_8b, qwen3_30b_a3b, tiny_qwen3_moe], ids=["8b", "30b_a3b", "tiny_moe"])
def test_every_parameter_has_logical_axes_matching_its_shape(config):
    rows = param_axes(config)
    assert len(rows) == len(nnx.to_flat_state(abstract_params(config)))
    by_name = {"/".join(map(str, r.path[2:] if r.path[0] == "layers" else r.path)): r.axes for r in rows}
    assert by_name["self_attn/q_proj/weight"] == ("NH", "D")
    assert by_name["self_attn/o_proj/weight"] == ("D", "NH")
    assert by_name["embed_tokens/weight"] == ("V", "D")
    if config.is_moe:
        assert by_name["mlp/experts/gate_proj"] == ("E", "I", "D")
        assert by_name["mlp/experts/down_proj"] == ("E", "D", "I")


def test_unknown_path_and_wrong_config_are_errors():
    with pytest.raises(ShardingError, match=r"layers/0/self_attn/rotary/weight has no logical axes"):
        logical_axes(("layers", 0, "self_attn", "rotary", "weight"))
    with pytest.raises(ShardingError, match=r"embed_tokens/weight has shape \(151936, 4096\).*\(151936, 2048\)"):
        plan_params(abstract_params(qwen3_8b), qwen3_30b_a3b, MeshConfig(fsdp=8), ShardingPreset.FSDP)


def test_preset_layouts_on_full_qwen3_8b():
    ap = abstract_params(qwen3_8b)
    tp = _specs(ap, qwen3_8b, MeshConfig(tensor=8), ShardingPreset.TENSOR_PARALLEL, strict=True)
    L = "layers/5/"
    # Column-parallel q/k/v/gate/up and lm_head (output dim), row-parallel o/down (input dim).
    for name in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "mlp/gate_proj", "mlp/up_proj"):
        assert tp[L + name + "/weight"] == P("tensor", None), name
    for name in ("self_attn/o_proj", "mlp/down_proj"):
        assert tp[L + name + "/weight"] == P(None, "tensor"), name
    assert tp["lm_head/weight"] == P("tensor", None) and tp["embed_tokens/weight"] == P("tensor", None)
    assert tp[L + "input_layernorm/weight"] == P(None) and tp[L + "self_attn/q_norm/weight"] == P(None)
    fsdp = _specs(ap, qwen3_8b, MeshConfig(data=2, fsdp=8), ShardingPreset.FSDP, strict=True)
    # The largest divisible dim: F for the MLP, V for the embeddings, D for k/v ([1024, 4096]).
    assert fsdp[L + "mlp/down_proj/weight"] == P(None, "fsdp")
    assert fsdp[L + "self_attn/k_proj/weight"] == P(None, "fsdp")
    assert fsdp["embed_tokens/weight"] == P("fsdp", None) and fsdp["norm/weight"] == P("fsdp")
    dp = _specs(ap, qwen3_8b, MeshConfig(data=8), ShardingPreset.DATA_PARALLEL, strict=True)
    assert all(all(e is None for e in s) for s in dp.values())
    hybrid = _specs(ap, qwen3_8b, MeshConfig(fsdp=4, tensor=2), TENSOR_RULES | FSDP_RULES, strict=True)
    assert hybrid[L + "self_attn/q_proj/weight"] == P("tensor", "fsdp")
    assert hybrid[L + "mlp/down_proj/weight"] == P("fsdp", "tensor")


def test_expert_parallel_on_full_qwen3_30b_a3b():
    ap = abstract_params(qwen3_30b_a3b)
    ep = _specs(ap, qwen3_30b_a3b, MeshConfig(data=2, expert=8), ShardingPreset.EXPERT_PARALLEL, strict=True)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert ep[f"layers/7/mlp/experts/{proj}"] == P("expert", None, None)
    assert ep["layers/7/mlp/gate/weight"] == P("expert", None)
    assert ep["layers/7/self_attn/q_proj/weight"] == P(None, None)
    ep_fsdp = _specs(ap, qwen3_30b_a3b, MeshConfig(expert=8, fsdp=2), ShardingPreset.EXPERT_PARALLEL.rules | FSDP_RULES,
                     strict=True)
    assert ep_fsdp["layers/7/mlp/experts/gate_proj"] == P("expert", None, "fsdp")


def test_fallback_names_parameter_shape_and_mesh_axis():
    # Qwen3-30B-A3B has K = 4 kv heads: tensor = 8 cannot give each device whole kv heads.
    ap, mesh = abstract_params(qwen3_30b_a3b), MeshConfig(tensor=8)
    with pytest.raises(ShardingError) as e:
        plan_params(ap, qwen3_30b_a3b, mesh, ShardingPreset.TENSOR_PARALLEL, strict=True)
    msg = str(e.value)
    assert ("layers/0/self_attn/k_proj/weight (512, 2048): logical axis 'KH' cannot be split over mesh axis "
            "'tensor' of size 8 (size 512 is not a multiple of 8 x 128: each shard must hold whole heads of 128)"
            ) in msg
    assert msg.startswith(f"{2 * qwen3_30b_a3b.num_layers} sharding rule(s)")  # k and v of every layer, nothing else
    with pytest.warns(ShardingFallbackWarning, match="v_proj"):
        plan = plan_params(ap, qwen3_30b_a3b, mesh, ShardingPreset.TENSOR_PARALLEL)
    assert {f.param.rsplit("/", 2)[-2] for f in plan.fallbacks} == {"k_proj", "v_proj"}
    assert all(f.mesh_axis is MeshAxis.TENSOR and f.mesh_size == 8 and f.axis == "KH" for f in plan.fallbacks)
    specs = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(plan.specs)}
    assert specs["layers/0/self_attn/k_proj/weight"] == P(None, None)
    assert specs["layers/0/self_attn/q_proj/weight"] == P("tensor", None)


def test_quantized_weights_get_block_aligned_specs_on_full_qwen3_8b():
    ap = abstract_params(qwen3_8b)
    qa = jax.eval_shape(lambda p: quantize_params(p, qwen3_8b, kernels=Kernels.REFERENCE), ap)
    dense = _specs(ap, qwen3_8b, MeshConfig(tensor=8), ShardingPreset.TENSOR_PARALLEL, strict=True)
    quant = _specs(qa, qwen3_8b, MeshConfig(tensor=8), ShardingPreset.TENSOR_PARALLEL, strict=True)
    n_fp8 = 0
    for name, spec in quant.items():
        if isinstance(spec, QuantizedWeight):
            n_fp8 += 1
            assert spec.q == spec.scale_inv == dense[name], name
        else:
            assert spec == dense[name], name
    assert n_fp8 == 7 * qwen3_8b.num_layers
    # 16-way FSDP: k_proj [1024, 4096] splits D into 256-wide shards (2 blocks each) ...
    fsdp = _specs(qa, qwen3_8b, MeshConfig(fsdp=16), ShardingPreset.FSDP, strict=True)
    assert fsdp["layers/0/self_attn/k_proj/weight"].q == P(None, "fsdp")
    # ... but 64-way FSDP would cut blocks (4096 / 64 = 64 < 128): the FP8 weight is replicated, said so.
    with pytest.raises(ShardingError, match=r"k_proj/weight \(1024, 4096\): no dimension cannot be split over mesh "
                                            r"axis 'fsdp' of size 64 \(no free dimension is a multiple of 64 in "
                                            r"whole FP8 blocks \(128, 128\)\)"):
        plan_params(qa, qwen3_8b, MeshConfig(fsdp=64), ShardingPreset.FSDP, strict=True)


def test_rules_validate():
    with pytest.raises(ValueError, match="unknown logical axis 'X'"):
        ShardingRules(fixed=(("X", MeshAxis.TENSOR),))
    with pytest.raises(TypeError, match="must be a MeshAxis"):
        ShardingRules(fixed=(("V", "tensor"),))
    with pytest.raises(ValueError, match="has two fixed rules"):
        TENSOR_RULES | ShardingRules(fixed=(("V", MeshAxis.EXPERT),))
    with pytest.raises(ValueError, match="MeshConfig.tensor must be a positive int"):
        MeshConfig(tensor=0)
    with pytest.raises(TypeError, match="ShardingPreset or ShardingRules"):
        plan_params(abstract_params(tiny_qwen3), tiny_qwen3, MeshConfig(), "fsdp")


# =========================================================================== 8 devices (subprocess)


def _make_batch(rng, cfg, B, T):
    from fp8rl_jax.rl.trainer import TrainBatch

    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    prompt = rng.integers(1, T // 2 + 1, B)
    resp = rng.integers(1, T - prompt + 1)
    resp[1] = 0  # a row with nothing to train
    t = np.arange(T)[None, :]
    mask = ((t >= prompt[:, None]) & (t < (prompt + resp)[:, None])).astype(np.int32)
    old = -math.log(cfg.vocab_size) + rng.normal(0, 0.3, (B, T))
    roll = old + rng.normal(0, 0.2, (B, T)) - 1.0 * (rng.random((B, T)) < 0.15)

    def f(x):
        return jnp.asarray(np.where(mask > 0, x, 0.0), jnp.float32)

    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=f(rng.normal(0, 1, (B, T))),
                      old_logprobs=f(old), rollout_logprobs=f(roll),
                      ref_logprobs=f(old + rng.normal(0, 0.2, (B, T))))


def _random_params(rng, cfg):
    """float32 parameters drawn with NumPy (no compile): weights N(0, 0.02), norm gains 1 + N(0, 0.1)."""
    def draw(path, s):
        base = 1.0 if s.ndim == 1 else 0.0
        return jnp.asarray(base + rng.normal(0, 0.1 if s.ndim == 1 else 0.02, s.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(cfg, jnp.float32))


def _tree_err(x, ref) -> float:
    """max over leaves of max|x - ref| / max|ref| (float64)."""
    errs = []
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)))
    return max(errs)


# A metric that is a difference of two others is compared relative to their scale.
_METRIC_SCALE = {"mismatch/ppl_gap": "mismatch/ppl_rollout"}
ATOL = 1e-6  # metrics that are means of O(1) signed terms (loss, approx_kl) can be ~0; their sum error is not


def _metrics_err(m, ref) -> tuple[float, str]:
    """max over metrics of |m - ref| / (ATOL + RTOL |ref|), in units of the tolerance (< 1 passes),
    and the metric that attains it."""
    assert set(m) == set(ref), set(m) ^ set(ref)
    f = {k: np.float64(v) for k, v in ref.items()}
    def scale(k):
        return max(abs(f[k]), abs(f.get(_METRIC_SCALE.get(k), 0.0)))

    return max((float(abs(np.float64(m[k]) - f[k]) / (ATOL + RTOL * scale(k))), k) for k in ref)


def _row_errs(x, ref) -> list[float]:
    """Per row b: max_t,v |x - ref| / max |ref| (float64)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return (np.abs(x - ref).reshape(len(x), -1).max(axis=1) / np.abs(ref).max()).tolist()


def _child(out_path: str) -> None:
    """Everything that needs 8 devices; writes {check: numbers} as JSON to ``out_path``.

    Every computation is lowered first, then all are compiled by two threads (XLA's CPU compile,
    not the run, dominates), then run and compared."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    from fp8rl_jax.models import DensePolicy, forward
    from fp8rl_jax.parallel import (
        batch_sharding,
        make_mesh,
        param_shardings,
        shard_params,
    )
    from fp8rl_jax.rl.sharded import make_sharded_train_step, shard_train_state
    from fp8rl_jax.quant.policy import W8A8Policy
    from fp8rl_jax.rl.trainer import (
        ComputeDtype,
        LossConfig,
        OptimizerConfig,
        TrainerConfig,
        init_train_state,
        make_optimizer,
        train_step,
    )

    assert jax.device_count() == DEVICES, jax.devices()
    t_start = time.perf_counter()
    # Fresh inputs each run; FP8RL_TEST_SEED=<seed printed by a failure> replays one.
    seed = int(os.environ.get("FP8RL_TEST_SEED", time.time_ns() % 2**31))
    rng = np.random.default_rng(seed)
    configs = {"dense": DENSE, "moe": MOE}
    params = {k: _random_params(rng, c) for k, c in configs.items()}
    B, T = 16, 12
    batches = {k: [_make_batch(rng, c, B, T) for _ in range(STEPS)] for k, c in configs.items()}
    F32 = DensePolicy("float32")
    results: dict[str, dict] = {"seed": {"seed": seed}}
    lowered: dict[tuple, object] = {}  # job -> jax Lowered
    args: dict[tuple, tuple] = {}  # job -> what it needs to run

    def trainer_config(M):
        # Adam's first update is g / (|g| + eps) per element, whose derivative at g ~ 0 is 1 / eps:
        # eps = 1e-4 (not 1e-8) keeps an element whose gradient is float32 rounding noise from
        # turning the order of the sums (the only thing sharding changes) into an O(lr) update.
        return TrainerConfig(loss=LossConfig(kl_coef=0.05, entropy_metric=False),
                             optimizer=OptimizerConfig(lr=1e-3, eps=1e-4), micro_batches=M,
                             compute_dtype=ComputeDtype.FLOAT32)

    def fresh_state(model, optimizer):  # on the host: placing it is a copy, not a compiled reshard
        return jax.device_get(init_train_state(params[model], optimizer, jax.random.key(seed)))

    # ---------------------------------------------------------------- train steps: lower
    for name, (model, preset, mesh_cfg, M) in TRAIN_CASES.items():
        tc = trainer_config(M)
        opt = make_optimizer(tc.optimizer)
        if ("ref", model, M) not in lowered:  # single device: the trainer's own jitted step
            fn = jax.jit(functools.partial(train_step, model_config=configs[model], policy=F32, trainer_config=tc,
                                           optimizer=opt), donate_argnums=0)
            state = fresh_state(model, opt)
            lowered["ref", model, M] = fn.lower(state, batches[model][0])
            args["ref", model, M] = (state,)
        mesh = make_mesh(mesh_cfg)
        step = make_sharded_train_step(configs[model], F32, tc, opt, mesh, preset, strict=True)
        state = shard_train_state(fresh_state(model, opt), mesh, preset, config=configs[model], strict=True)
        lowered["train", name] = step.jitted.lower(*step.place(state, batches[model][0]))
        args["train", name] = (state, step)

    # ---------------------------------------------------------------- W8A8 forward: lower
    lp = LayerPolicy(block_size=FP8_BLOCK)
    policy = W8A8Policy("float32", group_size=FP8_BLOCK[1], kernels=Kernels.REFERENCE)
    tokens = jnp.asarray(rng.integers(0, DENSE.vocab_size, (B, T)), jnp.int32)
    quantized = {k: jax.jit(quantize_params, static_argnums=(1, 2, 3))(params[k], configs[k], lp, Kernels.REFERENCE)
                 for k in configs}

    def fwd(p, t, c):
        return forward(p, t, config=c, policy=policy)[0]

    for name, (model, preset, mesh_cfg) in FP8_CASES.items():
        f = functools.partial(fwd, c=configs[model])
        if ("fp8ref", model) not in lowered:
            lowered["fp8ref", model] = jax.jit(f).lower(quantized[model], tokens)
        mesh = make_mesh(mesh_cfg)
        shardings = param_shardings(quantized[model], configs[model], mesh, preset, strict=True)
        placed = shard_params(quantized[model], configs[model], mesh, preset, strict=True)
        bs = batch_sharding(mesh)
        lowered["fp8", name] = jax.jit(f, in_shardings=(shardings, bs), out_shardings=bs).lower(placed, tokens)
        args["fp8", name] = (placed, jax.device_put(tokens, bs), model)

    # ---------------------------------------------------------------- quantizing sharded weights: lower
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    preset = ShardingPreset.TENSOR_PARALLEL
    dense_sh = param_shardings(params["dense"], DENSE, mesh, preset, strict=True)
    quant_sh = param_shardings(quantized["dense"], DENSE, mesh, preset, strict=True)
    dense_placed = jax.device_put(params["dense"], dense_sh)
    lowered["quantize"] = jax.jit(lambda p: quantize_params(p, DENSE, lp, Kernels.REFERENCE), in_shardings=(dense_sh,),
                                  out_shardings=quant_sh).lower(dense_placed)

    # ---------------------------------------------------------------- compile all
    t_lowered = time.perf_counter()
    fast = {"xla_backend_optimization_level": 0}  # compile time dominates on the CPU; same operations
    with ThreadPoolExecutor(2) as pool:
        compiled = dict(zip(lowered, pool.map(lambda low: low.compile(fast), lowered.values())))
    t_compiled = time.perf_counter()

    # ---------------------------------------------------------------- run and compare
    references = {}
    for job in [j for j in lowered if j[0] == "ref"]:
        state, history = args[job][0], []
        for b in batches[job[1]]:
            state, m = compiled[job](state, b)
            history.append((jax.device_get(state.params), jax.device_get(m)))
        references[job[1:]] = history
    for name, (model, preset, mesh_cfg, M) in TRAIN_CASES.items():
        (state, step), run = args["train", name], compiled["train", name]
        rec = {"params_err": [], "metrics_err": [], "fallbacks": len(step.fallbacks)}
        for (ref_params, ref_metrics), b in zip(references[model, M], batches[model]):
            state, m = run(*step.place(state, b))
            rec["params_err"].append(_tree_err(state.params, ref_params))
            err, worst = _metrics_err(jax.device_get(m), ref_metrics)
            rec["metrics_err"].append(err)
            rec.setdefault("worst_metric", []).append(worst)
        rec["step"] = int(state.step)
        # Where the state lives: per leaf, the fraction of it one device holds, its rank and
        # device count; and whether the step returned it in the layout it was given.
        rec["fraction"] = {jax.tree_util.keystr(kp): [x.addressable_shards[0].data.size / max(x.size, 1), x.ndim,
                                                      len(x.sharding.device_set)]
                           for kp, x in jax.tree_util.tree_leaves_with_path(state)}
        rec["layout_kept"] = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in
                                 zip(jax.tree.leaves(state), jax.tree.leaves(step.state_shardings), strict=True))
        results["train/" + name] = rec
    fp8_refs = {job[1]: np.asarray(compiled[job](quantized[job[1]], tokens)) for job in lowered if job[0] == "fp8ref"}
    for name in FP8_CASES:
        placed, toks, model = args["fp8", name]
        logits = compiled["fp8", name](placed, toks)
        consistent, split = True, 0
        for _, var in nnx.to_flat_state(placed):
            w = var.get_value()
            if isinstance(w, QuantizedWeight):
                qs, ss = w.q.addressable_shards[0].data.shape, w.scale_inv.addressable_shards[0].data.shape
                want = (*qs[:-2], -(-qs[-2] // w.block_size[0]), -(-qs[-1] // w.block_size[1]))
                consistent &= w.q.sharding.spec == w.scale_inv.sharding.spec and ss == want
                split += qs != w.q.shape
        results["fp8/" + name] = {"row_errs": _row_errs(logits, fp8_refs[model]),
                                  "consistent": bool(consistent), "split_fp8_weights": int(split)}
    got = compiled["quantize"](dense_placed)
    hlo = compiled["quantize"].as_text()
    bitwise = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(quantized["dense"]), strict=True))
    collectives = sorted({c for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
                          if c in hlo})
    results["quantize/tp2_dp4"] = {"bitwise": bool(bitwise), "collectives": collectives}
    results["time_s"] = {"lower": t_lowered - t_start, "compile": t_compiled - t_lowered,
                         "run": time.perf_counter() - t_compiled, "jobs": len(lowered)}
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    t0 = time.perf_counter()
    results = run_device_child(__file__, tmp_path_factory.mktemp("parallel") / "results.json", DEVICES)
    results["wall_s"] = time.perf_counter() - t0
    print(json.dumps({k: v for k, v in results.items() if k != "train/fsdp8"}, indent=1)[:4000])
    return results


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_sharded_train_step_equals_single_device(multi, case):
    rec = multi["train/" + case]
    assert rec["step"] == STEPS and rec["fallbacks"] == 0
    assert max(rec["metrics_err"]) < 1, (multi["seed"], rec["metrics_err"], rec["worst_metric"])
    assert max(rec["params_err"]) < RTOL, (multi["seed"], rec["params_err"])
    assert rec["layout_kept"]


def test_fsdp_shards_params_and_optimizer_state(multi):
    frac = multi["train/fsdp8"]["fraction"]
    mats = {k: v for k, v in frac.items() if v[1] >= 2}
    assert any(".mu" in k for k in mats) and any(".nu" in k for k in mats)
    # Every matrix, master weight and Adam moment alike, is split 8 ways: one device holds 1/8.
    assert all(v[0] == 1 / DEVICES and v[2] == DEVICES for v in mats.values()), \
        {k: v for k, v in mats.items() if v[0] != 1 / DEVICES}
    assert frac[".step"][0] == 1.0 and frac[".rng"][0] == 1.0
    # Data parallel: every device holds everything.
    assert all(v[0] == 1.0 for v in multi["train/dp8"]["fraction"].values())
    # Tensor parallel 2: column/row-parallel matrices are halved, norms replicated.
    tp = multi["train/tp2_dp4"]["fraction"]
    q = [v[0] for k, v in tp.items() if k.startswith(".params") and "q_proj" in k]
    norms = [v[0] for k, v in tp.items() if "layernorm" in k]
    assert q and all(f == 0.5 for f in q) and norms and all(f == 1.0 for f in norms)
    ep = multi["train/ep4_dp2_moe"]["fraction"]
    experts = [v[0] for k, v in ep.items() if "experts" in k]
    assert len(experts) == 3 * MOE.num_layers * 3 and all(f == 0.25 for f in experts)  # params, mu, nu


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_w8a8_params_shard_with_the_same_rules(multi, case):
    rec = multi["fp8/" + case]
    assert rec["consistent"], "QuantizedWeight q and scale_inv must share their spec, in whole blocks"
    assert rec["split_fp8_weights"] > 0
    # W8A8 quantizes activations to FP8 per token: float32 summation-order noise from a sharded
    # reduction can (rarely, ~1e-6 per element) push a value across an FP8 rounding boundary, a
    # one-ulp change that reaches that sequence's later logits at ~1e-4; with the MoE's routing a
    # few rows of 16 can see one. A wrong layout moves every row. So: at most a quarter of the rows
    # beyond RTOL (the median within it), and none further than FP8 rounding (1e-2).
    rows = np.asarray(rec["row_errs"])
    assert np.sum(rows >= RTOL) <= len(rows) // 4 and np.median(rows) < RTOL, (multi["seed"], rows)
    assert rows.max() < 1e-2, (multi["seed"], rows)


def test_quantizing_sharded_weights_is_bitwise_and_shard_local(multi):
    rec = multi["quantize/tp2_dp4"]
    assert rec["bitwise"]
    assert rec["collectives"] == []


if __name__ == "__main__":
    _child(sys.argv[1])
