"""Rollout throughput per precision mode: the JAX engine, or (``--backend vllm``) vLLM on the same workload.

Random weights of the chosen shape are built on the device (no download). For each precision mode
(none, w8a8, kv, all) the engine generates the workload and the row records output tokens/s, the
sequences the KV pool holds, preemptions, the weight sync (``update_weights``: re-quantization and
swap, median of ``--sync-repeats``; the `weight_sync` suite times it alone) and the decode step
against the HBM roofline (weight bytes + KV bytes read per step over the device's measured copy
bandwidth, `experiments.bench.ceiling`). With ``--repeats N`` the workload is generated N times on
the warm engine and the median run is the row (runs after the first skip the per-update KV-scale
calibration of FP8 KV modes).

Workloads (those vLLM is compared on):
  W1: 256 prompts of 1024 random ids -> 2048 new tokens each (temperature 1.0, EOS ignored);
  W2: 128 x 1024 -> 6144;
  RL: 256 x 512 -> lengths spread uniformly up to 8192 (max_tokens per request);
  tiny: 6 x 12 -> up to 16 (the CPU smoke run).

    python -m experiments.bench rollout --preset qwen3_8b --workload W1 --modes none all
    python -m experiments.bench rollout --backend vllm --preset qwen3_8b --workload W1 --modes none all

``--kv-gib-like-vllm BF16 FP8`` sizes each mode's KV pool as vLLM's ``gpu_memory_utilization`` left it
beside weights of that precision on the same GPU, and frees the BF16 copy where the engine keeps its
own, as vLLM's standalone engine holds only its weights. Decode attention runs the Pallas
paged-attention kernel on the GPU, prefill attention the Pallas prefill kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import gc
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import PRESETS
from experiments.bench.ceiling import ceiling_record, hbm_copy_bps
from fp8rl_jax.checkpoint import save_checkpoint
from fp8rl_jax.environment import GpuMonitor, enable_compilation_cache
from fp8rl_jax.models import Fp8Mode, ModelConfig, init_params
from fp8rl_jax.models.calibration import calibrate_kv_scales_jit
from fp8rl_jax.models.policy import DensePolicy
from fp8rl_jax.quant.policy import GemmBackend, describe_cublaslt_algos, quantize_params
from fp8rl_jax.rl.memory import GIB, check_fits, device_bytes_limit, generator_weight_bytes, kv_page_bytes
from fp8rl_jax.rollout import vllm_backend as vb
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.rollout.sampling import Draw, SamplingConfig
from fp8rl_jax.rollout.watchdog import StallWatchdog
from pallas_kernels import paged_attention as paged_kernel


class Backend(enum.Enum):
    """Which generator runs the workload."""

    JAX = "jax"  # our JaxEngine
    VLLM = "vllm"  # VLLMGenerator (vLLM 0.26 in this process; GPU and the fp8rl_jax[vllm] extra)


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int
    prompt_len: int
    max_new: int
    spread: bool = False  # RL-shaped: max_tokens uniform in [max_new / 16, max_new]


WORKLOADS = {
    "W1": Workload(256, 1024, 2048),
    "W2": Workload(128, 1024, 6144),
    "RL": Workload(256, 512, 8192, spread=True),
    "tiny": Workload(6, 12, 16, spread=True),
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: ModelConfig = PRESETS["qwen3_8b"]
    workload: Workload = WORKLOADS["W1"]
    modes: tuple[Fp8Mode, ...] = (Fp8Mode.NONE, Fp8Mode.W8A8, Fp8Mode.KV, Fp8Mode.ALL)
    engine: EngineConfig = EngineConfig(max_slots=256, page_size=16, kv_budget_gib=60.0, max_seq_len=8192 + 1024,
                                        steps_per_call=16, prefill_batch=8, dtype="bfloat16")
    backend: Backend = Backend.JAX
    vllm: vb.VLLMConfig | None = None  # the vllm backend's config template (model_path is filled in)
    workdir: Path = Path("runs/rollout")  # where the vllm backend writes its checkpoints
    seed: int = 0
    # (beside BF16 weights, beside FP8 weights): the KV pool in GiB per mode, as vLLM's
    # gpu_memory_utilization left it on the same GPU, with the BF16 copy freed in FP8 weight modes
    # (vLLM's benchmark holds no trainer copy); None: ``engine``'s budget, BF16 copy kept
    kv_gib_like_vllm: tuple[float, float] | None = None
    sync_repeats: int = 5  # weight syncs timed per mode (the median is reported)
    repeats: int = 1  # timed generates of the workload per mode on the warm engine (the median run is reported)
    stall_dump_s: float = 0.0  # > 0: no progress for this long -> last progress, thread stacks, exit 3
    # vllm backend: more workloads run by the same vLLM engine after ``workload`` (one start per mode:
    # its start, torch.compile and CUDA-graph capture, takes minutes for Qwen3-8B), as (name, workload)
    also_workloads: tuple[tuple[str, Workload], ...] = ()


def _requests(w: Workload, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(2, vocab, (w.prompts, w.prompt_len)).tolist()
    lengths = (rng.integers(max(1, w.max_new // 16), w.max_new + 1, w.prompts) if w.spread
               else np.full(w.prompts, w.max_new))
    sampling = [SamplingConfig(temperature=1.0, max_tokens=int(n), ignore_eos=True, seed=seed + i)
                for i, n in enumerate(lengths)]
    return prompts, sampling


def _param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def _memory() -> dict:
    """Device memory in use and its peak so far (GB), where the backend reports them."""
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    return {k: round(stats[k] / 1e9, 2) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


PROGRESS_EVERY_S = 15.0  # seconds between progress lines (module constant: tests lower it)


WATCH: StallWatchdog | None = None  # armed by main (stall_dump_s) once the weights compiled: warm-up and the runs


def _beat(info: Any) -> None:
    if WATCH is not None:
        WATCH.beat(info)


def _progress_reporter(mode: Fp8Mode, t0: float) -> Any:
    """An ``engine.progress`` hook: every ``PROGRESS_EVERY_S`` prints the run so far (tokens/s,
    decode step) as a JSON line, so a run cut by a time limit still leaves its steady-state
    throughput in its log."""
    last = [t0]

    def report(p: dict) -> None:
        _beat(p)
        now = time.perf_counter()
        if now - last[0] < PROGRESS_EVERY_S:
            return
        last[0] = now
        steps = max(p["decode_steps"], 1)
        row = {"mode": mode.value, "partial": True, "elapsed_s": now - t0, "generated_tokens": p["generated_tokens"],
               "tokens_per_s_so_far": p["generated_tokens"] / (now - t0), "finished": p["finished"],
               "requests": p["requests"], "preemptions": p["preemptions"], "queued": p["queued"],
               "decode_step_ms_so_far": p["decode_s"] / steps * 1e3,
               "decode_batch_mean_so_far": p["decode_slot_steps"] / steps, "prefill_s": p["prefill_s"],
               "decode_s": p["decode_s"]}
        print(json.dumps(row), flush=True)

    return report


def _engine_config(cfg: BenchConfig, mode: Fp8Mode) -> EngineConfig:
    ec = dataclasses.replace(cfg.engine, precision=mode)
    if cfg.kv_gib_like_vllm is not None:  # vLLM's KV pool beside weights of this precision
        gib = cfg.kv_gib_like_vllm[mode.fp8_weights]
        ec = dataclasses.replace(ec, kv_budget_gib=gib, kv_budget_fraction=0.0, num_pages=0)
    return ec


def run_mode(cfg: BenchConfig, make_params: Callable[[], Any], mode: Fp8Mode) -> dict:
    """One mode: the engine is built without its KV pool, the weight sync (``update_weights``) is
    timed, then (``kv_gib_like_vllm``, modes whose engine keeps its own copy: FP8 weights, or BF16
    in the fused layout) the BF16 copy the sync read is freed, as
    vLLM's standalone benchmark holds only its own weights; then the pool is allocated, every
    program compiled (``warmup``) and the workload generated."""
    _beat(f"{mode.value}: engine init")
    phases = {}  # seconds per setup phase before the warm-up (a 30B-A3B engine spends minutes here)
    t_phase = time.perf_counter()

    def phase(name):
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = round(now - t_phase, 2)
        t_phase = now

    params = jax.block_until_ready(make_params())
    phase("params")
    engine = JaxEngine(cfg.model, params, _engine_config(cfg, mode), asleep=True)  # compiles the quantization
    jax.block_until_ready(engine.params)
    phase("engine")
    _beat(f"{mode.value}: engine ready")
    syncs = []
    for _ in range(max(cfg.sync_repeats, 1)):
        t0 = time.perf_counter()
        engine.update_weights(params)
        jax.block_until_ready(engine.params)
        syncs.append((time.perf_counter() - t0) * 1e3)
    sync_ms = float(np.median(syncs))
    phase("weight_syncs")
    standalone = cfg.kv_gib_like_vllm is not None and engine.params is not params
    if standalone:
        del params  # the engine holds its own (FP8 or fused) copy only
        gc.collect()
    engine.wake()
    phase("kv_pool")
    print(f"[{mode.value}] setup (s): {phases}", flush=True)
    print(f"[{mode.value}] memory with the KV pool ({engine.kv_pool_bytes / 2**30:.2f} GiB) (GB): {_memory()}",
          flush=True)
    prompts, sampling = _requests(cfg.workload, cfg.model.vocab_size, cfg.seed)
    # compile every prefill bucket a recompute after preemption can reach, the decode loop and the
    # KV calibration before the clock starts (JaxEngine.warmup writes nothing)
    lens = [len(p) for p in prompts]
    compile_s = engine.warmup(min_prompt_len=min(lens), max_prompt_len=max(lens),
                              progress=lambda what, s: (_beat(what), print(f"[{mode.value}]   {what}: {s:.1f} s",
                                                                           flush=True)),
                              recompute=engine.sequences_that_fit < len(prompts))  # else nothing is preempted
    print(f"[{mode.value}] warm-up (compiles) {compile_s:.1f} s", flush=True)
    runs = []
    for i in range(max(cfg.repeats, 1)):  # the same workload again on the warm engine
        runs.append(_measure(cfg, engine, mode, prompts, sampling))
        if cfg.repeats > 1:
            print(f"[{mode.value}] run {i + 1}/{cfg.repeats}: {runs[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    # the median run's row (by tokens/s), with every run's tokens/s
    row = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    row.update({"weight_sync_ms": sync_ms,  # median of sync_repeats
                "weight_sync_ms_all": syncs,
                "warmup_compile_s": compile_s,
                "swap_reserve_s": engine.swap_reserve_s,  # host memory pinned for swap preemption, in warm-up
                "setup_s": phases,
                "kv_pages": engine.num_pages,
                "kv_pool_gib": engine.kv_pool_bytes / 2**30,
                "bf16_copy_freed": standalone,
                "fused_projections": engine.fused,  # q/k/v and gate/up as one GEMM each (EngineConfig.fuse_projections)
                "fused_cast": engine.config.fused_cast,  # BF16 GEMMs write BF16 (EngineConfig.fused_cast)
                "sampling_draw": engine.config.sampling_draw.value,  # EngineConfig.sampling_draw
                # the decode attention's table and config for this mode's pool dtype (on a GPU)
                "paged_attention": paged_kernel.describe_config(engine.kv_dtype),
                "fp8_gemm": cfg.engine.fp8_gemm.describe() if mode.fp8_weights else None,  # Mosaic, cuBLASLt or per shape
                "cublaslt_algos": describe_cublaslt_algos() if mode.fp8_weights else None,
                "full_length_sequences_that_fit": engine.sequences_that_fit,
                "repeats": len(runs),
                "tokens_per_s_all": [r["tokens_per_s"] for r in runs],
                "memory_gb": _memory()})
    return row


def _measure(cfg: BenchConfig, engine: JaxEngine, mode: Fp8Mode, prompts, sampling) -> dict:
    """One timed generate of the workload on the warm engine: throughput, step time and roofline."""
    t0 = time.perf_counter()
    engine.progress = _progress_reporter(mode, t0)
    with GpuMonitor() as gpu:  # clocks, power and throttle reasons along the run (None off a GPU)
        batch = engine.generate(prompts, sampling)
    engine.progress = None
    wall = time.perf_counter() - t0
    gpu_summary = gpu.summary()
    generated = int(batch.lengths.sum())
    m = cfg.model
    kv_token_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * engine.kv_dtype.itemsize
    mean_ctx = cfg.workload.prompt_len + float(batch.lengths.mean()) / 2
    slots = min(cfg.engine.max_slots, engine.num_pages * cfg.engine.page_size // int(mean_ctx + 1))
    step_bytes = _param_bytes(engine.params) + slots * mean_ctx * kv_token_bytes
    st = engine.stats
    steps = max(st["decode_steps"], 1)
    step_s = st["decode_s"] / steps
    measured_step_bytes = _param_bytes(engine.params) + st["decode_kv_tokens"] / steps * kv_token_bytes
    return {
        "mode": mode.value,
        "generated_tokens": generated,
        "decode_step_ms": step_s * 1e3,
        "decode_batch_mean": st["decode_slot_steps"] / steps,
        "decode_s": st["decode_s"],
        "prefill_s": st["prefill_s"],
        "prefill_tokens": st["prefill_tokens"],
        # weights + the KV actually read per decode step, over the measured step time (host
        # round trips included: one per steps_per_call)
        "decode_bytes_per_step": measured_step_bytes,
        "decode_hbm_fraction": measured_step_bytes / max(step_s, 1e-12) / hbm_copy_bps(),
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "preemptions": batch.preemptions,
        "roofline_step_ms_at_mean_context": step_bytes / hbm_copy_bps() * 1e3,
        "roofline_tokens_per_s": slots / (step_bytes / hbm_copy_bps()),
        # every decode call in order: [ms per step, rows, mean context of a row at its start, host ms before its
        # launch, rows the program ran (its decode bucket); JaxEngine.decode_log], to set the step time along the
        # run beside a profile of the same state (the decode suite with --lengths equal --pages engine) and the host's
        # time per call beside the device's
        "decode_calls": [[round(s_ / cfg.engine.steps_per_call * 1e3, 3), n, round(c / max(n, 1), 1), round(h * 1e3, 2),
                          R] for s_, n, c, h, R in engine.decode_log],
        "decode_buckets": list(cfg.engine.decode_rows),
        "decode_rows_mean": st["decode_row_steps"] / steps,
        "slot_moves": st["slot_moves"],
        # swap preemption (EngineConfig.swap_space_gib): sequences whose KV went to host memory and came back,
        # and the tokens they did not recompute
        "swap_outs": st["swap_outs"], "swap_ins": st["swap_ins"], "swapped_tokens": st["swapped_tokens"],
        "gpu_during_run": gpu_summary,
        # generated tokens per joule of board energy (the run's mean power): what a mode buys where the run holds
        # the power cap, as W1 on the H200 does, so machines' clocks matter less
        "tokens_per_joule": tokens_per_joule(generated / wall, gpu_summary),
    }


def run_mode_vllm(cfg: BenchConfig, params, mode: Fp8Mode, workdir: Path) -> list[dict]:
    """The same workload on ``VLLMGenerator`` (vLLM 0.26 in this process): W8A8 modes start from our
    block-FP8 checkpoint of the same random weights, the others from BF16; FP8 KV modes get
    ``kv_cache_dtype="fp8"`` with our trainer-side KV scales. The weight sync is ``update_weights``
    (our quantization + DLPack + vLLM's in-place reload), median of ``sync_repeats``. One row per
    workload (``workload``, then ``also_workloads``, on the same engine)."""
    w8, kv = mode.fp8_weights, mode.fp8_kv
    folder = workdir / ("fp8" if w8 else "bf16")
    if not (folder / "config.json").exists():
        save_checkpoint(folder, jax.jit(quantize_params, static_argnums=1)(params, cfg.model) if w8 else params,
                        cfg.model)
    workloads = ((_workload_name(cfg.workload), cfg.workload),) + tuple(cfg.also_workloads)
    vcfg = dataclasses.replace(cfg.vllm, model_path=str(folder), kv_cache_dtype="fp8" if kv else "auto",
                               start_format=vb.StartFormat.FP8_CHECKPOINT if w8 else vb.StartFormat.BF16,
                               max_model_len=max(w.prompt_len + w.max_new for _, w in workloads))
    t0 = time.perf_counter()
    gen = vb.VLLMGenerator(cfg.model, vcfg)
    init_s = time.perf_counter() - t0
    prompts, sampling = _requests(cfg.workload, cfg.model.vocab_size, cfg.seed)
    syncs, parts, kv_ms = [], [], []
    if kv:  # trainer-side KV scales of these weights (calibrated once: the weights do not change here)
        n = min(16, len(prompts))
        toks = jnp.asarray(np.asarray(prompts[:n], np.int32)[:, :512])
        k, v = calibrate_kv_scales_jit(
            params, toks, jnp.full((n,), toks.shape[1], jnp.int32), config=cfg.model,
            policy=DensePolicy(cfg.engine.dtype))
    for _ in range(max(1, cfg.sync_repeats) + 1):  # the first compiles the quantizer: not counted
        t0 = time.perf_counter()
        gen.update_weights(params)
        syncs.append((time.perf_counter() - t0) * 1e3)
        parts.append(dict(gen.last_sync))
        if kv:
            t0 = time.perf_counter()
            gen.set_kv_scales(k, v)
            kv_ms.append((time.perf_counter() - t0) * 1e3)
    # warm-up (after a sync: FP8 KV scales must be set before a generate)
    gen.generate(prompts[: min(4, len(prompts))], [dataclasses.replace(s, max_tokens=4) for s in sampling[:4]])
    rows = []
    for name, w in workloads:
        prompts, sampling = _requests(w, cfg.model.vocab_size, cfg.seed)
        t0 = time.perf_counter()
        batch = gen.generate(prompts, sampling)
        wall = time.perf_counter() - t0
        generated = int(batch.lengths.sum())
        rows.append({"mode": mode.value, "backend": "vllm", "workload": name, "generated_tokens": generated,
                     "wall_s": wall, "tokens_per_s": generated / wall, "weight_sync_ms": float(np.median(syncs[1:])),
                     "weight_sync_runs_ms": syncs, "weight_sync_parts_s": parts[1:], "vllm_init_s": init_s,
                     "weight_update_path": gen.weight_update_path.value,
                     "set_kv_scales_ms": float(np.median(kv_ms[1:])) if kv else None,
                     "preemptions": batch.preemptions,
                     "vllm": {"gpu_memory_utilization": vcfg.gpu_memory_utilization,
                              "kv_cache_dtype": vcfg.kv_cache_dtype, "start_format": vcfg.start_format.value,
                              "cudagraph_capture_sizes": vcfg.cudagraph_capture_sizes}})
        print(json.dumps(rows[-1]), flush=True)
    del gen  # run one vLLM mode per process where memory is tight: vLLM frees its pools lazily
    gc.collect()
    return rows


def _workload_name(w: Workload) -> str:
    return next((k for k, v in WORKLOADS.items() if v == w), "custom")


def tokens_per_joule(tokens_per_s: float, gpu: dict | None) -> float | None:
    """Tokens per joule from a run's `GpuMonitor` summary (its mean board power), None without power samples."""
    watts = ((gpu or {}).get("power_w") or {}).get("mean")
    return tokens_per_s / watts if watts else None


def clocks_cell(gpu: dict | None) -> str:
    """The table's clock column from a run's `GpuMonitor` summary: the SM clock's median and the share of samples
    the power cap was throttling."""
    if not gpu or not gpu.get("sm_clock_mhz"):
        return "n/a"
    capped = (gpu.get("clock_event_reasons") or {}).get("sw_power_cap", 0.0)
    return f"{gpu['sm_clock_mhz']['median']:.0f} ({capped:.0%})"


def check_memory(cfg: BenchConfig, limit: int | None = None) -> None:
    """Before anything is allocated (JAX backend): a ``ValueError`` (one line) when a mode's BF16 weights, the
    engine's own copy (FP8, or fused on one device) and its KV pool exceed ``limit`` bytes (default: the device's
    allocator limit; none on the CPU). A pool sized by ``kv_budget_fraction`` sizes itself and is not counted."""
    limit = device_bytes_limit() if limit is None else limit
    if cfg.backend is not Backend.JAX:
        return
    bf16 = generator_weight_bytes(cfg.model, False, jnp.bfloat16)
    for mode in cfg.modes:
        ec = _engine_config(cfg, mode)
        fused = ec.fuse_projections is not False
        copy = generator_weight_bytes(cfg.model, True, jnp.bfloat16, ec.fp8_block) if mode.fp8_weights else \
            bf16 if fused else 0
        page = kv_page_bytes(cfg.model, ec.page_size, mode.fp8_kv, ec.dtype)
        pages = ec.num_pages or (0 if ec.kv_budget_fraction else int(ec.kv_budget_gib * GIB // page))
        weights = 0 if cfg.kv_gib_like_vllm is not None and copy else bf16  # freed before the pool (run_mode)
        check_fits({"BF16 weights": weights, "engine weight copy": copy, "KV pool": pages * page}, limit,
                   what=f"rollout ({mode.value})",
                   fixes={"KV pool": "lower --kv-gib (or --kv-tokens, --kv-gib-like-vllm), or use --kv-fraction",
                          "BF16 weights": "fewer --layers or a smaller --preset",
                          "engine weight copy": "fewer --layers or a smaller --preset"})


def measure(cfg: BenchConfig) -> dict:
    """Runs every mode of ``cfg`` and returns the payload: the configuration and one row per mode (and workload)."""
    global WATCH
    check_memory(cfg)
    key = jax.random.key(cfg.seed)
    # the JAX backend builds the weights per mode (the same ones: same key), so a mode can free them; init_params
    # compiles each distinct leaf shape once, so the second mode's init reuses the first's programs
    def init(k):
        t0 = time.perf_counter()
        p = jax.block_until_ready(init_params(cfg.model, k, jnp.bfloat16))
        print(f"random init in {time.perf_counter() - t0:.1f} s", flush=True)
        return p

    params = init(key) if cfg.backend is Backend.VLLM else None
    if cfg.stall_dump_s > 0:  # not before: a slow host/compile before the first mode is not a stall
        WATCH = StallWatchdog(cfg.stall_dump_s, name="rollout")
    results = {
        **ceiling_record(),
        "model": dataclasses.asdict(cfg.model),
        "workload": dataclasses.asdict(cfg.workload),
        "engine": {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(cfg.engine).items()},
        "backend": cfg.backend.value,
        "kv_gib_like_vllm": cfg.kv_gib_like_vllm,
        "runs": [],
    }
    for mode in cfg.modes:
        gc.collect()  # the previous mode's engine (and its KV pool) must be gone before the next one allocates
        if cfg.backend is Backend.JAX:
            row = run_mode(cfg, lambda: init(key), mode)
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
        else:
            results["runs"].extend(run_mode_vllm(cfg, params, mode, cfg.workdir))

    def base(r):  # none's tokens/s on the same workload
        return next((b["tokens_per_s"] for b in results["runs"]
                     if b["mode"] == "none" and b.get("workload") == r.get("workload")), None)

    print("\n| mode | tokens/s | vs none | preemptions | weight sync ms | decode step ms (batch) | of HBM roofline "
          "| SM MHz median (power-capped) | tokens/J |\n|---|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        ratio = f"{r['tokens_per_s'] / base(r):.2f}x" if base(r) else "n/a"
        step = (f"{r['decode_step_ms']:.2f} ({r['decode_batch_mean']:.0f}) | {r['decode_hbm_fraction']:.0%}"
                if "decode_step_ms" in r else "n/a | n/a")
        name = r["mode"] + (f" ({r['workload']})" if "workload" in r else "")
        tpj = f"{r['tokens_per_joule']:.2f}" if r.get("tokens_per_joule") else "n/a"
        print(f"| {name} | {r['tokens_per_s']:.0f} | {ratio} | {r['preemptions']} | {r['weight_sync_ms']:.1f} | {step} "
              f"| {clocks_cell(r.get('gpu_during_run'))} | {tpj} |")
    return results


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_8b")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    ap.add_argument("--modes", nargs="*", choices=[m.value for m in Fp8Mode], default=[m.value for m in Fp8Mode])
    ap.add_argument("--kv-gib", type=float, default=BenchConfig.engine.kv_budget_gib)
    ap.add_argument("--kv-fraction", type=float, default=0.0,
                    help="KV pool = this fraction of the device memory left after the weights (overrides --kv-gib)")
    ap.add_argument("--kv-tokens", type=int, default=0,
                    help="KV pool of exactly this many tokens (overrides --kv-gib/--kv-fraction): e.g. the KV "
                         "capacity vLLM reports at gpu_memory_utilization 0.85, so both engines run a workload "
                         "under the same KV budget")
    ap.add_argument("--kv-gib-like-vllm", type=float, nargs=2, default=None, metavar=("BF16_WEIGHTS", "FP8_WEIGHTS"),
                    help="the KV pool in GiB that vLLM's gpu_memory_utilization leaves beside BF16 and beside FP8 "
                         "weights on the same GPU (its log: 'Available KV cache memory'), per mode by weight "
                         "precision; modes whose engine keeps its own copy free the BF16 copy after the sync is "
                         "timed, as vLLM holds only its own weights (overrides --kv-gib/--kv-fraction/--kv-tokens)")
    ap.add_argument("--repeats", type=int, default=BenchConfig.repeats,
                    help="timed generates of the workload per mode after one warm-up (JAX backend); the median run "
                         "(by tokens/s) is the row, every run's tokens/s is kept")
    ap.add_argument("--sync-repeats", type=int, default=BenchConfig.sync_repeats,
                    help="weight syncs (update_weights) timed per mode; the median is reported")
    ap.add_argument("--fuse-projections", choices=["auto", "on", "off"], default="auto",
                    help="q/k/v and gate/up as one GEMM each (EngineConfig.fuse_projections; auto: on, on one device)")
    ap.add_argument("--fused-cast", choices=["on", "off"], default="on",
                    help="EngineConfig.fused_cast: the BF16 GEMMs write BF16 themselves (off: float32 + a convert)")
    ap.add_argument("--draw", choices=[d.value for d in Draw], default=Draw.INVERSE_CDF.value,
                    help="EngineConfig.sampling_draw: Gumbel-max (V random numbers per row) or the inverse CDF (one)")
    ap.add_argument("--fp8-gemm", choices=[b.value for b in GemmBackend], default="auto",
                    help="the dense FP8 GEMM of the w8a8/all modes (EngineConfig.fp8_gemm): our Mosaic kernel or "
                         "cuBLASLt's block-scaled FP8; auto: FP8RL_FP8_GEMM, else the measured per-shape table, else mosaic")
    ap.add_argument("--no-overlap-host", action="store_true",
                    help="the synchronous host loop (EngineConfig.overlap_host=False), to measure what overlap saves")
    ap.add_argument("--max-slots", type=int, default=BenchConfig.engine.max_slots)
    ap.add_argument("--decode-buckets", type=int, nargs="*", default=None,
                    help="EngineConfig.decode_buckets, the row counts a decode call may run (default: powers of two "
                         "from 16); give --max-slots alone to decode every slot in every call")
    ap.add_argument("--swap-space-gib", type=float, default=BenchConfig.engine.swap_space_gib,
                    help="EngineConfig.swap_space_gib: host memory for preempted sequences' KV (0: recompute them)")
    ap.add_argument("--steps-per-call", type=int, default=BenchConfig.engine.steps_per_call)
    ap.add_argument("--prefill-batch", type=int, default=BenchConfig.engine.prefill_batch)
    ap.add_argument("--prompts", type=int, default=0, help="use only the first N prompts of the workload (0: all)")
    ap.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.JAX.value,
                    help="vllm: the same workloads on VLLMGenerator (needs the fp8rl_jax[vllm] extra and a GPU)")
    ap.add_argument("--vllm-memory", type=float, default=0.6, help="vLLM's gpu_memory_utilization (vllm backend)")
    ap.add_argument("--jax-memory", type=float, default=0.3, help="JAX's memory fraction next to vLLM (vllm backend)")
    ap.add_argument("--also-workloads", nargs="*", choices=sorted(WORKLOADS), default=[],
                    help="vllm backend: more workloads on the same vLLM engine after --workload (one start per mode)")
    ap.add_argument("--vllm-graph-sizes", type=int, nargs="*",
                    default=[1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256],
                    help="vllm backend: decode batch sizes vLLM captures CUDA graphs for (none given: vLLM's "
                         "default 51 sizes, minutes more of its start)")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers of the preset (quick checks)")
    ap.add_argument("--stall-dump-s", type=float, default=0.0,
                    help="when nothing progresses (warm-up program, prefill group, decode chunk) for this many "
                         "seconds, print the last progress and every thread's Python stack, and exit 3")
    ap.add_argument("--workdir", type=Path, default=BenchConfig.workdir,
                    help="vllm backend: where the checkpoints vLLM starts from are written")


def config(a: argparse.Namespace) -> BenchConfig:
    """The `BenchConfig` of the command line ``a``."""
    vllm_cfg = None
    if Backend(a.backend) is Backend.VLLM:
        vllm_cfg = vb.VLLMConfig(model_path="", gpu_memory_utilization=a.vllm_memory, jax_memory_fraction=a.jax_memory,
                                 cudagraph_capture_sizes=tuple(a.vllm_graph_sizes) or None)
    w = WORKLOADS[a.workload]
    if a.prompts:
        w = dataclasses.replace(w, prompts=min(a.prompts, w.prompts))
    # max_seq_len = what the workload needs, so prefill attention spans no more pages than it must
    sizing = dict(max_seq_len=w.prompt_len + w.max_new, steps_per_call=a.steps_per_call, prefill_batch=a.prefill_batch)
    kv_gib = a.kv_gib
    if a.workload == "tiny":
        sizing.update(max_seq_len=32, steps_per_call=4, dtype="float32")
        if kv_gib == BenchConfig.engine.kv_budget_gib:  # the GPU default would not fit a CPU machine
            kv_gib = 0.01
    if a.kv_tokens:
        sizing["num_pages"] = -(-a.kv_tokens // BenchConfig.engine.page_size)
    engine = dataclasses.replace(BenchConfig.engine, kv_budget_gib=kv_gib, kv_budget_fraction=a.kv_fraction,
                                 max_slots=a.max_slots, overlap_host=not a.no_overlap_host,
                                 fuse_projections={"auto": None, "on": True, "off": False}[a.fuse_projections],
                                 fp8_gemm=GemmBackend(a.fp8_gemm), fused_cast=a.fused_cast == "on",
                                 sampling_draw=Draw(a.draw),
                                 decode_buckets=tuple(a.decode_buckets) if a.decode_buckets else (),
                                 swap_space_gib=a.swap_space_gib, **sizing)
    model = PRESETS[a.preset]
    if a.layers:
        model = dataclasses.replace(model, num_layers=a.layers)
    return BenchConfig(model=model, workload=w, modes=tuple(Fp8Mode(m) for m in a.modes), engine=engine,
                       backend=Backend(a.backend), vllm=vllm_cfg, workdir=a.workdir,
                       kv_gib_like_vllm=tuple(a.kv_gib_like_vllm) if a.kv_gib_like_vllm else None,
                       sync_repeats=a.sync_repeats, repeats=a.repeats, stall_dump_s=a.stall_dump_s,
                       also_workloads=tuple((n, WORKLOADS[n]) for n in a.also_workloads))


def process_env(a: argparse.Namespace) -> dict[str, str]:
    """The vllm backend's memory split and vLLM's process settings (set before JAX touches the GPU)."""
    cfg = config(a)
    return cfg.vllm.memory_env() if cfg.vllm is not None else {}


def run(a: argparse.Namespace) -> dict:
    enable_compilation_cache()
    return measure(config(a))


def result_name(a: argparse.Namespace) -> str:
    """``rollout_<workload>_<backend>_<modes>``, the preset first where it is not Qwen3-8B."""
    preset = "" if a.preset == "qwen3_8b" else f"{a.preset}_"
    return f"rollout_{preset}{a.workload}_{a.backend}_{'-'.join(a.modes)}"


SMOKE = ["--preset", "tiny_qwen3_moe", "--layers", "1", "--workload", "tiny", "--modes", "none", "all",
         "--max-slots", "4", "--kv-tokens", "4096", "--repeats", "3"]
