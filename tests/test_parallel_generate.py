"""Tensor-parallel generation (``JaxEngine(..., mesh=...)``) on 8 CPU devices against one device.

Like ``tests/test_parallel.py``, the multi-device work runs once in a child process started with
``--xla_force_host_platform_device_count=8`` (``python tests/test_parallel_generate.py OUT``),
which writes what it observed as JSON; the tests assert on it. Fresh random parameters and
prompts every run (``FP8RL_TEST_SEED`` replays one). float32 greedy generation must give the same
tokens, with logprobs equal up to float32 summation order, for TP = 2 and 4, with the jnp attention
and with the Pallas kernels under ``shard_map`` (interpret mode), with a pool small enough to
force preemption, after a weight update from an FSDP-sharded trainer layout (the resharding the
RL loop does every step); W8A8 + FP8 KV sharded generation is compared too, and the generator's
layout is checked: pools split over kv heads, weights column/row-parallel.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import run_device_child

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # when run as the child script
    sys.path.insert(0, str(REPO))

from configs.models import tiny_qwen3  # noqa: E402

DEVICES = 8
# 8 query heads, 4 kv heads of 16 (the Pallas kernels need head_dim >= 16): TP = 2 and 4 hold whole
# heads; every dim splits into whole 8 x 8 FP8 blocks. One decoder layer: every layer is sharded
# alike, and the child's time is the compilations of ~30 engine programs, which grow with depth.
CFG = dataclasses.replace(tiny_qwen3, vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=8, num_kv_heads=4, head_dim=16)
LP_TOL = 1e-5


def _child(out_path: str) -> None:
    import warnings

    import jax
    import jax.numpy as jnp

    from fp8rl_jax.models import Fp8Mode, abstract_params
    from fp8rl_jax.parallel import MeshConfig, ShardingPreset, make_mesh, shard_params
    from fp8rl_jax.numerics.fp8 import QuantizedWeight
    from fp8rl_jax.quant.policy import Kernels
    from fp8rl_jax.rollout import programs
    from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
    from fp8rl_jax.rollout.sampling import SamplingConfig

    warnings.simplefilter("error")  # a sharding fallback would be a silent replication: fail instead
    assert jax.device_count() == DEVICES
    seed = int(os.environ.get("FP8RL_TEST_SEED", time.time_ns() % 2**31))
    rng = np.random.default_rng(seed)
    # weights N(0, 0.3), norm gains 1 + N(0, 0.1), drawn with NumPy
    params = jax.tree.map(lambda s: jnp.asarray((1.0 if s.ndim == 1 else 0.0) + rng.normal(0, 0.1 if s.ndim == 1 else 0.3,
                                                                                               s.shape), jnp.float32),
                          abstract_params(CFG, jnp.float32))
    # prompts of up to 16 tokens: one prefill bucket (16) unless a preempted request is recomputed,
    # one compilation fewer per engine than prompts spanning two buckets
    prompts = [rng.integers(2, CFG.vocab_size, int(n)).tolist() for n in rng.integers(2, 17, 6)]
    greedy = SamplingConfig(temperature=0.0, max_tokens=14, ignore_eos=True)
    base = EngineConfig(max_slots=4, page_size=8, num_pages=40, max_seq_len=48, steps_per_call=4, prefill_batch=2,
                        dtype="float32", fp8_block=(8, 8))
    results: dict = {"seed": seed}

    def run(engine, sampling=greedy):
        out = engine.generate(prompts, sampling)
        return [out.tokens[i, : out.lengths[i]].tolist() for i in range(len(prompts))], \
               [out.logprobs[i, : out.lengths[i]].tolist() for i in range(len(prompts))], out.preemptions

    def compare(name, got, ref, engine):
        (tg, lg, pg), (tr, lr, _) = got, ref
        # logprobs are compared where both runs produced the same tokens so far: after a token
        # differs, a row continues a different sequence
        flat, identical, ties = [], 0, []
        for x, y, lx, ly in zip(tg, tr, lg, lr):
            n = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
            identical += x == y
            flat += [abs(a - b) for a, b in zip(lx[: n + 1], ly[: n + 1])]  # the first differing token too
            if x != y and n < min(len(x), len(y)):
                # each run's greedy token at the first difference, and its logprob: the two runs agree on
                # every logprob up to summation order, so equal logprobs there mean a tie of two tokens
                ties.append(abs(lx[n] - ly[n]))
        results[name] = {"tokens_equal": tg == tr, "rows_identical": identical / len(tr), "tie_gaps": ties,
                         "lp_err": max(flat) if flat else 0.0, "lp_err_mean": float(np.mean(flat)) if flat else 0.0,
                         "preemptions": int(pg),
                         "pool_spec": list(engine.cache.k_pages[0].sharding.spec),
                         "pool_devices": len(engine.cache.k_pages[0].sharding.device_set)}

    ref = run(JaxEngine(CFG, params, base))
    for tp in (2, 4):
        mesh = make_mesh(MeshConfig(tensor=tp), jax.devices()[:tp])
        eng = JaxEngine(CFG, params, base, mesh=mesh)
        # programs compiled by this engine's first two generates (a new mesh: new programs)
        before = programs.prefill_jit._cache_size(), programs.decode_jit._cache_size()
        compare(f"tp{tp}", run(eng), ref, eng)
        run(eng)
        results[f"tp{tp}"]["compiles"] = [programs.prefill_jit._cache_size() - before[0],
                                          programs.decode_jit._cache_size() - before[1]]
        q = eng.params["layers"][0]["self_attn"]["q_proj"]["weight"].get_value()
        o = eng.params["layers"][0]["self_attn"]["o_proj"]["weight"].get_value()
        results[f"tp{tp}"]["q_o_specs"] = [list(q.sharding.spec), list(o.sharding.spec)]
        results[f"tp{tp}"]["num_pages"] = eng.num_pages
    mesh2 = make_mesh(MeshConfig(tensor=2), jax.devices()[:2])
    # 48 tokens of KV for 4 slots of 16 to 30 tokens each (6 prompts): running 4 at once needs 8+ pages.
    # Against the roomy one-device run: TP2 with recomputed prefixes vs one device that decoded them
    # (a one-device preempting reference would cost its own compilations and add nothing: test_engine.py
    # checks preemption against the roomy run on one device)
    tiny = dataclasses.replace(base, num_pages=6)
    eng = JaxEngine(CFG, params, tiny, mesh=mesh2)
    compare("tp2_preempt", run(eng), ref, eng)
    # swap preemption under TP: the head-sharded pages go to pinned host memory and back, shard by shard
    eng = JaxEngine(CFG, params, dataclasses.replace(tiny, swap_space_gib=1.0), mesh=mesh2)
    compare("tp2_swap", run(eng), ref, eng)
    results["tp2_swap"]["swaps"] = [eng.stats["swap_outs"], eng.stats["swap_ins"]]
    # the RL loop's sync: trainer params FSDP-sharded over all 8 devices -> the generator's TP layout
    perturbed = jax.tree.map(lambda p: p * 1.01, params)
    ref_perturbed = run(JaxEngine(CFG, perturbed, base))
    fsdp = shard_params(perturbed, CFG, make_mesh(MeshConfig(fsdp=8)), ShardingPreset.FSDP, strict=True)
    eng = JaxEngine(CFG, params, base, mesh=mesh2)
    eng.update_weights(fsdp)
    compare("tp2_after_fsdp_sync", run(eng), ref_perturbed, eng)
    results["tp2_after_fsdp_sync"]["last_sync"] = eng.last_sync
    results["tp2_after_fsdp_sync"]["reshard_path"] = eng.reshard_path
    # the update took effect: the tokens or their logprobs moved (a 1% scale of every weight need not
    # flip a greedy token of this small model for every seed, but it always moves the logprobs)
    results["tp2_after_fsdp_sync"]["changed"] = run(eng)[:2] != ref[:2]
    # FSDP over the generator's own 2 devices (the colocated RL loop): the jitted one-program reshard
    fsdp2 = shard_params(perturbed, CFG, make_mesh(MeshConfig(fsdp=2), jax.devices()[:2]), ShardingPreset.FSDP,
                         strict=True)
    eng = JaxEngine(CFG, params, base, mesh=mesh2)
    eng.update_weights(fsdp2)
    compare("tp2_after_fsdp2_sync", run(eng), ref_perturbed, eng)
    results["tp2_after_fsdp2_sync"]["reshard_path"] = eng.reshard_path
    # W8A8 + FP8 KV: shard-local quantization (same codes), FP8 rounding may flip a near-tie
    fp8 = dataclasses.replace(base, precision=Fp8Mode.ALL)
    eng = JaxEngine(CFG, params, fp8, mesh=mesh2)
    fp8_single = run(JaxEngine(CFG, params, fp8))
    compare("tp2_fp8_all", run(eng), fp8_single, eng)
    compare("fp8_vs_float32", fp8_single, ref, eng)  # the scale of FP8's own perturbation
    q = eng.params["layers"][0]["mlp"]["gate_proj"]["weight"].get_value()
    results["tp2_fp8_all"]["quantized_and_split"] = isinstance(q, QuantizedWeight) and \
        q.q.sharding.spec == q.scale_inv.sharding.spec and q.q.addressable_shards[0].data.shape[0] == CFG.intermediate_size // 2
    results["fp8_policy_sharded"] = eng.policy.sharding is not None and len(eng.policy.sharding.specs) == 7 * CFG.num_layers
    # the Pallas cases last: a process's first Pallas call (interpret mode) registers a JAX config value
    # that is part of every jit cache key, so each program compiled before it would be traced and
    # compiled again when next used
    eng = JaxEngine(CFG, params, base, mesh=mesh2)
    eng.cache = eng.cache.replace(kernels=Kernels.PALLAS)
    compare("tp2_pallas", run(eng), ref, eng)
    results["pallas_gemm"] = _pallas_gemm_per_shard(mesh2)
    errors = {}
    for name, mesh in (("data_axis", make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])),
                       ("heads", make_mesh(MeshConfig(tensor=8), jax.devices()))):
        try:
            JaxEngine(CFG, params, base, mesh=mesh)
        except ValueError as e:
            errors[name] = str(e)
    results["errors"] = errors
    Path(out_path).write_text(json.dumps(results))


def _pallas_gemm_per_shard(mesh) -> dict:
    """The W8A8 Pallas GEMM (forced, interpret mode) on tensor-split FP8 weights against one device:
    column-parallel (N split) and row-parallel (K split, psum in float32), and the collectives XLA
    compiles around it. The Triton kernel is forced (Mosaic GPU's interpret mode cannot run one
    kernel on two CPU devices at once: a shared-memory barrier check races); the per-shard wrapping
    is the same for both kernels."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fp8rl_jax.models.policy import Proj, Site
    from fp8rl_jax.numerics.fp8 import QuantizedWeight
    from fp8rl_jax.quant.policy import Kernels, W8A8Policy, WeightSharding, quantize_weight

    from pallas_kernels import fp8_gemm_mgpu

    fp8_gemm_mgpu.supports = lambda *a, **kw: False  # this child process only: the Triton kernel
    rng = np.random.default_rng(0)
    out = {}
    for name, (n, k), spec, proj in (("column", (512, 256), P("tensor", None), Proj.GATE),
                                     ("row", (256, 512), P(None, "tensor"), Proj.DOWN)):
        site = Site(0, proj)
        w = quantize_weight(jnp.asarray(rng.normal(0, 0.2, (n, k)), jnp.float32), kernels=Kernels.REFERENCE)
        x = jnp.asarray(rng.normal(0, 1, (2, 3, k)), jnp.float32)
        one = W8A8Policy("float32", kernels=Kernels.PALLAS)
        split = W8A8Policy("float32", kernels=Kernels.PALLAS, sharding=WeightSharding(mesh, ((site, spec),)))
        sh = NamedSharding(mesh, spec)
        ws = jax.device_put(w, QuantizedWeight(q=sh, scale_inv=sh, block_size=w.block_size))
        y1 = np.asarray(jax.jit(functools.partial(one.dot, site=site))(x, w))
        f = jax.jit(functools.partial(split.dot, site=site))
        y2 = np.asarray(f(x, ws))
        hlo = f.lower(x, ws).compile().as_text()
        out[name] = {"max_rel": float(np.abs(y1 - y2).max() / np.abs(y1).max()),
                     "all_gathers": hlo.count("all-gather("), "all_reduces": hlo.count("all-reduce(")}
    return out


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    return run_device_child(__file__, tmp_path_factory.mktemp("tp") / "results.json", DEVICES)


