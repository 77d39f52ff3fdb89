"""``VLLMGenerator``: vLLM 0.26 as the rollout backend, in one process with JAX on one GPU.

Optional: ``pip install 'fp8rl_jax[vllm]'``. vLLM (and torch) are imported only when a
``VLLMGenerator`` is built; ``import fp8rl_jax`` never needs them. Everything vLLM-specific is in
this module; the name/layout table and the DLPack export are in ``vllm_names`` (no vLLM).

Process and memory
------------------
vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the trainer's JAX arrays reach
it as zero-copy torch views. The GPU is split explicitly: JAX preallocates
``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the memory (set it before JAX initializes its GPU backend;
``memory_env`` gives the values), vLLM takes ``gpu_memory_utilization`` of the total for weights,
activations and KV cache; the two plus ``VLLMConfig.headroom`` (CUDA contexts, cuBLAS workspaces,
torch's allocator) must stay within 1. Optionally vLLM sleeps between rollouts
(``SleepLevel``) so the trainer gets its KV-cache memory back.

Weights
-------
Start: vLLM loads the block-FP8 folder written by ``fp8rl quantize`` (``StartFormat.FP8_CHECKPOINT``)
or a BF16 folder served in BF16 (``StartFormat.BF16``, the BF16 rollout baseline), or a BF16 folder
quantized by vLLM at load time (``StartFormat.BF16_ONLINE``:
``quantization="fp8_per_block"``, vLLM's own quantizer, not bit-identical to ours).
``update_weights(params)``: (FP8_CHECKPOINT) ``quantize_params`` (our fused Pallas kernel on the
GPU, jitted), then one of two ways (``WeightUpdate``):
- RELOAD: ``vllm_names.export_checkpoint`` with ``to_torch_tensor`` (zero-copy DLPack views,
  per-expert slices are torch views) -> ``reload_weights(weights_iterator=..., is_checkpoint_format=
  True)`` on the in-process worker. That is vLLM 0.26's in-place reload
  (``v1/worker/gpu_model_runner.py``, ``model_executor/model_loader/reload/layerwise.py``): each
  layer is restored to its checkpoint layout, loaded through the model's own ``load_weights``
  (which fuses q/k/v, gate/up and the experts at the offsets ``vllm_table`` states), then its
  ``process_weights_after_loading`` is redone (the scale layout of the GEMM kernel) and copied into
  the original storage, so captured CUDA graphs stay valid. Generic, and slow: mostly per-layer
  host work.
- DIRECT: every vLLM parameter is written in place (``copy_``, so CUDA graphs stay valid) from the
  DLPack views, fused parts at their ``vllm_table`` offsets, in the layout vLLM keeps after
  loading. For block FP8 that layout is decided by the linear's kernel
  (``Fp8LinearMethod.fp8_linear``): DeepGEMM (E8M0 off) keeps the codes and transforms the scales
  (``deepgemm_post_process_weight_scale_block``, called here on the fused scales); the other
  block kernels on CUDA keep both (``process_fp8_weight_block_strategy``). The plan is built and
  checked (names, shapes, the scale transform's output shape) when the generator starts; AUTO
  uses RELOAD instead where it does not hold (another kernel, MoE experts, BF16_ONLINE), and
  ``weight_update_path`` says which ran. The live test checks that both give the same tokens.
BF16 and BF16_ONLINE send the BF16 weights (BF16_ONLINE: vLLM requantizes them, RELOAD only).

KV scales (``kv_cache_dtype="fp8"``): ``set_kv_scales(k, v)`` writes our per-layer scales
(``calibrate_kv_scales``: dequant multipliers, ``x ~= q * s``, the convention of vLLM's ``_k_scale``)
into every attention layer's ``_k_scale``/``_v_scale`` (+ the ``*_float`` and ``*_cpu`` copies some
backends read). As in our engine, scales are stale from the start (the checkpoint has none: vLLM would
use 1.0) and after every ``update_weights``, and a generate never runs on stale ones:
``VLLMConfig.kv_calibration`` TRAINER makes it raise until ``set_kv_scales``; INFERENCE calibrates on
the first ``kv_calibration_prompts`` prompts of that generate with our forward of the weights the last
update gave (BF16, the same ``calibrate_kv_scales`` as the trainer side). vLLM's own
``calculate_kv_scales`` measures once per engine, not per update, and stays off.

Logprobs
--------
Our convention (``sampling.py``): ``log_softmax(logits / T)[token]`` before top-k/top-p, plain
``log_softmax`` at ``T = 0``. vLLM's ``logprobs_mode`` is engine-wide:
- ``processed_logprobs``: after temperature *and* top-k/top-p (and penalties, min-p, logit bias,
  which we never set); greedy rows use temperature 1. Equal to ours whenever the request does not
  truncate (``top_k == 0`` and ``top_p == 1``, the RL default) or is greedy.
- ``raw_logprobs`` (vLLM's default): ``log_softmax(logits)`` before everything. Equal to ours when
  ``T`` is 0 or 1, whatever the truncation.
``sampling_params`` refuses a request whose logprob would differ (neither case holds), naming the
fix. vLLM also treats ``0 < T < 1e-5`` as greedy; we refuse those temperatures.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.calibration import calibrate_kv_scales_jit, calibration_batch
from fp8rl_jax.models.policy import DensePolicy
from fp8rl_jax.quant.policy import LayerPolicy, quantize_params
from fp8rl_jax.rollout.base import FinishReason, RolloutBatch
from fp8rl_jax.rollout.config import KvCalibration
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.checkpoint.hf import SCALE_SUFFIX
from fp8rl_jax.rollout.vllm_names import (
    abstract_quantized_params,
    export_checkpoint,
    flat_leaves,
    source_arrays,
    to_torch_tensor,
    vllm_table,
)

SUPPORTED_VLLM = "0.26"
INSTALL_HINT = "pip install 'fp8rl_jax[vllm]'"
_VLLM_GREEDY_EPS = 1e-5  # vllm/v1/sample/sampler.py _SAMPLING_EPS
# Process environment the backend needs, set before vLLM is imported.
REQUIRED_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: DLPack views, direct model access
    "VLLM_USE_DEEP_GEMM_E8M0": "0",  # float32 block scales, not power-of-two (UE8M0) ones
}


class LogprobsMode(enum.Enum):
    """vLLM's engine-wide ``logprobs_mode`` (see the module docstring for when each matches ours)."""

    PROCESSED = "processed_logprobs"
    RAW = "raw_logprobs"


