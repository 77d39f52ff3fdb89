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
GPU) -> ``vllm_names.export_checkpoint`` with ``to_torch_tensor`` (zero-copy DLPack views, per-expert
slices are torch views) -> ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` on the
in-process worker. That is vLLM 0.26's in-place reload (``v1/worker/gpu_model_runner.py``,
``model_executor/model_loader/reload/layerwise.py``): each layer is restored to its checkpoint
layout, loaded through the model's own ``load_weights`` (which fuses q/k/v, gate/up and the experts
at the offsets ``vllm_table`` states), then its ``process_weights_after_loading`` is redone (the
scale layout of the GEMM kernel, DeepGEMM/CUTLASS repacking) and copied into the original storage,
so captured CUDA graphs stay valid. BF16 and BF16_ONLINE send the BF16 weights (BF16_ONLINE: vLLM
requantizes them).

KV scales: ``set_kv_scales(k, v)`` writes our per-layer scales (``calibrate_kv_scales``: dequant
multipliers, ``x ~= q * s``, the convention of vLLM's ``_k_scale``) into every attention layer's
``_k_scale``/``_v_scale`` (+ the ``*_float`` and ``*_cpu`` copies some backends read).

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
import importlib
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.quant.policy import LayerPolicy, quantize_params
from fp8rl_jax.rollout.base import FinishReason, RolloutBatch
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.rollout.vllm_names import export_checkpoint, to_torch_tensor, vllm_table

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
        }
        if self.start_format is StartFormat.BF16_ONLINE:
            kw["quantization"] = "fp8_per_block"
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
    """A ``Generator`` backed by vLLM 0.26 in this process (GPU only)."""

    def __init__(self, model_config: ModelConfig, config: VLLMConfig):
        _set_required_env()
        check_jax_memory_fraction(config)
        self.vllm = import_vllm()
        self.model_config = model_config
        self.config = config
        self.llm = self.vllm.LLM(**config.llm_kwargs())
        self._asleep = False
        self._check_names()

    def _model(self) -> Any:
        """The torch model of the in-process worker (``LLM.apply_model``; in-process, so the object)."""
        return self.llm.apply_model(lambda model: model)[0]

    def _check_names(self) -> None:
        """The table's names against the live model's weight parameters (names only: shapes may
        change in ``process_weights_after_loading``; FP8-KV ``k_scale``-style parameters are not ours)."""
        quantized = self.config.start_format is StartFormat.FP8_CHECKPOINT
        from fp8rl_jax.rollout.vllm_names import abstract_quantized_params

        params = abstract_quantized_params(self.model_config, self.config.layer_policy if quantized else None)
        ours = {t.name for t in vllm_table(self.model_config, params)}
        theirs = {n for n, _ in self._model().named_parameters() if ".weight" in n or n.endswith("weight")}
        if ours != theirs:
            raise RuntimeError(f"vLLM's parameters differ from the table: only vLLM {sorted(theirs - ours)[:8]}, "
                               f"only ours {sorted(ours - theirs)[:8]}")

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig]
                 ) -> RolloutBatch:
        configs = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
        if len(configs) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(configs)} sampling configs")
        params = [sampling_params(c, self.config.logprobs_mode, self.vllm.SamplingParams) for c in configs]
        self._wake()
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params, use_tqdm=False)
        if self.config.sleep is not SleepLevel.OFF:
            self.llm.sleep(level=self.config.sleep.value)
            self._asleep = True
        return rollout_batch(outs, self.config.max_model_len, [len(p) for p in prompts])

    def update_weights(self, params: Any) -> None:
        """Quantizes (FP8_CHECKPOINT) and streams the weights into vLLM (module docstring)."""
        if self.config.start_format is StartFormat.FP8_CHECKPOINT:
            params = quantize_params(params, self.model_config, self.config.layer_policy)
        table = vllm_table(self.model_config, params)
        jax.block_until_ready(params)  # the torch side reads the buffers on its own stream
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        weights = export_checkpoint(self.model_config, table, params, convert=to_torch_tensor)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def set_kv_scales(self, k_scale: Any, v_scale: Any) -> None:
        """Trainer-side FP8 KV scales ([L] float32 each) into every attention layer of vLLM."""
        L = self.model_config.num_layers
        k, v = np.asarray(k_scale, np.float32), np.asarray(v_scale, np.float32)
        if k.shape != (L,) or v.shape != (L,) or not (np.all(np.isfinite(k) & (k > 0)) and np.all(np.isfinite(v) & (v > 0))):
            raise ValueError(f"KV scales must be finite, positive and of shape ({L},); got {k.shape}, {v.shape}")
        self._wake()
        layers = kv_scale_targets(self._model(), L)
        for i, attn in enumerate(layers):
            write_kv_scale(attn, float(k[i]), float(v[i]))


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