@pytest.mark.parametrize("case", ["tp2", "tp4", "tp2_pallas", "tp2_preempt", "tp2_swap", "tp2_after_fsdp_sync",
                                  "tp2_after_fsdp2_sync"])
def test_tensor_parallel_greedy_equals_one_device(multi, case):
    rec = multi[case]
    _assert_same_greedy(rec, multi["seed"])
    assert rec["pool_spec"][:3] == [None, None, "tensor"] and rec["pool_devices"] in (2, 4)  # split on kv heads


def _assert_same_greedy(rec, seed):
    """Same tokens, logprobs equal up to float32 summation order. A row may part from the reference
    only at a tie: random float32 weights make two top logits equal to within summation order now and
    then (CI's seed 131518682: one row of six in every TP case), and either argmax is then right. At the
    first differing token both runs' greedy tokens have logprobs equal within LP_TOL (``tie_gaps``, also
    in ``lp_err``); a run that computed another distribution would move it by far more."""
    assert rec["lp_err"] < LP_TOL, (seed, rec)
    ties = rec["tie_gaps"]  # empty when a row differs only in length: no tie explains that
    assert rec["tokens_equal"] or (rec["rows_identical"] >= 0.5 and ties and max(ties) < LP_TOL), (seed, rec)


def test_generator_layout_and_pool_size(multi):
    # column-parallel q (heads split), row-parallel o; the per-device KV budget buys tp x the pages
    for tp in (2, 4):
        q, o = (spec + [None] * (2 - len(spec)) for spec in multi[f"tp{tp}"]["q_o_specs"])
        assert q == ["tensor", None] and o == [None, "tensor"], multi[f"tp{tp}"]["q_o_specs"]
    assert multi["tp4"]["num_pages"] == 2 * multi["tp2"]["num_pages"] or multi["tp2"]["num_pages"] == 40
    # one prefill program (the prompts fit one bucket, nothing is preempted) and one decode program per
    # mesh: host inputs placed like the programs' outputs (each compiled twice before)
    assert multi["tp2"]["preemptions"] == 0 and multi["tp2"]["compiles"] == [1, 1], multi["tp2"]
    assert multi["tp4"]["compiles"] == [1, 1], multi["tp4"]


