"""``VLLMGenerator`` and the RL run's vLLM backend against a stand-in vLLM (``tests/fake_vllm.py``):
the calls and their order, never vLLM itself (``tests/test_vllm_backend.py::test_vllm_generator_live``
runs the real one on the GPU)."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fake_vllm
from configs.models import tiny_qwen3
from fp8rl_jax.checkpoint import load_checkpoint, save_checkpoint
from fp8rl_jax.models import DensePolicy, Fp8Mode, calibrate_kv_scales, init_params
from fp8rl_jax.numerics.fp8 import QuantizedWeight
from fp8rl_jax.rl import config as rlconfig
from fp8rl_jax.rl.generator import generator_environment, make_generator
from fp8rl_jax.rollout import vllm_backend as vb
from fp8rl_jax.rollout.base import GENERATOR_MEMBERS, Generator
from fp8rl_jax.rollout.config import EngineConfig, KvCalibration
from fp8rl_jax.rollout.engine import JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig

# FP8 blocks need whole 128-row parts (vLLM fuses q/k/v and gate/up): q 256, k/v 128, gate/up 384 rows
ALIGNED = dataclasses.replace(tiny_qwen3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                              intermediate_size=384, num_layers=2)
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], list(range(10, 30))]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def stand_in(monkeypatch):
    module = fake_vllm.install(monkeypatch)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    return module


def _generator(tmp_path, params, **kw):
    save_checkpoint(tmp_path / "bf16", params, ALIGNED)
    cfg = vb.VLLMConfig(str(tmp_path / "bf16"), start_format=vb.StartFormat.BF16, kv_cache_dtype="fp8", **kw)
    return vb.VLLMGenerator(ALIGNED, cfg)


def _scales_at_last_generate(stand_in):
    return [c for c in stand_in.LLM.instances[-1].calls if c[0] == "generate"][-1][2]


def test_trainer_side_kv_scales_are_never_stale(stand_in, tmp_path):
    """FP8 KV with trainer-side calibration: no generate before set_kv_scales (vLLM would run on its
    default 1.0), none after update_weights until the next set_kv_scales."""
    params = init_params(ALIGNED, jax.random.key(0), jnp.bfloat16)
    gen = _generator(tmp_path, params)
    assert gen.weight_update_path is vb.WeightUpdate.RELOAD  # the stand-in has no live parameters to copy into
    with pytest.raises(RuntimeError, match="stale"):
        gen.generate(PROMPTS, GREEDY)
    k, v = np.array([0.1, 0.2], np.float32), np.array([0.3, 0.4], np.float32)
    gen.set_kv_scales(k, v)
    gen.generate(PROMPTS, GREEDY)
    np.testing.assert_allclose(_scales_at_last_generate(stand_in), np.stack([k, v], 1), rtol=1e-6)
    gen.update_weights(params)
    with pytest.raises(RuntimeError, match="stale"):
        gen.generate(PROMPTS, GREEDY)
    gen.set_kv_scales(k * 2, v * 2)
    gen.generate(PROMPTS, GREEDY)


def test_inference_side_kv_scales_measure_each_update(stand_in, tmp_path):
    """INFERENCE: the first generate after an update calibrates on its first prompts with our forward
    of the updated weights: the scales vLLM runs with are ``calibrate_kv_scales`` of those weights."""
    params = init_params(ALIGNED, jax.random.key(0), jnp.bfloat16)
    other = init_params(ALIGNED, jax.random.key(1), jnp.bfloat16)
    gen = _generator(tmp_path, params, kv_calibration=KvCalibration.INFERENCE, kv_calibration_prompts=2)
    with pytest.raises(RuntimeError, match="update_weights once"):  # no weights to measure yet
        gen.generate(PROMPTS, GREEDY)

    def expected(p):
        tokens = np.zeros((2, 16), np.int32)
        for i, prompt in enumerate(PROMPTS[:2]):
            tokens[i, : len(prompt)] = prompt
        k, v = calibrate_kv_scales(p, jnp.asarray(tokens), jnp.asarray([5, 2]), config=ALIGNED,
                                   policy=DensePolicy("bfloat16"))
        return np.stack([np.asarray(k), np.asarray(v)], 1)

    for p in (params, other):
        gen.update_weights(p)
        first = gen.generate(PROMPTS, GREEDY)
        np.testing.assert_allclose(_scales_at_last_generate(stand_in), expected(p), rtol=1e-5)
        gen.generate(PROMPTS, GREEDY)  # fresh until the next update: no new calibration
        assert first.token_lists() != []
    assert not np.allclose(expected(params), expected(other))


def test_discarded_weights_refuse_generate_until_an_update(stand_in, tmp_path):
    params = init_params(ALIGNED, jax.random.key(0), jnp.bfloat16)
    gen = _generator(tmp_path, params, sleep=vb.SleepLevel.DISCARD_WEIGHTS)
    gen.set_kv_scales(np.full(2, 0.1, np.float32), np.full(2, 0.1, np.float32))
    gen.generate(PROMPTS, GREEDY)  # then vLLM sleeps, dropping its weights
    with pytest.raises(RuntimeError, match="update_weights before generate"):
        gen.generate(PROMPTS, GREEDY)
    gen.update_weights(params)
    gen.set_kv_scales(np.full(2, 0.1, np.float32), np.full(2, 0.1, np.float32))
    gen.generate(PROMPTS, GREEDY)
    calls = [c[0] for c in stand_in.LLM.instances[-1].calls]
    assert calls.count("sleep") == 2 and "wake" in calls


def _rl_config(backend, precision=Fp8Mode.ALL, kv_calibration=KvCalibration.INFERENCE, **rollout):
    return rlconfig.RLConfig(
        model=ALIGNED,
        rollout=rlconfig.RolloutConfig(n_samples=2, max_new_tokens=4, backend=backend, **rollout,
                                       engine=EngineConfig(max_seq_len=32, max_slots=8, page_size=4, steps_per_call=4,
                                                           prefill_batch=8)),
        trainer=rlconfig.TrainConfig(micro_batches=1),
        precision=rlconfig.PrecisionConfig(rollout=precision, kv_calibration=kv_calibration),
        data=rlconfig.DataConfig(prompts_per_step=2, steps=2, eval_every=0))


def test_make_generator_per_backend(stand_in, tmp_path, monkeypatch):
    params = init_params(ALIGNED, jax.random.key(0), jnp.float32)
    jax_cfg = _rl_config(rlconfig.RolloutBackend.JAX)
    assert generator_environment(jax_cfg) == {}
    assert isinstance(make_generator(jax_cfg, ALIGNED, params, tmp_path), JaxEngine)

    cfg = _rl_config(rlconfig.RolloutBackend.VLLM, sleep_while_training=True, vllm_memory=0.5, jax_memory=0.4)
    env = generator_environment(cfg)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4" and env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # what an entry point sets before JAX starts
    gen = make_generator(cfg, ALIGNED, params, tmp_path)
    llm = stand_in.LLM.instances[-1]
    assert isinstance(gen, vb.VLLMGenerator)
    kw = llm.kwargs
    assert (kw["gpu_memory_utilization"], kw["kv_cache_dtype"], kw["enable_sleep_mode"], kw["max_model_len"]) == (
        0.5, "fp8", True, 32)
    assert gen.config.sleep is vb.SleepLevel.OFFLOAD_WEIGHTS and gen.config.kv_calibration is KvCalibration.INFERENCE
    start = load_checkpoint(tmp_path / "vllm_start", fp8=True)  # the block-FP8 folder vLLM started from
    assert start.hf_config["quantization_config"]["weight_block_size"] == [128, 128]
    assert any(isinstance(v.get_value(), QuantizedWeight) for _, v in nnx.to_flat_state(start.params))
    assert llm.version == 1  # synced once after the start: inference-side calibration has weights
    with pytest.raises(rlconfig.ConfigError, match="vllm_memory"):
        _rl_config(rlconfig.RolloutBackend.VLLM, vllm_memory=0.6, jax_memory=0.4)


def test_rl_steps_on_the_vllm_backend(stand_in, tmp_path):
    """Two RL steps with vLLM as the generator: each step's rollout runs on the weights of the last
    update, with KV scales measured after it (inference side) or synced by the trainer."""
    from fp8rl_jax.rl.loop import Task, rl_step
    from fp8rl_jax.rl.trainer import init_train_state, make_logprob_fn, make_optimizer, make_train_step
    from fp8rl_jax.tasks import Example

    params = init_params(ALIGNED, jax.random.key(0), jnp.float32)
    for kv_calibration in (KvCalibration.INFERENCE, KvCalibration.TRAINER):
        cfg = _rl_config(rlconfig.RolloutBackend.VLLM, precision=Fp8Mode.KV, kv_calibration=kv_calibration)
        gen = make_generator(cfg, ALIGNED, params, tmp_path / kv_calibration.value)
        if kv_calibration is KvCalibration.TRAINER:  # the first rollout's scales, as an entry point would sync
            gen.set_kv_scales(np.full(2, 0.05, np.float32), np.full(2, 0.05, np.float32))
        llm = stand_in.LLM.instances[-1]
        task = Task(next_batch=lambda n: [Example(prompt="ab", answer="")] * n,
                    encode=lambda s: [3 + (ord(c) % 20) for c in s], decode=lambda ids: "x" * len(ids),
                    reward_fn=lambda text, ans: float(len(text) % 2 == 0))
        opt = make_optimizer(cfg.optimizer)
        state = init_train_state(params, opt, jax.random.key(1))
        tc, policy = cfg.trainer_config(), cfg.train_policy()
        train_step, logprob_fn = make_train_step(ALIGNED, policy, tc, opt), make_logprob_fn(ALIGNED, policy, tc)
        for step in range(2):
            state, m = rl_step(step, state, cfg=cfg, task=task, engine=_ProtocolOnly(gen), train_step=train_step,
                               logprob_fn=logprob_fn, model_config=ALIGNED)
            assert np.isfinite(m["mismatch/kl_k3"]) and m["time/weight_sync_s"] > 0
        generates = [c for c in llm.calls if c[0] == "generate"]
        assert llm.version == 3 and len(generates) == 2  # start sync + one per step; one rollout per step
        assert all(s != (1.0, 1.0) for _, _, scales in generates for s in scales)  # never vLLM's default


class _ProtocolOnly:
    """The generator seen through the ``Generator`` protocol only: any other attribute raises."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name not in GENERATOR_MEMBERS:
            raise AttributeError(f"the RL loop used {name!r}, which is not in the Generator protocol")
        return getattr(self._inner, name)