class StartFormat(enum.Enum):
    """What vLLM loads at start, and so what ``update_weights`` sends."""

    FP8_CHECKPOINT = "fp8_checkpoint"  # our block-FP8 folder; updates send our FP8 codes + scales
    BF16_ONLINE = "bf16_online"  # a BF16 folder, quantization="fp8_per_block"; updates send BF16
    BF16 = "bf16"  # a BF16 folder served in BF16 (the BF16 rollout baseline); updates send BF16


class WeightUpdate(enum.Enum):
    """How ``update_weights`` puts new weights into vLLM (module docstring, Weights)."""

    AUTO = "auto"  # DIRECT where this module knows the layout vLLM keeps, else RELOAD
    DIRECT = "direct"  # copy into vLLM's live parameters in their kernel layout (dense Qwen3)
    RELOAD = "reload"  # vLLM's layerwise reload_weights of the checkpoint-format tensors


class SleepLevel(enum.Enum):
    """vLLM sleep mode between rollouts (``LLM.sleep``): 0 off; 1 offloads weights to host and
    drops the KV cache; 2 drops both (every ``update_weights`` rewrites all weights anyway)."""

    OFF = 0
    OFFLOAD_WEIGHTS = 1
    DISCARD_WEIGHTS = 2


@dataclasses.dataclass(frozen=True)
class VLLMConfig:
    """Settings of the vLLM backend.

    Attributes:
      model_path: the Hugging Face folder vLLM starts from (see ``StartFormat``).
      start_format: FP8 folder from ``fp8rl quantize`` or BF16 with vLLM's online block FP8.
      gpu_memory_utilization: vLLM's fraction of the GPU's total memory.
      jax_memory_fraction: the ``XLA_PYTHON_CLIENT_MEM_FRACTION`` JAX runs with (checked against
        the environment when the generator starts: it must be set before JAX touches the GPU).
      headroom: memory left to neither pool (CUDA contexts, workspaces); the three must sum <= 1.
      kv_cache_dtype: "auto" (the model dtype) or "fp8" (E4M3, scales from ``set_kv_scales``).
      max_model_len: prompt + generation limit.
      enforce_eager: no CUDA graphs (faster start, slower decode).
      sleep: sleep mode between rollouts.
      logprobs_mode: vLLM's logprob mode (PROCESSED matches ours for non-truncating requests).
      layer_policy: what ``update_weights`` quantizes; must match the checkpoint vLLM started from.
      seed: vLLM's engine seed (requests carry their own seeds).
      cudagraph_capture_sizes: decode batch sizes vLLM captures CUDA graphs for (None: vLLM's
        default, 51 sizes up to 512, which take most of its start time).
      weight_update: DIRECT copies (the fast path), RELOAD (vLLM's own machinery), or AUTO.
      kv_calibration: FP8 KV only: where the scales come from after each update (module docstring).
      kv_calibration_prompts: prompts an INFERENCE calibration runs on.
    """

    model_path: str
    start_format: StartFormat = StartFormat.FP8_CHECKPOINT
    gpu_memory_utilization: float = 0.45
    jax_memory_fraction: float = 0.45
    headroom: float = 0.05
    kv_cache_dtype: str = "auto"
    max_model_len: int = 4096
    enforce_eager: bool = False
    sleep: SleepLevel = SleepLevel.OFF
    logprobs_mode: LogprobsMode = LogprobsMode.PROCESSED
    layer_policy: LayerPolicy = dataclasses.field(default_factory=LayerPolicy)
    seed: int = 0
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    weight_update: WeightUpdate = WeightUpdate.AUTO
    kv_calibration: KvCalibration = KvCalibration.TRAINER
    kv_calibration_prompts: int = 16

    def __post_init__(self) -> None:
        for name in ("gpu_memory_utilization", "jax_memory_fraction", "headroom"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        if self.gpu_memory_utilization <= 0 or self.jax_memory_fraction <= 0:
            raise ValueError("gpu_memory_utilization and jax_memory_fraction must be > 0")
        total = self.gpu_memory_utilization + self.jax_memory_fraction + self.headroom
        if total > 1 + 1e-9:
            raise ValueError(f"gpu_memory_utilization ({self.gpu_memory_utilization}) + jax_memory_fraction "
                             f"({self.jax_memory_fraction}) + headroom ({self.headroom}) = {total:.3f} > 1: the GPU "
                             "cannot hold both pools; lower one of them")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not isinstance(self.kv_calibration, KvCalibration) or self.kv_calibration_prompts < 1:
            raise ValueError(f"kv_calibration must be a KvCalibration and kv_calibration_prompts >= 1, got "
                             f"{self.kv_calibration!r}, {self.kv_calibration_prompts!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(n, int) or n < 1 for n in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be positive ints, got {sizes!r}")

    def memory_env(self) -> dict[str, str]:
        """The environment to set before JAX initializes the GPU (and before vLLM is imported)."""
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{self.jax_memory_fraction:g}", **REQUIRED_ENV}

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` for this config."""
        kw: dict[str, Any] = {
            "model": self.model_path, "dtype": "bfloat16", "tensor_parallel_size": 1, "seed": self.seed,
            "gpu_memory_utilization": self.gpu_memory_utilization, "kv_cache_dtype": self.kv_cache_dtype,
            "max_model_len": self.max_model_len, "enforce_eager": self.enforce_eager,
            "enable_sleep_mode": self.sleep is not SleepLevel.OFF, "logprobs_mode": self.logprobs_mode.value,
            "enable_prefix_caching": False,  # a prefix cached under old weights must not serve new ones
            "skip_tokenizer_init": True,  # token ids in, token ids out: no tokenizer (our checkpoints may have none)
        }
        if self.start_format is StartFormat.BF16_ONLINE:
            kw["quantization"] = "fp8_per_block"
        if self.cudagraph_capture_sizes is not None and not self.enforce_eager:
            kw["compilation_config"] = {"cudagraph_capture_sizes": sorted(set(self.cudagraph_capture_sizes))}
        return kw


# ------------------------------------------------------------------------------------ import


def import_vllm(importer: Any = importlib.import_module) -> Any:
    """The ``vllm`` module, checked to be 0.26.x; ``importer`` is replaceable (tests)."""
    try:
        vllm = importer("vllm")
    except ImportError as e:
        raise ImportError(f"the vLLM backend needs vLLM {SUPPORTED_VLLM}.x, which is not installed ({e}); "
                          f"install the extra: {INSTALL_HINT}") from None
    check_vllm_version(getattr(vllm, "__version__", None))
    return vllm


def check_vllm_version(version: str | None) -> None:
    """Raises unless ``version`` is 0.26.x: the backend reaches into vLLM internals (the worker's
    ``reload_weights``, attention ``_k_scale``, parameter names) that change between releases."""
    parts = str(version).split(".")
    if version is None or ".".join(parts[:2]) != SUPPORTED_VLLM or len(parts) < 3:
        raise RuntimeError(f"the vLLM backend supports vLLM {SUPPORTED_VLLM}.x only, found {version!r}: its weight "
                           f"reload and parameter names are version-specific; install {INSTALL_HINT} "
                           f"(pins vllm=={SUPPORTED_VLLM}.0)")


def _set_required_env(environ: dict | None = None) -> None:
    env = os.environ if environ is None else environ
    for key, value in REQUIRED_ENV.items():
        if env.get(key, value) != value:
            raise RuntimeError(f"{key}={env[key]!r} is set, but the vLLM backend needs {key}={value} "
                               "(see fp8rl_jax.rollout.vllm_backend); unset it")
        env[key] = value


def check_jax_memory_fraction(config: VLLMConfig, environ: dict | None = None) -> None:
    """Raises unless JAX runs with the planned ``XLA_PYTHON_CLIENT_MEM_FRACTION``."""
    env = os.environ if environ is None else environ
    got = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if got is None or abs(float(got) - config.jax_memory_fraction) > 1e-6:
        raise RuntimeError(f"XLA_PYTHON_CLIENT_MEM_FRACTION is {got!r}, but the memory split plans "
                           f"{config.jax_memory_fraction}: set VLLMConfig.memory_env() in the environment before "
                           "JAX starts (JAX's default 0.75 leaves vLLM too little)")


# ------------------------------------------------------------------------------------ sampling


def sampling_params(sampling: SamplingConfig, logprobs_mode: LogprobsMode, sampling_params_cls: Any) -> Any:
    """vLLM ``SamplingParams`` for one of our ``SamplingConfig`` (``sampling_params_cls`` is
    ``vllm.SamplingParams``, or a stand-in in tests). Raises ``ValueError`` when vLLM would return
    another logprob than our convention (module docstring) or treat the temperature differently."""
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    t = sampling.temperature
    greedy = t == 0
    if 0 < t < _VLLM_GREEDY_EPS:
        raise ValueError(f"temperature {t} is below vLLM's greedy threshold {_VLLM_GREEDY_EPS}: vLLM would decode "
                         "greedily; use temperature=0 or >= 1e-5")
    truncates = not greedy and (sampling.top_k > 0 or sampling.top_p < 1)
    if logprobs_mode is LogprobsMode.PROCESSED and truncates:
        raise ValueError(f"with logprobs_mode=processed_logprobs vLLM returns logprobs of the top-k/top-p truncated "
                         f"distribution (top_k={sampling.top_k}, top_p={sampling.top_p}), not log_softmax(logits/T); "
                         "use top_k=0, top_p=1, or LogprobsMode.RAW with temperature 1")
    if logprobs_mode is LogprobsMode.RAW and not (greedy or t == 1):
        raise ValueError(f"with logprobs_mode=raw_logprobs vLLM returns log_softmax(logits) without the temperature "
                         f"{t}; use temperature 1 (or 0), or LogprobsMode.PROCESSED without top-k/top-p")
    return sampling_params_cls(
        n=1, temperature=float(t), top_p=1.0 if greedy else float(sampling.top_p),
        top_k=0 if greedy else int(sampling.top_k), seed=int(sampling.seed), max_tokens=int(sampling.max_tokens),
        stop_token_ids=list(sampling.stop_token_ids), ignore_eos=bool(sampling.ignore_eos), logprobs=0,
        detokenize=False, skip_special_tokens=False,
    )


def _sampled_logprob(entry: Any, token: int) -> float:
    """The logprob of ``token`` from one position of vLLM's ``CompletionOutput.logprobs``."""
    lp = entry[token]
    return float(getattr(lp, "logprob", lp))


def rollout_batch(outputs: Sequence[Any], max_len: int, prompt_lengths: Sequence[int]) -> RolloutBatch:
    """Our ``RolloutBatch`` from vLLM ``RequestOutput``s (request order). vLLM says "length" both
    for ``max_tokens`` and for ``max_model_len``; the latter is ``MAX_LEN`` here."""
    toks, lps, reasons = [], [], []
    for out, plen in zip(outputs, prompt_lengths):
        c = out.outputs[0]
        ids = [int(x) for x in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError("vLLM returned no logprob per generated token (SamplingParams.logprobs must be 0)")
        toks.append(ids)
        lps.append([_sampled_logprob(e, t) for e, t in zip(c.logprobs, ids)])
        if c.finish_reason == "stop":
            reasons.append(FinishReason.STOP)
        elif plen + len(ids) >= max_len:
            reasons.append(FinishReason.MAX_LEN)
        else:
            reasons.append(FinishReason.LENGTH)
    n, width = len(toks), max([len(t) for t in toks] + [1])
    tokens, logprobs = np.zeros((n, width), np.int32), np.zeros((n, width), np.float32)
    for i, (t, lp) in enumerate(zip(toks, lps)):
        tokens[i, : len(t)], logprobs[i, : len(lp)] = t, lp
    return RolloutBatch(tokens, logprobs, np.array([len(t) for t in toks], np.int32), reasons)


# ------------------------------------------------------------------------------------ generator


class VLLMGenerator:
    """A ``Generator`` (``fp8rl_jax.rollout.base``) backed by vLLM 0.26 in this process (GPU only)."""

    def __init__(self, model_config: ModelConfig, config: VLLMConfig):
        _set_required_env()
        check_jax_memory_fraction(config)
        self.vllm = import_vllm()
        self.model_config = model_config
        self.config = config
        self.llm = self.vllm.LLM(**config.llm_kwargs())
        self._asleep = False
        self._quantize = jax.jit(functools.partial(quantize_params, config=model_config,
                                                   layer_policy=config.layer_policy))
        self.last_sync: dict[str, float] = {}  # seconds of the last update_weights, by part
        self._direct, self.weight_update_reason = None, ""
        if config.weight_update is not WeightUpdate.RELOAD:
            try:
                self._direct, self.weight_update_reason = self._direct_plan()
            except Exception as e:  # noqa: BLE001 - vLLM internals moved: AUTO falls back, DIRECT says why
                self._direct, self.weight_update_reason = None, f"planning failed: {type(e).__name__}: {e}"
            if self._direct is None and config.weight_update is WeightUpdate.DIRECT:
                raise RuntimeError(f"WeightUpdate.DIRECT is not possible here: {self.weight_update_reason}")
        self.weight_update_path = WeightUpdate.DIRECT if self._direct is not None else WeightUpdate.RELOAD
        # FP8 KV: vLLM's scales are 1.0 until ours arrive; INFERENCE keeps the last update's weights to calibrate
        self.kv_scales_fresh = config.kv_cache_dtype != "fp8"
        self._calibration_params: Any = None
        self._weights_valid = True  # False after a sleep that discarded them, until the next update
        self._check_names()

    def _model(self) -> Any:
        """The torch model of the in-process worker (``LLM.apply_model``; in-process, so the object)."""
        return self.llm.apply_model(lambda model: model)[0]

    def _check_names(self) -> None:
        """The table's names against the live model's weight parameters (names only: shapes may
        change in ``process_weights_after_loading``; FP8-KV ``k_scale``-style parameters are not ours)."""
        quantized = self.config.start_format is StartFormat.FP8_CHECKPOINT
        params = abstract_quantized_params(self.model_config, self.config.layer_policy if quantized else None)
        ours = {t.name for t in vllm_table(self.model_config, params)}
        theirs = {n for n, _ in self._model().named_parameters() if ".weight" in n or n.endswith("weight")}
        if ours != theirs:
            raise RuntimeError(f"vLLM's parameters differ from the table: only vLLM {sorted(theirs - ours)[:8]}, "
                               f"only ours {sorted(ours - theirs)[:8]}")

    @property
    def params(self) -> None:
        """None: vLLM holds its weights as torch tensors inside its engine, and ``update_weights``
        returns only once they are in place (it synchronizes the GPU), so there is nothing to wait on."""
        return None

    def sleep(self, weights: bool = False) -> None:
        """Frees vLLM's KV cache and weight memory until the next call that needs them: vLLM's sleep
        at ``config.sleep``'s level (1 offloads the weights to host memory; 2 discards them, and
        ``update_weights`` must come before the next ``generate``). Which weights go is the level's
        choice, fixed when vLLM started, so ``weights`` changes nothing here. A no-op with
        ``SleepLevel.OFF`` (vLLM started without its sleep-mode allocator and cannot free its pools)
        and when already asleep (``generate`` sleeps after each call when a level is set)."""
        if self.config.sleep is SleepLevel.OFF or self._asleep:
            return
        self.llm.sleep(level=self.config.sleep.value)
        self._asleep = True
        self._weights_valid = self.config.sleep is not SleepLevel.DISCARD_WEIGHTS

    def wake(self) -> None:
        """Allocates what ``sleep`` freed (weights and KV cache) again; a no-op when awake.
        ``generate`` and ``set_kv_scales`` wake vLLM themselves."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig]
                 ) -> RolloutBatch:
        """One response per prompt from vLLM (waking it first, measuring FP8 KV scales first when
        inference-side calibration finds them stale); sleeps afterwards when ``config.sleep`` is set."""
        configs = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
        if len(configs) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(configs)} sampling configs")
        params = [sampling_params(c, self.config.logprobs_mode, self.vllm.SamplingParams) for c in configs]
        if not self._weights_valid:
            raise RuntimeError("vLLM discarded its weights when it slept (SleepLevel.DISCARD_WEIGHTS): call "
                               "update_weights before generate")
        self.wake()
        self._ensure_kv_scales(prompts)
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params, use_tqdm=False)
        self.sleep()  # with a sleep level: free vLLM's memory for the trainer until the next call
        return rollout_batch(outs, self.config.max_model_len, [len(p) for p in prompts])

    def update_weights(self, params: Any, via: WeightUpdate | None = None) -> None:
        """Quantizes (FP8_CHECKPOINT) and puts the weights into vLLM (module docstring, Weights);
        ``via`` forces RELOAD (or DIRECT, where its plan exists) for this call: tests, benchmarks."""
        if via is WeightUpdate.DIRECT and self._direct is None:
            raise RuntimeError(f"WeightUpdate.DIRECT is not possible here: {self.weight_update_reason}")
        direct = self._direct is not None and via is not WeightUpdate.RELOAD
        t0 = time.perf_counter()
        if self.config.kv_cache_dtype == "fp8":
            self.kv_scales_fresh = False
            if self.config.kv_calibration is KvCalibration.INFERENCE:
                self._calibration_params = params  # a reference: the next generate calibrates on them
        if self.config.start_format is StartFormat.FP8_CHECKPOINT:
            params = self._quantize(params)
        jax.block_until_ready(params)  # the torch side reads the buffers on its own stream
        t1 = time.perf_counter()
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        if direct:
            self._copy_direct(params)
        else:
            table = vllm_table(self.model_config, params)
            weights = export_checkpoint(self.model_config, table, params, convert=to_torch_tensor)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
        _torch_synchronize()  # before the JAX buffers the copies read can be freed
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self._weights_valid = True
        # seconds: our quantization (FP8_CHECKPOINT), then handing the weights to vLLM (either path)
        self.last_sync = {"quantize_s": t1 - t0, "load_s": time.perf_counter() - t1}

    def _direct_plan(self) -> tuple[list | None, str]:
        """``[(VllmTensor, live torch parameter, scale transform or None)]`` for DIRECT updates, or
        (None, why not). Checked against the live model: every table name exists, dense and code
        tensors have the table's shape (an embedding may be padded past the vocabulary), and each
        scale transform maps the table's scale shape onto the parameter's."""
        if self.config.start_format is StartFormat.BF16_ONLINE:
            return None, "BF16_ONLINE: vLLM quantizes the BF16 weights itself"
        if self.model_config.num_experts:
            return None, "MoE experts: vLLM repacks them after loading"
        import torch

        quantized = self.config.start_format is StartFormat.FP8_CHECKPOINT
        abstract = abstract_quantized_params(self.model_config, self.config.layer_policy if quantized else None)
        model = self._model()
        live, modules = dict(model.named_parameters()), dict(model.named_modules())
        plan = []
        for t in vllm_table(self.model_config, abstract):
            p = live.get(t.name)
            if p is None:
                return None, f"vLLM has no parameter {t.name}"
            transform = None
            if t.name.endswith(SCALE_SUFFIX):
                module = modules.get(t.name.rsplit(".", 1)[0])
                transform, why = scale_transform(module)
                if why:
                    return None, f"{t.name}: {why}"
                if transform is not None:
                    weight_shape = tuple(live[t.name[: -len(SCALE_SUFFIX)]].shape)
                    probe = transform(torch.ones(t.shape, dtype=torch.float32, device=p.device), weight_shape)
                    if tuple(probe.shape) != tuple(p.shape):
                        return None, f"{t.name}: the scale layout {tuple(probe.shape)} != vLLM's {tuple(p.shape)}"
                    plan.append((t, p, functools.partial(transform, weight_shape=weight_shape)))
                    continue
            padded = (t.name in ("model.embed_tokens.weight", "lm_head.weight") and p.ndim == 2
                      and p.shape[0] >= t.shape[0] and p.shape[1] == t.shape[1])  # vocabulary padding
            if tuple(p.shape) != t.shape and not padded:
                return None, f"{t.name}: vLLM's shape {tuple(p.shape)} != the table's {t.shape}"
            plan.append((t, p, None))
        return plan, ""

    def _copy_direct(self, params: Any) -> None:
        """DIRECT update (module docstring): in-place copies into vLLM's parameters."""
        import torch

        leaves = flat_leaves(params)
        with torch.no_grad():
            for t, p, transform in self._direct:
                parts = [to_torch_tensor(a) for a in source_arrays(t, leaves)]
                if transform is not None:  # FP8 scales in the kernel's layout
                    p.data.copy_(transform(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)))
                elif len(parts) == 1:
                    part = parts[0]
                    (p.data if tuple(p.shape) == tuple(part.shape) else p.data[: part.shape[0]]).copy_(part)
                else:  # fused on the output axis, at the table's offsets
                    off = 0
                    for part in parts:
                        n = part.shape[-2]
                        p.data[..., off:off + n, :].copy_(part)
                        off += n

    def set_kv_scales(self, k_scale: Any, v_scale: Any) -> None:
        """Trainer-side FP8 KV scales ([L] float32 each) into every attention layer of vLLM."""
        L = self.model_config.num_layers
        k, v = np.asarray(k_scale, np.float32), np.asarray(v_scale, np.float32)
        if k.shape != (L,) or v.shape != (L,) or not (np.all(np.isfinite(k) & (k > 0)) and np.all(np.isfinite(v) & (v > 0))):
            raise ValueError(f"KV scales must be finite, positive and of shape ({L},); got {k.shape}, {v.shape}")
        self.wake()
        layers = kv_scale_targets(self._model(), L)
        for i, attn in enumerate(layers):
            write_kv_scale(attn, float(k[i]), float(v[i]))
        self.kv_scales_fresh = True

    def _ensure_kv_scales(self, prompts: Sequence[Sequence[int]]) -> None:
        """FP8 KV: scales for this generate, or an error (module docstring, KV scales)."""
        if self.kv_scales_fresh:
            return
        if self.config.kv_calibration is KvCalibration.TRAINER or self._calibration_params is None:
            raise RuntimeError("vLLM's FP8 KV scales are stale (none since the start or the last update_weights): "
                               "with trainer-side calibration call set_kv_scales after update_weights; with "
                               "kv_calibration=INFERENCE call update_weights once after the start")
        rows = self.config.kv_calibration_prompts
        longest = max(len(p) for p in prompts[:rows])
        tokens, lengths = calibration_batch(prompts, rows, max(16, 1 << (longest - 1).bit_length()))  # few shapes
        k, v = calibrate_kv_scales_jit(self._calibration_params, jax.numpy.asarray(tokens), jax.numpy.asarray(lengths),
                                       config=self.model_config, policy=DensePolicy("bfloat16"))
        self.set_kv_scales(k, v)

    def read_kv_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """The K and V scales ([L] float32 each) vLLM's attention layers hold now (device buffers)."""
        layers = kv_scale_targets(self._model(), self.model_config.num_layers)
        return (np.array([float(a._k_scale.reshape(-1)[0]) for a in layers], np.float32),
                np.array([float(a._v_scale.reshape(-1)[0]) for a in layers], np.float32))


def _torch_synchronize() -> None:
    """Waits for vLLM's work on the GPU (the reload's copies run on torch's stream)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def scale_transform(module: Any) -> tuple[Any, str]:
    """For a block-FP8 linear of vLLM 0.26: (the function that turns our fused [rows, cols] float32
    scales into the layout its kernel keeps, or None if it keeps ours; "" ) or (None, why DIRECT
    cannot write it). The function takes the scales and the weight's shape."""
    method = getattr(module, "quant_method", None)
    kernel = getattr(method, "fp8_linear", None)
    if kernel is None:
        return None, f"no block-FP8 kernel on {type(module).__name__} ({type(method).__name__})"
    names = {c.__name__ for c in type(kernel).__mro__}
    if type(kernel).__name__ == "DeepGemmFp8BlockScaledMMKernel":
        if getattr(kernel, "use_deep_gemm_e8m0", True):
            return None, "DeepGEMM with E8M0 scales requantizes the weights (set VLLM_USE_DEEP_GEMM_E8M0=0)"
        from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_weight_scale_block

        block = tuple(module.weight_block_size)

        def deepgemm(ws, weight_shape):  # deepgemm_post_process_fp8_weight_block, 2-D weight, E8M0 off
            return deepgemm_post_process_weight_scale_block(
                ws=ws.unsqueeze(0), mn=weight_shape[0], k=weight_shape[1], quant_block_shape=block,
                num_groups=1).squeeze(0)

        return deepgemm, ""
    base = "Fp8BlockScaledMMLinearKernel"
    if base in names and _inherits_process(type(kernel), base):
        return None, ""  # process_fp8_weight_block_strategy: the identity on CUDA
    return None, f"kernel {type(kernel).__name__}: its scale layout is not known here"


def _inherits_process(cls: type, base: str) -> bool:
    """Whether ``cls`` takes ``process_weights_after_loading`` from the class named ``base``."""
    for c in cls.__mro__:
        if "process_weights_after_loading" in c.__dict__:
            return c.__name__ == base
    return False


def kv_scale_targets(model: Any, num_layers: int) -> list[Any]:
    """The attention modules ``model.layers.i.self_attn.attn`` in layer order."""
    mods = dict(model.named_modules())
    try:
        return [mods[f"model.layers.{i}.self_attn.attn"] for i in range(num_layers)]
    except KeyError as e:
        raise RuntimeError(f"vLLM model has no attention module {e}; vLLM {SUPPORTED_VLLM} layout expected") from None


def write_kv_scale(attn: Any, k: float, v: float) -> None:
    """Writes one layer's K/V dequant scales where vLLM 0.26's attention reads them: the device
    buffers ``_k_scale``/``_v_scale`` (in place: CUDA graphs hold them), the host floats and the
    ``_k_scale_cpu``/``_v_scale_cpu`` tensors (``layers/attention/attention.py``)."""
    attn._k_scale.fill_(k)
    attn._v_scale.fill_(v)
    attn._k_scale_float, attn._v_scale_float = k, v
    if hasattr(attn, "_k_scale_cpu"):
        attn._k_scale_cpu.fill_(k)
        attn._v_scale_cpu.fill_(v)
    attn.calculate_kv_scales = False  # never overwrite them from a batch