def test_preemption_and_weight_sync_under_tp(multi):
    rec = multi["tp2_preempt"]
    assert rec["preemptions"] > 0  # and its tokens are the roomy one-device run's (test above)
    swap = multi["tp2_swap"]
    assert swap["preemptions"] > 0 and swap["swaps"] == [swap["preemptions"]] * 2  # every preemption swapped
    sync = multi["tp2_after_fsdp_sync"]
    assert sync["changed"] and set(sync["last_sync"]) == {"reshard_s", "quantize_s"}
    # params on the generator's devices move in one compiled program; from other devices leaf by leaf
    assert multi["tp2_after_fsdp2_sync"]["reshard_path"] == "jit" and sync["reshard_path"] == "device_put"


def test_fp8_tensor_parallel_generation(multi):
    rec = multi["tp2_fp8_all"]
    assert rec["quantized_and_split"]
    # Same FP8 weight codes on every shard (bitwise: test_parallel.py); only float32 summation
    # order differs, and where it moves an activation across an FP8 rounding boundary (a 1/16
    # step) the logprobs move (~1e-2 on average on this tiny, large-weight model; 0.13 at most
    # seen), and rarely a near-tie flips a token (1 of 84 seen), after which that row continues
    # another sequence. So: most rows identical, and over the tokens both runs share, sharding
    # moves FP8's logprobs by well under what FP8 itself moves them from float32.
    fp8 = multi["fp8_vs_float32"]["lp_err_mean"]
    assert rec["rows_identical"] >= 0.5, (multi["seed"], rec)
    assert rec["lp_err_mean"] < 0.5 * fp8, (multi["seed"], rec, fp8)


def test_fp8_pallas_gemm_runs_per_weight_shard(multi):
    # XLA cannot partition a pallas_call: without shard_map it all-gathers the FP8 weights and runs
    # the GEMM replicated (the TP2 decode slowdown). Per shard: no gather, one all-reduce for a
    # row-parallel weight, none for a column-parallel one; column results are the one-device bits.
    assert multi["fp8_policy_sharded"]
    col, row = multi["pallas_gemm"]["column"], multi["pallas_gemm"]["row"]
    assert col == {"max_rel": 0.0, "all_gathers": 0, "all_reduces": 0}, col
    assert row["all_gathers"] == 0 and row["all_reduces"] == 1 and row["max_rel"] < 1e-6, row


def test_bad_generator_meshes_are_clear_errors(multi):
    assert "one engine per replica" in multi["errors"]["data_axis"]
    assert "must divide the query heads" in multi["errors"]["heads"]


if __name__ == "__main__":
    _child(sys.argv[1])