def _compatible(protocol: inspect.Signature, impl: inspect.Signature) -> list[str]:
    """How ``impl`` fails to accept every call ``protocol`` allows (empty when it does)."""
    problems = []
    got = impl.parameters
    for name, p in protocol.parameters.items():
        q = got.get(name)
        if q is None:
            problems.append(f"no parameter {name!r}")
        elif (q.kind, q.default) != (p.kind, p.default):
            problems.append(f"{name!r}: {q.kind.name} default {q.default!r}, protocol {p.kind.name} default {p.default!r}")
    extra = [n for n, q in got.items() if n not in protocol.parameters and q.default is inspect.Parameter.empty
             and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return problems + [f"extra required parameter {n!r}" for n in extra]


def test_both_generators_implement_the_whole_protocol(stand_in, tmp_path):
    """JaxEngine and VLLMGenerator have every ``Generator`` member, methods with signatures that
    accept every call the protocol allows; ``GENERATOR_MEMBERS`` lists exactly the protocol's."""
    declared = {n for n, v in vars(Generator).items() if not n.startswith("_") and (callable(v) or
                                                                                    isinstance(v, property))}
    assert declared == set(GENERATOR_MEMBERS)
    assert all(getattr(Generator, name).__doc__ for name in GENERATOR_MEMBERS)
    for cls in (JaxEngine, vb.VLLMGenerator):
        for name in GENERATOR_MEMBERS:
            if name == "params":
                continue
            want, got = inspect.signature(getattr(Generator, name)), inspect.signature(getattr(cls, name))
            assert not _compatible(want, got), (cls.__name__, name, _compatible(want, got))
    params = init_params(ALIGNED, jax.random.key(0), jnp.bfloat16)
    engine = JaxEngine(ALIGNED, params, EngineConfig(max_slots=4, page_size=4, num_pages=16, max_seq_len=32))
    gen = _generator(tmp_path, params)
    assert engine.params is not None and gen.params is None  # vLLM's weights are torch tensors inside it
    def other_default(self, weights=True): ...

    def extra_required(self, weights=False, level=1, *, tags): ...

    assert _compatible(inspect.signature(Generator.sleep), inspect.signature(other_default)) == [
        "'weights': POSITIONAL_OR_KEYWORD default True, protocol POSITIONAL_OR_KEYWORD default False"]
    assert _compatible(inspect.signature(Generator.sleep), inspect.signature(extra_required)) == [
        "extra required parameter 'tags'"]


def test_vllm_sleep_and_wake(stand_in, tmp_path):
    """``sleep`` is vLLM's sleep at the configured level, once (generate already slept: a no-op), and
    a no-op without sleep mode; ``wake`` brings it back, and ``generate`` wakes it itself."""
    params = init_params(ALIGNED, jax.random.key(0), jnp.bfloat16)
    scales = np.full(2, 0.1, np.float32), np.full(2, 0.1, np.float32)
    off = _generator(tmp_path / "off", params)
    off.sleep(weights=True)
    off.wake()
    assert not [c for c in stand_in.LLM.instances[-1].calls if c[0] in ("sleep", "wake")]
    gen = _generator(tmp_path / "on", params, sleep=vb.SleepLevel.OFFLOAD_WEIGHTS)
    llm = stand_in.LLM.instances[-1]
    gen.set_kv_scales(*scales)
    gen.sleep(weights=True)
    gen.sleep()
    assert [c[0] for c in llm.calls if c[0] in ("sleep", "wake")] == ["sleep"]
    gen.wake()
    gen.wake()
    gen.generate(PROMPTS, GREEDY)  # then sleeps again (the configured level); the loop's sleep is a no-op
    gen.sleep(weights=True)
    assert [c[0] for c in llm.calls if c[0] in ("sleep", "wake")] == ["sleep", "wake", "sleep"]
