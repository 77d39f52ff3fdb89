"""One RL step on a device mesh equals the same step on one device (8 CPU devices).

``parallel.ParallelConfig`` lays the train state out on a ``data x fsdp x expert x tensor`` mesh
(``rl.sharded.make_mesh_trainer``) and runs the generator as engine replicas, one per device
(``rollout.replicas.EngineReplicas``). The child process (``python tests/test_rl_mesh.py OUT``, 8
forced host devices) draws fresh random weights and prompts, runs one full ``rl_step`` (FP8 W8A8 +
FP8 KV rollout with inference-side KV calibration, scoring, trainer logprobs, update, weight sync)
on one device and on each mesh, and writes what the tests below compare:

* the rollout: tokens, lengths and rollout logprobs identical (sampling keys depend only on the
  request's seed and position; every replica gets the same KV scales);
* the step's metrics and the updated float32 params: equal up to the order of float32 sums;
* the weight sync: each replica's re-quantized FP8 weights equal, bit for bit, what one engine on
  one device makes of the same trained params.
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

DEVICES = 8
RTOL = 1e-5
ATOL = 1e-6  # metrics that are means of signed O(1) terms can be ~0
SCALE = {"mismatch/ppl_gap": "mismatch/ppl_rollout"}
# A log-ratio (trainer minus rollout logprob of one token) is compared at the scale of a logprob, not of
# the (often tiny) difference: float32 logprobs of this 64-token vocabulary carry ~1e-6 of sum-order noise.
LOGPROB_SCALE = 10.0
# name -> (model, ParallelConfig fields, generator devices). The generator runs one replica on each of
# the first 4 of the 8 devices while the trainer's mesh spans all 8 (a run puts one on every device):
# each replica compiles its own engine programs, the largest cost of this file on the CPU, and 4
# replicas exercise the split, the shared KV scales and the weight sync as 8 would.
CASES = {
    "dp8": ("dense", dict(data=8), 4),
    "fsdp8": ("dense", dict(), 4),  # the default: FSDP over every device
    "fsdp4_tp2": ("dense", dict(tensor=2), 4),
    "ep4_dp2_moe": ("moe", dict(data=2, expert=4), 4),
}


def _child(out_path: str) -> None:
    import jax
    import jax.numpy as jnp

    from configs.models import tiny_qwen3, tiny_qwen3_moe
    from fp8rl_jax.models import init_params
    from fp8rl_jax.models.policy import Fp8Mode
    from fp8rl_jax.parallel.mesh import make_mesh
    from fp8rl_jax.rl import config as rlconfig
    from fp8rl_jax.rl.generator import make_generator
    from fp8rl_jax.rl.loop import Task, rl_step
    from fp8rl_jax.rl.sharded import make_mesh_trainer
    from fp8rl_jax.rl.trainer import (ComputeDtype, OptimizerConfig, init_train_state, make_logprob_fn,
                                      make_optimizer, make_train_step)
    from fp8rl_jax.rollout.config import EngineConfig, KvCalibration
    from fp8rl_jax.rollout.engine import JaxEngine
    from fp8rl_jax.tasks import Example

    assert jax.device_count() == DEVICES
    seed = int(os.environ.get("FP8RL_TEST_SEED", time.time_ns() % 2**31))
    rng = np.random.default_rng(seed)
    # Every sharded axis divides: V 64, D 32, F 64, 4 heads, 2 kv heads, 8 experts.
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                 head_dim=8, eos_token_ids=(1,))
    models = {"dense": dataclasses.replace(tiny_qwen3, **shape),
              "moe": dataclasses.replace(tiny_qwen3_moe, **shape, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=16)}
    params = {k: init_params(m, jax.random.key(int(rng.integers(2**31))), jnp.float32) for k, m in models.items()}
    prompts = [[int(t) for t in rng.integers(2, 64, size=int(rng.integers(2, 7)))] for _ in range(8)]

    def rl_config(model: str, parallel: dict) -> rlconfig.RLConfig:
        return rlconfig.RLConfig(
            model=models[model],
            rollout=rlconfig.RolloutConfig(n_samples=2, max_new_tokens=6, sleep_while_training=True, engine=EngineConfig(
                max_seq_len=32, max_slots=16, page_size=4, num_pages=128, steps_per_call=3, prefill_batch=8,
                record_routing=model == "moe")),
            trainer=rlconfig.TrainConfig(micro_batches=2, compute_dtype=ComputeDtype.FLOAT32),
            # Adam's eps well above the gradients' float32 noise, so a sum order cannot flip a tiny update
            optimizer=OptimizerConfig(lr=1e-3, eps=1e-4, weight_decay=0.0),
            precision=rlconfig.PrecisionConfig(rollout=Fp8Mode.ALL, kv_calibration=KvCalibration.INFERENCE),
            data=rlconfig.DataConfig(prompts_per_step=len(prompts), steps=1, eval_every=0),
            parallel=rlconfig.ParallelConfig(**parallel), seed=seed % 1000)

    task = Task(next_batch=lambda n: [Example(prompt=str(i), answer="") for i in range(n)],
                encode=lambda s: prompts[int(s)], decode=lambda ids: " ".join(map(str, ids)),
                reward_fn=lambda text, ans: float(sum(map(int, text.split())) % 3 == 0) if text else 0.0)

    def step(cfg: rlconfig.RLConfig, devices: list, generator_devices: list | None = None) -> dict:
        model_cfg = cfg.model
        tc, policy = cfg.trainer_config(), cfg.train_policy()
        if len(devices) == 1:
            opt = make_optimizer(tc.optimizer)
            state = init_train_state(params_of(cfg), opt, jax.random.key(1))
            train_step, logprob_fn = make_train_step(model_cfg, policy, tc, opt), make_logprob_fn(model_cfg, policy, tc)
        else:
            trainer = make_mesh_trainer(model_cfg, policy, tc, make_mesh(cfg.parallel.mesh_config(len(devices)), devices))
            state = trainer.place(init_train_state(params_of(cfg), trainer.optimizer, jax.random.key(1)))
            train_step, logprob_fn = trainer.train_step, trainer.logprob_fn
        engine = make_generator(cfg, model_cfg, state.params, "unused", generator_devices or devices)
        rollouts = []

        def generate(prompts, sampling):
            out = engine.generate(prompts, sampling)
            rollouts.append(out)
            return out

        spy = type("Spy", (), {})()
        for name in ("update_weights", "set_kv_scales", "sleep", "wake"):
            setattr(spy, name, getattr(engine, name))
        spy.generate = generate
        type(spy).params = property(lambda self: engine.params)
        state, metrics = rl_step(0, state, cfg=cfg, task=task, engine=spy, train_step=train_step,
                                 logprob_fn=logprob_fn, model_config=model_cfg)
        trained = jax.device_get(state.params)
        # the weight sync's reference: one engine on one device quantizing the same trained params
        one = JaxEngine(model_cfg, jax.tree.map(lambda x: x.astype(jnp.float32), trained), cfg.engine_config(),
                        device=devices[0], asleep=True)
        synced = [engine.params] if len(devices) == 1 else engine.params
        sync_bitwise = all(
            all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                for a, b in zip(jax.tree.leaves(jax.device_get(p)), jax.tree.leaves(jax.device_get(one.params)),
                                strict=True)) for p in synced)
        placement = sorted({str(d) for p in synced for x in jax.tree.leaves(p) for d in x.devices()})
        ro = rollouts[0]
        return {"metrics": {k: float(v) for k, v in metrics.items() if not k.startswith("time/") and "per_s" not in k},
                "params": trained, "tokens": ro.tokens.tolist(), "lengths": ro.lengths.tolist(),
                "logprobs": ro.logprobs.tolist(), "sync_bitwise": bool(sync_bitwise), "sync_devices": placement,
                "replicas": len(synced)}

    def params_of(cfg):
        return params["moe" if cfg.model.num_experts else "dense"]

    results: dict = {"seed": seed, "time_s": {}}
    t0 = time.perf_counter()
    refs = {m: step(rl_config(m, {}), jax.devices()[:1]) for m in models}
    results["time_s"]["one_device"] = time.perf_counter() - t0
    for name, (model, parallel, gen) in CASES.items():
        t0 = time.perf_counter()
        got, ref = step(rl_config(model, parallel), jax.devices(), jax.devices()[:gen]), refs[model]
        results["time_s"][name] = time.perf_counter() - t0
        scale = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(ref["params"]))
        params_err = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                         for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(ref["params"]), strict=True)) / scale
        # in units of the tolerance; a metric that is a difference of two is compared at their scale
        def scale(k, v):
            other = abs(ref["metrics"].get(SCALE.get(k), 0.0))
            return max(abs(v), other, LOGPROB_SCALE if k.startswith("mismatch/log_ratio") else 0.0)

        metric_err = {k: abs(got["metrics"][k] - v) / (ATOL + RTOL * scale(k, v)) for k, v in ref["metrics"].items()}
        results[name] = {
            "same_rollout": got["tokens"] == ref["tokens"] and got["lengths"] == ref["lengths"],
            "logprob_err": float(np.max(np.abs(np.asarray(got["logprobs"]) - np.asarray(ref["logprobs"])))),
            "params_err": params_err, "metric_err": max(metric_err.values()),
            "worst_metric": max(metric_err, key=metric_err.get), "metric_keys": sorted(got["metrics"]) == sorted(ref["metrics"]),
            "sync_bitwise": got["sync_bitwise"], "sync_devices": got["sync_devices"], "replicas": got["replicas"],
            "ref_sync_bitwise": ref["sync_bitwise"], "generator_devices": gen,
        }
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    return run_device_child(__file__, tmp_path_factory.mktemp("rl_mesh") / "results.json", DEVICES)


@pytest.mark.parametrize("case", list(CASES))
def test_rl_step_on_a_mesh_equals_one_device(multi, case):
    rec = multi[case]
    assert rec["same_rollout"] and rec["logprob_err"] == 0.0, (multi["seed"], rec)
    assert rec["metric_keys"]
    assert rec["metric_err"] < 1, (multi["seed"], rec["worst_metric"], rec["metric_err"])
    assert rec["params_err"] < RTOL, (multi["seed"], rec["params_err"])


@pytest.mark.parametrize("case", list(CASES))
def test_weight_sync_after_a_mesh_step_is_a_single_device_quantization(multi, case):
    rec = multi[case]
    assert rec["ref_sync_bitwise"] and rec["sync_bitwise"], multi["seed"]
    # one replica per generator device, each holding its weights on its own device
    assert rec["replicas"] == rec["generator_devices"] == len(rec["sync_devices"]) == CASES[case][2]


def test_parallel_config_fills_fsdp_and_names_what_does_not_fit():
    from fp8rl_jax.parallel.mesh import MeshConfig
    from fp8rl_jax.rl.config import ConfigError, ParallelConfig

    assert ParallelConfig().mesh_config(8) == MeshConfig(fsdp=8)
    assert ParallelConfig(tensor=2).mesh_config(8) == MeshConfig(fsdp=4, tensor=2)
    assert ParallelConfig(data=2, expert=4).mesh_config(8) == MeshConfig(data=2, expert=4)
    assert ParallelConfig(data=2, fsdp=4).mesh_config(8) == MeshConfig(data=2, fsdp=4)
    assert ParallelConfig(generator_tensor=2).generator_replicas(8) == 4
    with pytest.raises(ConfigError, match="tensor 3 does not fit 8 devices"):
        ParallelConfig(tensor=3).mesh_config(8)
    with pytest.raises(ConfigError, match="does not fit 8 devices"):
        ParallelConfig(data=2, fsdp=2).mesh_config(8)
    with pytest.raises(ConfigError, match="generator_tensor = 4 does not divide"):
        ParallelConfig(generator_tensor=4).generator_replicas(6)
    for bad in (dict(data=0), dict(fsdp=-1)):
        with pytest.raises(ConfigError, match="parallel."):
            ParallelConfig(**bad)
    for bad in (dict(tensor=True), dict(generator_tensor=1.5), dict(fsdp="2")):
        with pytest.raises(ValueError, match=f"ParallelConfig.{next(iter(bad))} must be an int, got"):
            ParallelConfig(**bad)


def test_replica_outputs_concatenate_in_request_order():
    from fp8rl_jax.rollout.base import FinishReason, RolloutBatch
    from fp8rl_jax.rollout.replicas import concat_batches, split_evenly

    assert [list(r) for r in split_evenly(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(r) for r in split_evenly(2, 4)] == [1, 1, 0, 0]
    rng = np.random.default_rng()
    widths, ns = rng.integers(1, 6, size=3), rng.integers(1, 4, size=3)
    batches = [RolloutBatch(tokens=rng.integers(1, 50, size=(n, w)).astype(np.int32),
                            logprobs=-rng.random((n, w)).astype(np.float32), lengths=np.full(n, w, np.int32),
                            finish_reasons=[FinishReason.LENGTH] * n, preemptions=int(n),
                            routing=rng.integers(0, 8, size=(n, w + 2, 1, 2)).astype(np.int32))
               for n, w in zip(ns, widths)]
    out = concat_batches(batches)
    W, row = int(widths.max()), 0
    assert out.tokens.shape == (ns.sum(), W) and out.routing.shape == (ns.sum(), W + 2, 1, 2)
    for b in batches:
        n, w = b.tokens.shape
        np.testing.assert_array_equal(out.tokens[row:row + n, :w], b.tokens)
        assert not out.tokens[row:row + n, w:].any() and (out.routing[row:row + n, w + 2:] == -1).all()
        np.testing.assert_array_equal(out.routing[row:row + n, :w + 2], b.routing)
        row += n
    assert out.preemptions == ns.sum() and out.token_lists()[0] == batches[0].token_lists()[0]


if __name__ == "__main__":
    _child(sys.argv[1])
