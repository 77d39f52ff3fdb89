"""The RL run's generator, by ``rollout.backend``: our JAX engine (default) or vLLM.

Entry points call ``apply_generator_environment(cfg)`` before JAX touches the GPU (the vLLM backend splits
the device's memory between JAX and vLLM, and JAX reads its share once, when its GPU backend starts),
then ``make_generator(cfg, model_config, params, workdir)`` once the trainer's params exist. Either
implements ``fp8rl_jax.rollout.base.Generator``, the only interface the loop uses. On several devices the
JAX engine runs as data-parallel replicas (``fp8rl_jax.rollout.replicas.EngineReplicas``), each
``parallel.generator_tensor`` devices wide; vLLM runs on one GPU.

vLLM starts from a Hugging Face folder written under ``workdir`` from the initial params, in the
rollout's precision: block FP8 (``fp8rl quantize``'s format, which the per-step updates then
overwrite) for W8A8 modes, BF16 otherwise; ``kv_cache_dtype="fp8"`` for FP8 KV modes with the run's
KV calibration side and ``rollout.engine.max_seq_len`` as ``max_model_len``;
``rollout.sleep_while_training`` becomes vLLM's level-1 sleep (KV cache freed, weights offloaded to
host) between rollouts. The initial params are synced once more after the
start, so inference-side KV calibration has weights to measure from the first rollout on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from jax._src import xla_bridge

from fp8rl_jax.checkpoint import save_checkpoint
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.parallel.mesh import MeshConfig, make_mesh
from fp8rl_jax.quant.policy import quantize_params
from fp8rl_jax.rl.config import ConfigError, RLConfig, RolloutBackend
from fp8rl_jax.rollout import vllm_backend as vb
from fp8rl_jax.rollout.base import Generator
from fp8rl_jax.rollout.engine import JaxEngine
from fp8rl_jax.rollout.replicas import EngineReplicas


def _vllm_config(cfg: RLConfig, model_path: str = "") -> vb.VLLMConfig:
    mode, r = cfg.precision.rollout, cfg.rollout
    return vb.VLLMConfig(
        model_path=model_path,
        start_format=vb.StartFormat.FP8_CHECKPOINT if mode.fp8_weights else vb.StartFormat.BF16,
        gpu_memory_utilization=r.vllm_memory, jax_memory_fraction=r.jax_memory,
        kv_cache_dtype="fp8" if mode.fp8_kv else "auto", max_model_len=r.engine.max_seq_len,
        enforce_eager=r.vllm_enforce_eager,
        sleep=vb.SleepLevel.OFFLOAD_WEIGHTS if r.sleep_while_training else vb.SleepLevel.OFF,
        kv_calibration=cfg.precision.kv_calibration, seed=cfg.seed)


def generator_environment(cfg: RLConfig) -> dict[str, str]:
    """Process environment the configured generator needs before JAX starts on the GPU (empty for
    the JAX engine)."""
    if cfg.rollout.backend is RolloutBackend.JAX:
        return {}
    return _vllm_config(cfg).memory_env()


def apply_generator_environment(cfg: RLConfig) -> None:
    """Sets ``generator_environment(cfg)``; raises if JAX's GPU backend already started with other
    settings (it reads its memory fraction once)."""
    env = generator_environment(cfg)
    if not env:
        return
    started = xla_bridge.backends_are_initialized()
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    if started and changed and jax.default_backend() == "gpu":
        raise RuntimeError(f"rollout.backend=vllm needs {changed} before JAX starts on the GPU; JAX already "
                           "started: set them in the environment, or call apply_generator_environment first")
    os.environ.update(env)


def _jax_generator(cfg: RLConfig, model_config: ModelConfig, params: Any, workdir: Path,
                   devices: Sequence[jax.Device]) -> Generator:
    if len(devices) == 1:
        return JaxEngine(model_config, params, cfg.engine_config())
    width = cfg.parallel.generator_tensor
    cfg.parallel.generator_replicas(len(devices))  # checks that the groups divide the devices
    groups = [devices[i:i + width] for i in range(0, len(devices), width)]
    return EngineReplicas.build(model_config, params, cfg.engine_config(), groups,
                                make_mesh=lambda g: make_mesh(MeshConfig(tensor=len(g)), g))


def _vllm_generator(cfg: RLConfig, model_config: ModelConfig, params: Any, workdir: Path,
                    devices: Sequence[jax.Device]) -> Generator:
    if len(devices) != 1:
        raise ConfigError(f"rollout.backend=vllm runs on one GPU; this run has {len(devices)} devices: use the JAX "
                          "engine (rollout.backend=jax), or make one device visible (CUDA_VISIBLE_DEVICES)")
    folder = workdir / "vllm_start"
    vcfg = _vllm_config(cfg, str(folder))
    start = quantize_params(params, model_config, vcfg.layer_policy) if cfg.precision.rollout.fp8_weights else params
    save_checkpoint(folder, start, model_config)
    gen = vb.VLLMGenerator(model_config, vcfg)
    gen.update_weights(params)  # inference-side KV calibration measures from these
    return gen


# rollout.backend -> the builder of its generator: (cfg, model_config, params in the compute dtype, workdir,
# the run's devices)
GENERATORS = {RolloutBackend.JAX: _jax_generator, RolloutBackend.VLLM: _vllm_generator}


def make_generator(cfg: RLConfig, model_config: ModelConfig, params: Any, workdir: Path | str,
                   devices: Sequence[jax.Device] | None = None) -> Generator:
    """The generator of ``cfg.rollout.backend`` (``GENERATORS``) holding ``params`` (the trainer's,
    any float dtype and layout: cast to the compute dtype here) on ``devices`` (default: the first
    device; several: engine replicas)."""
    dtype = cfg.trainer.compute_dtype.value
    cast = jax.tree.map(lambda p: p.astype(dtype) if jax.numpy.issubdtype(p.dtype, jax.numpy.floating) else p,
                        params)
    devices = list(devices) if devices is not None else jax.devices()[:1]
    return GENERATORS[cfg.rollout.backend](cfg, model_config, cast, Path(workdir), devices)
