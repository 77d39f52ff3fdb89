"""The built-in JAX rollout engine: paged KV cache, continuous batching, multi-step decode.

Design:
- Device state is the params pytree and one ``PagedKVCache`` whose rows are ``max_slots`` decode
  slots sharing a pool of ``num_pages`` pages. The model is the trainer's model definition under
  the engine's matmul policy (BF16, or W8A8 with block-FP8 weights): precision is the only
  difference between trainer and generator.
- The host owns scheduling: a FIFO of requests, slot assignment, a free list of pages, and the
  page table and lengths it sends with every device call (a few KB). It is the single source of
  truth for what each slot holds, so no device->host sync is needed except the sampled tokens.
- Prefill: admitted requests run in groups of ``prefill_batch`` rows padded to a length bucket
  (compiles stay bounded by buckets x 1), on a view of the cache restricted to their slots.
- Decode: one jitted call runs ``steps_per_call`` steps (``lax.fori_loop``), so dispatch overhead
  is paid once per call, not per token. It runs the first R slots only, R the smallest of
  ``decode_buckets`` that holds every occupied slot: its GEMMs, lm_head and sampling cost R rows,
  not ``max_slots`` (one compilation per bucket), so a 128-prompt rollout on a 256-slot engine
  runs 128 rows. Requests take the lowest free slot, and when the running ones fit a smaller
  bucket, those above it move down into free slots (`_compact`: host bookkeeping only, the KV
  stays in its pages). A finished slot stops writing (its ``num_new`` is 0) until the host
  refills it. The call also returns the slots' end state (last token, active, tokens left), so
  with ``overlap_host`` (default) the next chunk is dispatched from it before the host reads this
  chunk's tokens: the host's bookkeeping runs while the device decodes. Pages are then reserved
  for two chunks ahead; a request preempted while a chunk was in flight for it (its ``epoch``
  moved) has that chunk's tokens dropped and recomputed, identically.
  Device lengths are kept on the device (prefill sets its rows, decode advances them); the host
  sends them only for rows that do not continue from the previous chunk.
- Pages: before each decode call every running slot holds pages for ``steps_per_call`` more
  tokens. When the pool runs out, the most recently admitted sequence is preempted: its pages
  are freed and it goes back to the front of the queue with what it generated so far, to be
  recomputed by a later prefill. With ``swap_space_gib`` its KV pages are instead copied to host
  memory (pinned where the backend has it, asynchronously) and copied back into fresh pages when
  it is readmitted, so it resumes decoding without the recompute prefill (vLLM's swap preemption,
  which its V1 engine dropped); when the host space is full, preemption recomputes. Sampling keys
  depend only on (request seed, token position), so preemption never changes the tokens.
- FP8 KV (precision KV or ALL): the page pool is E4M3 with per-layer K/V scales. Every
  ``update_weights`` marks the scales stale; they are recalibrated before the next generation
  either inference-side (``KvCalibration.INFERENCE``: ``calibrate_kv_scales`` on the engine's own
  params over the first prompts of that call) or trainer-side (``KvCalibration.TRAINER``: the
  trainer calls ``calibrate_kv_scales`` on its calibration batch and ``set_kv_scales``; until it
  does, ``generate`` refuses to run). Stale scales cannot be used.
- MoE routing replay (``record_routing``): every forward that feeds a token through the model
  also returns the experts it chose ([rows, T, L_moe, k] int32, ``forward_with_routing``), and
  the host keeps them per request position: the first time a position runs through the model
  (prompt positions in the prefill, each generated token when it is fed back in the decode) its
  choices are recorded. A preempted sequence's recompute prefill runs those positions again;
  the first recording is kept (it is what the logprobs sampled before the preemption saw) and
  each disagreement of the recompute is counted in ``RolloutBatch.routing_recompute_mismatches``
  (prefill and decode are different computations, so in BF16/FP8 a near-tie can flip; in float32
  they agree). The last generated token is never fed back, so it has no recording (-1): its
  output predicts nothing the trainer uses.
- Memory between rollouts (``sleep`` / ``wake``): the KV pool, the engine's largest allocation,
  holds nothing between generates, so ``sleep`` frees it while a colocated trainer runs and the
  next generate allocates it again at the same shape (no recompile), keeping the FP8 KV scales
  and their freshness. ``JaxEngine(..., asleep=True)`` starts without it.
- Bad input (empty prompt, ids outside the vocabulary, a prompt that cannot fit, bad sampling
  settings) raises ``ValueError`` naming the request before anything runs.
- Tensor parallelism (``JaxEngine(..., mesh=...)``, a mesh whose only axis of size > 1 is
  ``tensor``): the parameters take the ``TENSOR_PARALLEL`` preset of ``fp8rl_jax.parallel``
  (column-parallel q/k/v/gate/up and lm_head, row-parallel o/down, whole heads per device), the
  KV pools are split over their kv-head axis (``HeadSharding``), and the same jitted prefill and
  decode run partitioned by XLA (the attention kernels per head shard and the FP8 GEMMs per weight
  shard under ``shard_map``: XLA cannot partition a Pallas call and would gather its operands). The
  host loop is unchanged: page tables, lengths and sampling state are replicated. ``kv_budget_gib``
  is per device, so the pool holds ``tensor`` times the pages. ``update_weights`` reshards the
  trainer's params into this layout (any input layout: FSDP, replicated, host) and quantizes
  each shard where it lives (block-aligned specs: no collective, bitwise equal to unsharded);
  ``last_sync`` reports the reshard and quantize times.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import math
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8rl_jax.models import DensePolicy, Fp8Mode, HeadSharding, ModelConfig, PagedKVCache, abstract_params, forward
from fp8rl_jax.models.fusion import concat_parts, fuse_params
from fp8rl_jax.models.kv_cache import calibrate_kv_scales_jit, calibration_batch
from fp8rl_jax.models.qwen3 import forward_with_routing, moe_layers
from fp8rl_jax.models.policy import Kernels
from fp8rl_jax.quant.policy import (GemmBackend, LayerPolicy, W8A8Policy, WeightSharding, quantize_params,
                                    quantizing_concat)
from fp8rl_jax.rollout.base import FinishReason, RolloutBatch
from fp8rl_jax.rollout.config import EngineConfig, KvCalibration
from fp8rl_jax.rollout.sampling import Draw, SamplingConfig, SlotSampling, row_keys, sample, truncates
from fp8rl_jax.rollout.watchdog import StallWatchdog

_FINISH_CODES = {1: FinishReason.STOP, 2: FinishReason.LENGTH, 3: FinishReason.MAX_LEN}
SWAP_CHUNK_PAGES = 32  # pages per swap copy (one compiled gather and one scatter; a sequence takes several)
SWAP_RESERVE_BLOCK = 256 * 2**20  # bytes per block `JaxEngine.reserve_swap_space` pins
_NO_STOP = -1


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    sampling: SamplingConfig
    stop_ids: tuple[int, ...]
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)  # [n, L_moe, k] chunks, by position
    routed: int = 0  # positions recorded so far (0..routed-1)
    epoch: int = 0  # preemptions so far: a decode chunk dispatched before one has no say on this request
    swapped: tuple | None = None  # while preempted with swap: ([(host K, host V) chunk], tokens cached, host bytes)

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated


@dataclasses.dataclass
class _Chunk:
    """A dispatched decode call: when, for which requests (and their preemption epochs), its device
    outputs (tokens, logprobs, finish codes, routing) and end state, its running rows and the
    context tokens they read at its start."""

    dispatched: float
    reqs: list
    epochs: list[int]
    outputs: tuple
    state: tuple
    rows: int
    context: int
    host_s: float  # host seconds from the last device call's observed completion to this call's launch returning
    bucket: int  # rows the decode program ran (EngineConfig.decode_buckets)
    device_s: float | None = None  # set when the host first waits for it


class JaxEngine:
    """``Generator`` on the one model definition with a paged KV cache."""

    def __init__(self, model_config: ModelConfig, params: Any, config: EngineConfig = EngineConfig(), *,
                 mesh: jax.sharding.Mesh | None = None, asleep: bool = False):
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.heads = _head_sharding(mesh, model_config) if mesh is not None else None
        self.last_sync: dict[str, float] = {}
        self.max_seq_len = min(config.max_seq_len, model_config.max_position_embeddings)
        fp8 = config.precision.fp8_weights
        block = tuple(config.fp8_block)
        # BF16 MoE experts through the Pallas grouped GEMM and the norms through the add + RMSNorm kernel, on one
        # device (no VJP needed here; XLA cannot partition the kernels, so a sharded engine keeps the jnp ops)
        one = Kernels.AUTO if mesh is None else Kernels.REFERENCE
        dense = DensePolicy(config.dtype, ragged_kernels=one, fused_cast=config.fused_cast, norm_kernels=one)
        self.policy = (W8A8Policy(config.dtype, group_size=block[1], gemm=config.fp8_gemm,
                                  fused_cast=config.fused_cast) if fp8 else dense)
        self.fused = config.fuse_projections if config.fuse_projections is not None else mesh is None
        if self.fused and mesh is not None:
            raise ValueError("EngineConfig.fuse_projections is for one device: tensor parallelism splits q/k/v by "
                             "heads, not their concatenation")
        # the trainer's params -> the generator's layout: FP8 quantization and/or fusion (None: as given)
        self._prepare = _prepare_fn(model_config, block, fp8, self.fused,
                                    experts=fp8 or config.fuse_projections is True)
        if self._prepare is not None and mesh is None:  # (a mesh's prepare runs per shard, on local shapes)
            self._prepare = _checked_prepare(self._prepare, model_config)
        self._sharded_quantize = None  # with a mesh: _prepare (quantization only) jitted to the generator's layout
        self._reshard = None  # with a mesh: (params key, shardings, jitted reshard into the generator's layout)
        self.reshard_path = ""  # with a mesh: how the last update moved the params ("jit" or "device_put")
        if config.record_routing and not moe_layers(model_config):
            raise ValueError("EngineConfig.record_routing needs an MoE model; this config has no MoE layer "
                             "(num_experts = 0)")
        self.params = None
        self.swap_reserve_s: float | None = None  # seconds `reserve_swap_space` took (None: not yet run)
        self.stats: dict[str, float] = {}  # of the last generate: device-call counts, seconds, tokens (``_run``)
        # of the last generate, one entry per decode call read, in order: (device seconds, rows running at its
        # start, context tokens they read at its first step, host seconds from the previous call's observed
        # completion to this one's launch, rows the program ran: its decode bucket). Benchmarks compare its step
        # time along a run with a profile of the same state. A call's device seconds run until the host observes
        # its completion, so they include any time the GPU then waited for the next launch: with ``overlap_host``,
        # the GPU waits only where a host time exceeds the device time of the call in flight.
        self.decode_log: list[tuple[float, int, int, float, int]] = []
        # called after every device call of a generate with a snapshot of its progress (``_progress``);
        # benchmarks use it to report throughput before a long run ends (or is cut)
        self.progress: Callable[[dict], None] | None = None
        # EngineConfig.stall_timeout_s: the running generate's watchdog, and what it does on a stall
        # (None: report and exit with code 3; tests substitute a callback)
        self._watch: StallWatchdog | None = None
        self.on_stall: Callable[[str], None] | None = None
        self.update_weights(params)  # first: a fractional KV budget is taken from what the weights leave
        if self.mesh is not None and isinstance(self.policy, W8A8Policy):
            # the Pallas GEMMs run per weight shard (shard_map): XLA would gather their operands
            self.policy = dataclasses.replace(self.policy, sharding=WeightSharding.of_params(self.params, self.mesh))
        kv_dtype = jnp.dtype(jnp.float8_e4m3fn) if config.fp8_kv else jnp.dtype(config.dtype)
        cfg = model_config
        bytes_per_page = 2 * cfg.num_layers * config.page_size * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
        tp = self.heads.size if self.heads is not None else 1  # the budget is per device; a page's heads are split
        budget = self._kv_budget_bytes()
        self.num_pages = config.num_pages or int(budget * tp // bytes_per_page)
        if self.num_pages < 1:
            raise ValueError(f"a KV budget of {budget / 2**30:.3g} GiB holds no page of {bytes_per_page} bytes")
        self.max_pages = math.ceil(self.max_seq_len / config.page_size)
        self.kv_dtype = kv_dtype
        self.cache: PagedKVCache | None = None
        # while asleep (``sleep``): what the pool's next allocation keeps (scales, kernel choice)
        self._slept = dict(kernels=None, k_scale=None, v_scale=None)
        if not asleep:
            self.wake()
        self._static = dict(model_config=model_config, policy=self.policy, max_seq_len=self.max_seq_len,
                            record_routing=config.record_routing, draw=config.sampling_draw)
        self._routing_mismatches = 0

    def _kv_budget_bytes(self) -> float:
        """Per-device KV bytes: ``kv_budget_gib``, or ``kv_budget_fraction`` of the memory the
        allocator can still give (its limit minus what is in use, the weights included) on the
        device of the pool's mesh that has the least of it."""
        frac = self.config.kv_budget_fraction
        if not frac:
            return self.config.kv_budget_gib * 2**30
        free = []
        for d in self._memory_devices():
            stats = d.memory_stats() if hasattr(d, "memory_stats") else None
            if not stats or "bytes_limit" not in stats:
                raise ValueError(f"EngineConfig.kv_budget_fraction needs a backend that reports device memory "
                                 f"({d.platform} does not); set kv_budget_gib instead")
            free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return frac * min(free)

    def _memory_devices(self) -> list:
        """The devices the KV pool lives on (the mesh's, or the default device)."""
        return list(self.mesh.devices.flat) if self.mesh is not None else [jax.devices()[0]]

    # ----------------------------------------------------------------------- public interface

    @property
    def sequences_that_fit(self) -> int:
        """Full-length sequences (max_seq_len tokens) the KV pool holds at once."""
        return self.num_pages // self.max_pages

    def update_weights(self, params: Any) -> None:
        """Swaps in new parameters (re-quantized to FP8 when the engine runs W8A8); FP8 KV scales
        become stale and are recalibrated (or must be synced) before the next generation. With a
        mesh, the params are first resharded into the generator's layout (``last_sync`` times it)."""
        if self.mesh is None:
            if self._prepare is None:
                _check_params(self.model_config, params)
                self.params = params
            else:  # the previous copy goes before the new one is built (peak memory: one copy, not two)
                self.params = None
                self.params = self._prepare(params)  # checks the params when it traces a new signature
        else:
            self.params = self._sharded_update(params)
        self.kv_scales_fresh = False

    def _sharded_update(self, params: Any) -> Any:
        from fp8rl_jax.parallel import ShardingPreset, param_shardings  # the parallel package imports the trainer

        preset = ShardingPreset.TENSOR_PARALLEL
        t0 = time.perf_counter()
        key = jax.tree.structure(params), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(params))
        if self._reshard is None or self._reshard[0] != key:
            _check_params(self.model_config, params)  # once per signature, before the weights are replaced
            shardings = param_shardings(params, self.model_config, self.mesh, preset)
            # one compiled program moves every array (device_put reshards leaf by leaf: one
            # transfer program per array, ~400 for a Qwen3)
            self._reshard = key, shardings, jax.jit(lambda p: p, out_shardings=shardings)
        _, shardings, reshard = self._reshard
        self.reshard_path = "jit" if _on_devices(params, set(self.mesh.devices.flat)) else "device_put"
        if self.reshard_path == "jit":
            placed = jax.block_until_ready(reshard(params))
        else:  # host arrays, or arrays on other devices: transferred leaf by leaf
            placed = jax.block_until_ready(jax.device_put(params, shardings))
        t1 = time.perf_counter()
        out = placed
        if self._prepare is not None:
            if self._sharded_quantize is None:  # built once: the output layout is the generator's
                self._sharded_quantize = _shard_local_quantize(self._prepare, placed, self.model_config, self.mesh,
                                                               preset)
            out = jax.block_until_ready(self._sharded_quantize(placed))
        self.last_sync = {"reshard_s": t1 - t0, "quantize_s": time.perf_counter() - t1}
        return out

    @property
    def asleep(self) -> bool:
        """Whether the KV pool is freed (`sleep`); the next `generate` or `warmup` allocates it."""
        return self.cache is None

    @property
    def kv_pool_bytes(self) -> int:
        """Device bytes of the KV pool when allocated (all devices of the mesh together)."""
        c = self.model_config
        return 2 * c.num_layers * self.num_pages * self.config.page_size * c.num_kv_heads * c.head_dim * \
            self.kv_dtype.itemsize

    def sleep(self, weights: bool = False) -> None:
        """Frees the KV pool's device memory, e.g. while a colocated trainer runs its step (the
        role of vLLM's sleep mode): the pool is the engine's largest allocation (tens of GiB at
        8B scale) and holds nothing between generates. The FP8 KV scales stay, and so does
        whether they are fresh: sleeping never makes stale scales usable nor fresh ones stale.
        `wake` (or the next ``generate`` / ``warmup``, which wake the engine themselves)
        allocates a pool of the same shape, so no program recompiles. ``weights=True`` also
        drops the engine's reference to its weights (the FP8 copy of a W8A8 engine, or the cast
        copy the RL loop hands over: 8-16 GB at 8B scale are then the trainer's; arrays the
        caller still holds are not touched); ``update_weights`` must come before the next
        generate, as it does in an RL step. Idempotent."""
        if weights:
            self.params = None
        if self.cache is None:
            return
        c = self.cache
        self._slept = dict(kernels=c.kernels, k_scale=c.k_scale, v_scale=c.v_scale)
        for a in (*c.k_pages, *c.v_pages, c.page_table, c.lengths):
            a.delete()
        self.cache = None

    def _need_weights(self) -> None:
        if self.params is None:
            raise RuntimeError("JaxEngine has no weights: sleep(weights=True) dropped them, or the last "
                               "update_weights failed; call update_weights before generating")

    def wake(self) -> None:
        """Allocates the KV pool again after `sleep` (a no-op when awake). Raises a
        ``RuntimeError`` that names the pool's size when the device cannot hold it (e.g. the
        trainer still holds its memory); the engine then stays asleep and can be woken later."""
        if self.cache is not None:
            return
        c, cfg = self.model_config, self.config
        try:
            # one device: the cache committed to it, like every input `_put` places (`_put`'s note says why)
            cache = PagedKVCache.init(c.num_layers, self.num_pages, cfg.page_size, c.num_kv_heads, c.head_dim,
                                      cfg.max_slots, self.max_pages, self.kv_dtype, kernels=self._slept["kernels"],
                                      heads=self.heads, device=jax.devices()[0] if self.heads is None else None)
        except Exception as e:  # XLA's resource-exhausted error: say what did not fit
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            raise RuntimeError(f"JaxEngine.wake: the KV pool ({self.num_pages} pages, "
                               f"{self.kv_pool_bytes / 2**30:.2f} GiB) does not fit in device memory now; free "
                               f"memory (e.g. the trainer's step buffers) and call wake() again") from e
        if self.mesh is not None:  # as the programs return them (`_put`)
            cache = cache.replace(page_table=self._put(cache.page_table), lengths=self._put(cache.lengths),
                                  k_scale=self._put(cache.k_scale), v_scale=self._put(cache.v_scale))
        if self._slept["k_scale"] is not None:
            cache = cache.replace(k_scale=self._slept["k_scale"], v_scale=self._slept["v_scale"])
        self.cache = cache
        self._slept = dict(kernels=None, k_scale=None, v_scale=None)

    def set_kv_scales(self, k_scale: Any, v_scale: Any) -> None:
        """Trainer-side FP8 KV scales ([L] float32 each, from ``calibrate_kv_scales``)."""
        L = self.model_config.num_layers
        # copies: the cache is donated to the device steps, and the caller keeps its arrays
        k_scale, v_scale = jnp.array(k_scale, jnp.float32, copy=True), jnp.array(v_scale, jnp.float32, copy=True)
        k_scale, v_scale = self._put((k_scale, v_scale))  # committed as the cache is; with a mesh, replicated
        if k_scale.shape != (L,) or v_scale.shape != (L,):
            raise ValueError(f"KV scales must have shape ({L},), got {k_scale.shape} and {v_scale.shape}")
        if not (bool(jnp.all(jnp.isfinite(k_scale)) & jnp.all(k_scale > 0))
                and bool(jnp.all(jnp.isfinite(v_scale)) & jnp.all(v_scale > 0))):
            raise ValueError("KV scales must be finite and positive")
        if self.cache is None:  # asleep: the pool's next allocation takes them
            self._slept.update(k_scale=k_scale, v_scale=v_scale)
        else:
            self.cache = self.cache.replace(k_scale=k_scale, v_scale=v_scale)
        self.kv_scales_fresh = True

    def warmup(self, min_prompt_len: int = 1, max_prompt_len: int | None = None,
               progress: Callable[[str, float], None] | None = None, recompute: bool = True,
               truncation: bool = False) -> float:
        """Compiles every program a generate can need, without changing the engine's state: the decode loop
        of every row bucket (``EngineConfig.decode_buckets``) and the merge of a continued chunk's state, swap
        preemption's copies (with ``swap_space_gib``), the prefill of every bucket from
        ``bucket(min_prompt_len)`` up to ``bucket(max_seq_len)`` (a sequence recomputed after preemption is
        prefilled at its whole context, up to ``max_seq_len``), and, for FP8 KV with inference-side
        calibration, the calibration forward of the prompt buckets up to ``bucket(max_prompt_len)`` (default
        ``max_seq_len``). Otherwise each compiles at its first use, inside a generate (seconds to tens of
        seconds each at 8B scale). Every call is made with padding rows only (out-of-range slots, no token),
        which write nothing. ``progress(program, seconds)`` is called after each program (compile and one
        run). ``recompute=False`` stops the prefill buckets at ``bucket(max_prompt_len)``: right when no
        preemption can happen (every request fits at ``max_seq_len`` at once, see ``sequences_that_fit``),
        and it saves a compile per bucket (15-25 s each at 8B scale). The prefill and decode programs are
        those of calls without top-k / top-p rows (each call's truncation is decided on the host,
        `_truncation`); ``truncation=True`` compiles those of calls with such rows too. Returns the seconds
        spent."""
        if not 1 <= min_prompt_len <= self.max_seq_len:
            raise ValueError(f"min_prompt_len must be in [1, max_seq_len = {self.max_seq_len}], got {min_prompt_len}")
        top = self.max_seq_len if max_prompt_len is None else max_prompt_len
        if not min_prompt_len <= top <= self.max_seq_len:
            raise ValueError(f"max_prompt_len must be in [min_prompt_len, max_seq_len = {self.max_seq_len}], "
                             f"got {max_prompt_len}")
        self._need_weights()
        self.wake()
        t0 = last = time.perf_counter()

        def done(program: str, out: Any) -> None:
            nonlocal last
            jax.block_until_ready(out)
            if progress is not None:
                progress(program, time.perf_counter() - last)
            last = time.perf_counter()

        lo, hi = self._bucket(min_prompt_len), self._bucket(self.max_seq_len if recompute else top)
        buckets = sorted({b for b in self.config.prefill_buckets if lo <= b <= hi} | {hi})
        P, B = self.config.prefill_batch, self.config.max_slots
        for trunc in (False, True) if truncation else (False,):
            tag = " (top-k/top-p)" if trunc else ""
            sampling, stops, remaining = self._slot_arrays([None] * P)
            for T in buckets:  # padding rows: slot ids out of range, no token to write
                out = _prefill(self.params, self.cache,
                               *self._put((np.full((P,), B, np.int32), np.zeros((P, T), np.int32),
                                           np.zeros((P,), np.int32))),
                               sampling, stops, remaining, truncation=trunc, **self._static)
                self.cache = out[3]
                done(f"prefill {P}x{T}{tag}", out)
            sampling, stops, remaining = self._slot_arrays([None] * B)
            for R in self.config.decode_rows:
                out = decode_program()(self.params, self.cache,
                                       *self._put((np.zeros((B,), np.int32), np.zeros((B,), bool))),
                                       sampling, stops, remaining, steps=self.config.steps_per_call, truncation=trunc,
                                       rows=R, **self._static)
                self.cache = out[3]
                done(f"decode {R}x{self.config.steps_per_call}{tag}", out)
        # the merge of a continued chunk's device state with the host's rows (`_dispatch_decode`), as it runs
        cont, src = self._put((np.zeros((B,), bool), np.zeros((B,), np.int32)))
        state = (*self._put((np.zeros((B,), np.int32), np.zeros((B,), bool), np.zeros((B,), np.int32))),
                 self.cache.lengths)
        for moved in (None, src):
            done(f"decode continuation{' (moved rows)' if moved is not None else ''}",
                 _continue_rows(cont, state, state, moved))
        if self.config.swap_space_gib > 0:  # swap preemption's copies, the scatter writing nothing (ids dropped)
            k, v = _gather_pages(self.cache.k_pages, self.cache.v_pages, self._put(np.zeros((SWAP_CHUNK_PAGES,),
                                                                                            np.int32)))
            k, v = _to_device(_to_host(k)), _to_device(_to_host(v))
            self.cache = _scatter_pages(self.cache, self._put(np.full((SWAP_CHUNK_PAGES,), self.num_pages, np.int32)),
                                        k, v)
            done("swap copies", self.cache)
            self.reserve_swap_space()
            done("swap space pinned", self.cache)
        if self.config.fp8_kv and self.config.kv_calibration is KvCalibration.INFERENCE:
            n = self.config.kv_calibration_prompts
            for T in (b for b in buckets if b <= self._bucket(top)):
                done(f"kv calibration {n}x{T}",
                     _calibrate(self.params, jnp.zeros((n, T), jnp.int32), jnp.zeros((n,), jnp.int32),
                                config=self.model_config, policy=self.policy, percentile=self.config.kv_percentile,
                                margin=self.config.kv_margin))
        return time.perf_counter() - t0

    def _ensure_kv_scales(self, requests: list[_Request]) -> None:
        if not self.config.fp8_kv or self.kv_scales_fresh:
            return
        if self.config.kv_calibration is KvCalibration.TRAINER:
            raise RuntimeError("FP8 KV scales are stale after update_weights: with trainer-side calibration the "
                               "trainer must call calibrate_kv_scales and set_kv_scales first")
        prompts = [r.prompt for r in requests[: self.config.kv_calibration_prompts]]
        # one compiled calibration per prompt bucket, whatever the batch size (a 4-prompt warm-up
        # and a 256-prompt rollout share it)
        tokens, lengths = calibration_batch(prompts, self.config.kv_calibration_prompts,
                                            self._bucket(max(len(p) for p in prompts)))
        k, v = _calibrate(self.params, jnp.asarray(tokens), jnp.asarray(lengths), config=self.model_config,
                          policy=self.policy, percentile=self.config.kv_percentile, margin=self.config.kv_margin)
        self.set_kv_scales(k, v)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig]
                 ) -> RolloutBatch:
        requests = self._validate(prompts, sampling)
        self._need_weights()
        self.wake()
        self.reserve_swap_space()
        self._ensure_kv_scales(requests)
        self._run(requests)
        n = len(requests)
        width = max([len(r.generated) for r in requests] + [1])
        tokens = np.zeros((n, width), np.int32)
        logprobs = np.zeros((n, width), np.float32)
        for i, r in enumerate(requests):
            tokens[i, : len(r.generated)] = r.generated
            logprobs[i, : len(r.generated)] = r.logprobs
        routing = self._routing_array(requests) if self.config.record_routing else None
        return RolloutBatch(tokens, logprobs, np.array([len(r.generated) for r in requests], np.int32),
                            [r.finish for r in requests], self._preemptions, routing=routing,
                            routing_recompute_mismatches=self._routing_mismatches)

    def _routing_array(self, requests: list[_Request]) -> np.ndarray:
        """[N, S, L_moe, k] int32 over prompt + generated positions, -1 where nothing was recorded."""
        L, k = len(moe_layers(self.model_config)), self.model_config.num_experts_per_tok
        S = max(len(r.context) for r in requests)
        out = np.full((len(requests), S, L, k), -1, np.int32)
        for i, r in enumerate(requests):
            if r.routed:
                out[i, : r.routed] = np.concatenate(r.routing, axis=0)
        return out

    # ----------------------------------------------------------------------- validation

    def _most_kv(self, prompt_len: int, max_tokens: int) -> int:
        """The KV slots a request may ever need (what `_validate` checks the pool holds)."""
        return min(prompt_len + max_tokens, self.max_seq_len) + self.config.steps_per_call

    def _validate(self, prompts, sampling) -> list[_Request]:
        if isinstance(sampling, SamplingConfig):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling configs for {len(prompts)} prompts")
        V = self.model_config.vocab_size
        capacity = self.num_pages * self.config.page_size
        eos = tuple(self.model_config.eos_token_ids)
        requests = []
        for i, (prompt, s) in enumerate(zip(prompts, sampling)):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"request {i}: the prompt is empty")
            bad = [t for t in prompt if not 0 <= t < V]
            if bad:
                raise ValueError(f"request {i}: token id {bad[0]} is outside the vocabulary [0, {V})")
            if len(prompt) >= self.max_seq_len:
                raise ValueError(f"request {i}: prompt of {len(prompt)} tokens leaves no room under "
                                 f"max_seq_len {self.max_seq_len}")
            if not isinstance(s, SamplingConfig):
                raise ValueError(f"request {i}: sampling must be a SamplingConfig, got {type(s).__name__}")
            need = self._most_kv(len(prompt), s.max_tokens)
            if need > capacity:
                raise ValueError(f"request {i}: needs up to {need} KV slots but the pool holds {capacity} "
                                 f"({self.num_pages} pages of {self.config.page_size})")
            stops = tuple(sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos))))
            requests.append(_Request(i, prompt, s, stops))
        return requests

    # ----------------------------------------------------------------------- scheduling

    def _run(self, requests: list[_Request]) -> None:
        if self.config.stall_timeout_s <= 0:
            return self._run_loop(requests)
        hint = ("The device program stopped finishing; exiting so the job can restart from its last "
                "checkpoint (EngineConfig.stall_timeout_s).")
        with StallWatchdog(self.config.stall_timeout_s, name="JaxEngine.generate", on_stall=self.on_stall,
                           hint=hint) as self._watch:
            try:
                self._run_loop(requests)
            finally:
                self._watch = None

    def _run_loop(self, requests: list[_Request]) -> None:
        B, ps, steps = self.config.max_slots, self.config.page_size, self.config.steps_per_call
        queue = collections.deque(requests)
        self._preemptions = 0
        self._routing_mismatches = 0
        self.stats = dict.fromkeys(("prefill_calls", "prefill_tokens", "prefill_s", "decode_calls", "decode_steps",
                                    "decode_s", "decode_slot_steps", "decode_row_steps", "decode_kv_tokens",
                                    "slot_moves", "swap_outs", "swap_ins", "swapped_tokens"), 0)
        self._swap_bytes = 0  # host bytes held by swapped-out sequences
        self.decode_log = []
        # device work completes in dispatch order: each call's device time runs from the later of its
        # dispatch and the previous call's observed completion to its own (``_completed``)
        self._clock = time.perf_counter()
        slots: list[_Request | None] = [None] * B
        pages: list[list[int]] = [[] for _ in range(B)]
        free = list(range(self.num_pages - 1, -1, -1))
        admitted_order: list[int] = []
        page_table = np.zeros((B, self.max_pages), np.int32)
        lengths = np.zeros((B,), np.int32)  # tokens in the cache per slot, as of the calls the host has read
        pending: _Chunk | None = None  # a decode chunk dispatched but not read yet (overlap_host)

        def ensure(slot: int, tokens: int) -> bool:
            want = min(math.ceil(tokens / ps), self.max_pages)
            while len(pages[slot]) < want:
                if not free:
                    return False
                p = free.pop()
                page_table[slot, len(pages[slot])] = p
                pages[slot].append(p)
            return True

        def release(slot: int) -> None:
            free.extend(reversed(pages[slot]))
            pages[slot] = []
            slots[slot] = None
            lengths[slot] = 0
            if slot in admitted_order:
                admitted_order.remove(slot)

        def release_finished() -> None:
            for slot in range(B):
                if slots[slot] is not None and slots[slot].finish is not None:
                    release(slot)

        while queue or pending is not None or any(s is not None for s in slots):
            # admit waiting requests into free slots while their context and a decode chunk fit
            group = []
            while queue and None in slots:
                r = queue[0]
                slot = slots.index(None)
                if not ensure(slot, len(r.prompt) + len(r.generated) + steps):
                    release(slot)
                    break
                queue.popleft()
                slots[slot] = r
                admitted_order.append(slot)
                if r.swapped is not None:  # its KV comes back from host memory: no prefill
                    lengths[slot] = self._swap_in(r, pages[slot])
                else:
                    group.append(slot)
            if group and pending is not None:  # its device time ends before the prefill's starts
                self._observe(pending)
            for start in range(0, len(group), self.config.prefill_batch):
                self._prefill_group(group[start : start + self.config.prefill_batch], slots, page_table, lengths)
                self._progress(requests, len(queue), len(group))
            release_finished()
            chunk = None
            if any(s is not None for s in slots):
                # every running slot needs pages for the coming chunk, and for the one in flight (which may
                # add ``steps`` tokens before it starts); preempt the newest if not
                ahead = steps * (2 if pending is not None else 1)
                for slot in range(B):
                    r = slots[slot]
                    while slots[slot] is not None and not ensure(
                            slot, min(int(lengths[slot]) + ahead, self._most_kv(len(r.prompt), r.sampling.max_tokens))):
                        victim = admitted_order[-1]
                        out = slots[victim]
                        self._swap_out(out, pages[victim], int(lengths[victim]))
                        release(victim)
                        out.epoch += 1  # the chunk in flight computed on for it: dropped, recomputed later
                        queue.appendleft(out)
                        self._preemptions += 1
                if any(s is not None for s in slots):
                    self._compact(slots, pages, page_table, lengths, admitted_order)
                    chunk = self._dispatch_decode(slots, page_table, lengths, pending)
            if not self.config.overlap_host:  # read the chunk just dispatched now (nothing is in flight)
                pending, chunk = chunk, None
            if pending is not None:
                self._finish_decode(pending, slots, lengths)
                self._progress(requests, len(queue), sum(s is not None for s in slots))
                release_finished()
            pending = chunk

    # ----------------------------------------------------------------------- device calls

    def reserve_swap_space(self) -> float:
        """Pins ``swap_space_gib`` of host memory for swap preemption, once per engine (a no-op without swap
        space, where the devices have no pinned host memory, or after the first call; ``generate`` and ``warmup``
        call it) and returns the seconds it took. The blocks are released at once: XLA's pinned-host allocator
        keeps the regions it grew and carves the swap copies from them later. Raises a ``RuntimeError`` naming
        ``swap_space_gib`` when the host cannot pin that much."""
        if self.swap_reserve_s is not None:
            return 0.0
        t0 = time.perf_counter()
        gib = self.config.swap_space_gib
        devices = list(self.mesh.devices.flat) if self.mesh is not None else [jax.devices()[0]]  # the pools' devices
        if gib > 0 and _pinned_host(devices):
            per_device = math.ceil(gib * 2**30 / len(devices))
            blk = min(SWAP_RESERVE_BLOCK, per_device)
            held = []
            try:
                for d in devices:
                    x = jax.device_put(np.zeros((blk,), np.uint8), d)
                    held += [_to_host(x) for _ in range(math.ceil(per_device / blk))]
                    jax.block_until_ready(held)
            except Exception as e:  # XLA's resource-exhausted error: say which setting asked for it
                raise RuntimeError(f"JaxEngine: cannot pin EngineConfig.swap_space_gib = {gib} GiB of host memory "
                                   f"for swap preemption ({e}); lower it, or 0 to recompute preempted "
                                   f"sequences") from e
            finally:
                for h in held:
                    h.delete()
        self.swap_reserve_s = time.perf_counter() - t0
        return self.swap_reserve_s

    def _swap_out(self, r: _Request, page_ids: list[int], tokens: int) -> None:
        """Copies the first ``tokens`` cached tokens of a request being preempted (its pages ``page_ids``) to host
        memory, if ``swap_space_gib`` has room (`EngineConfig.swap_space_gib`); else leaves it to be recomputed.
        The gathers are dispatched after every device call so far (the chunk in flight writes only positions at
        or past ``tokens``), and the pages may be reused as soon as this returns."""
        cfg, c = self.config, self.model_config
        n = math.ceil(tokens / cfg.page_size)
        copied = math.ceil(n / SWAP_CHUNK_PAGES) * SWAP_CHUNK_PAGES  # pages the chunked copies hold
        nbytes = 2 * c.num_layers * copied * cfg.page_size * c.num_kv_heads * c.head_dim * self.kv_dtype.itemsize
        if tokens <= 0 or self._swap_bytes + nbytes > cfg.swap_space_gib * 2**30:
            return
        chunks = []
        for start in range(0, n, SWAP_CHUNK_PAGES):
            ids = np.zeros((SWAP_CHUNK_PAGES,), np.int32)  # padding gathers page 0; swap-in drops it
            part = page_ids[start : min(start + SWAP_CHUNK_PAGES, n)]
            ids[: len(part)] = part
            k, v = _gather_pages(self.cache.k_pages, self.cache.v_pages, self._put(ids))
            chunks.append((_to_host(k), _to_host(v)))
        r.swapped = (chunks, tokens, nbytes)
        self._swap_bytes += nbytes
        self._count(swap_outs=1, swapped_tokens=tokens)

    def _swap_in(self, r: _Request, page_ids: list[int]) -> int:
        """Copies a swapped-out request's KV back into its new pages ``page_ids`` (which cover its tokens) and
        returns the number of tokens cached."""
        chunks, tokens, nbytes = r.swapped
        n = math.ceil(tokens / self.config.page_size)
        for i, (k, v) in enumerate(chunks):
            ids = np.full((SWAP_CHUNK_PAGES,), self.num_pages, np.int32)  # out of range: dropped
            part = page_ids[i * SWAP_CHUNK_PAGES : min((i + 1) * SWAP_CHUNK_PAGES, n)]
            ids[: len(part)] = part
            self.cache = _scatter_pages(self.cache, self._put(ids), _to_device(k), _to_device(v))
        r.swapped = None
        self._swap_bytes -= nbytes
        self._count(swap_ins=1)
        return tokens

    def _slot_arrays(self, reqs: list[_Request | None]):
        """Per-row sampling settings, stop ids and token budgets ([rows] arrays)."""
        default = SamplingConfig(temperature=0.0)
        sampling = SlotSampling.from_configs([r.sampling if r is not None else default for r in reqs])
        most = max([len(r.stop_ids) for r in reqs if r is not None] + [1])
        width = max(8, 1 << (most - 1).bit_length())  # few distinct shapes, few compilations
        stops = np.full((len(reqs), width), _NO_STOP, np.int32)
        remaining = np.zeros((len(reqs),), np.int32)
        for i, r in enumerate(reqs):
            if r is not None:
                stops[i, : len(r.stop_ids)] = r.stop_ids
                remaining[i] = r.sampling.max_tokens - len(r.generated)
        return self._put((sampling, stops, remaining))

    def _truncation(self, reqs: list[_Request | None]) -> bool:
        """Whether any request of a call truncates its draw (top-k / top-p): decided here on the
        host and compiled in (`sample`'s ``truncation``), not branched on in the device program. A
        ``lax.cond`` there copies its predicate to the host on XLA:GPU and holds the dispatching
        thread until the GPU reaches it, every decode step: a chunk's dispatch did not return before
        the chunk before it had run (session 19's W1 on the H200: the host's time per dispatch was one
        chunk's device time; 14-58 ms after this change)."""
        return any(r is not None and truncates(r.sampling, self.model_config.vocab_size) for r in reqs)

    def _put(self, tree: Any) -> Any:
        """Host values (NumPy or jnp arrays, pytrees of them) as the device programs take them: on the
        default device, or with a mesh replicated over it. With a mesh, the cache arrays the programs
        return are mesh-placed; host inputs placed the same way keep the first call's input shardings
        those of every later call, so each program compiles once (uncommitted host arrays compiled
        every prefill and decode program twice on a tensor-parallel engine). On one device likewise committed
        to it, as the KV cache is (`wake`): jit's cache keys on whether an argument is committed, and swap
        preemption's copies back (`_to_device`) are committed, so an uncommitted cache would recompile every
        program at the first swap-in."""
        if self.mesh is None:
            return jax.device_put(tree, jax.devices()[0])
        return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _bucket(self, n: int) -> int:
        for b in self.config.prefill_buckets:
            if b >= n:
                return b
        return n

    def _prefill_group(self, group: list[int], slots, page_table, lengths) -> None:
        P = self.config.prefill_batch
        reqs = [slots[s] for s in group]
        ctx = [r.context for r in reqs]
        T = self._bucket(max(len(c) for c in ctx))
        tokens = np.zeros((P, T), np.int32)
        num_new = np.zeros((P,), np.int32)
        slot_ids = np.full((P,), self.config.max_slots, np.int32)  # padding rows: out of range
        for i, (s, c) in enumerate(zip(group, ctx)):
            tokens[i, : len(c)] = c
            num_new[i] = len(c)
            slot_ids[i] = s
            lengths[s] = 0
        sampling, stops, remaining = self._slot_arrays(reqs + [None] * (P - len(reqs)))
        # the page table only: the other slots' lengths are the device's (a decode chunk may be in flight)
        self.cache = self.cache.replace(page_table=self._put(page_table))
        t0 = time.perf_counter()
        tok, lp, code, self.cache, routing = _prefill(self.params, self.cache, *self._put((slot_ids, tokens, num_new)),
                                                      sampling, stops, remaining, truncation=self._truncation(reqs),
                                                      **self._static)
        self._count(prefill_calls=1, prefill_tokens=int(num_new.sum()), prefill_s=self._completed((tok, lp, code), t0))
        tok, lp, code = np.asarray(tok), np.asarray(lp), np.asarray(code)
        routing = None if routing is None else np.asarray(routing)
        for i, (s, r) in enumerate(zip(group, reqs)):
            lengths[s] = num_new[i]
            if routing is not None:
                self._record_prefill(r, routing[i, : num_new[i]])
            self._append(r, int(tok[i]), float(lp[i]), int(code[i]))

    def _record_prefill(self, r: _Request, experts: np.ndarray) -> None:
        """Records the prefill's choices [len(context), L_moe, k] for the positions not yet recorded;
        on a recompute, counts the already-recorded positions where it chose differently."""
        if r.routed:
            first = np.concatenate(r.routing, axis=0)
            self._routing_mismatches += int(np.any(first != experts[: r.routed], axis=(1, 2)).sum())
        r.routing.append(experts[r.routed :])
        r.routed = experts.shape[0]

    def _completed(self, outputs: Any, dispatched: float) -> float:
        """Waits for ``outputs`` and returns the device seconds of the call that made them: from the
        later of its dispatch and the previous call's completion (calls complete in dispatch order)
        to now."""
        jax.block_until_ready(outputs)
        now = time.perf_counter()
        start = max(dispatched, self._clock)
        self._clock = now
        return now - start

    def _observe(self, chunk: _Chunk) -> None:
        """Waits for a decode chunk once, keeping its device seconds (`_completed`)."""
        if chunk.device_s is None:
            chunk.device_s = self._completed(chunk.outputs, chunk.dispatched)

    def _dispatch_decode(self, slots, page_table, lengths, pending: _Chunk | None) -> _Chunk:
        """Dispatches ``steps_per_call`` decode steps for the slots' requests, without waiting. A slot
        whose request ran in ``pending`` (same request, not preempted since) continues from the
        state ``pending`` will leave on the device (its tokens not read yet); the others start from
        the host's view (just prefilled, or idle)."""
        steps = self.config.steps_per_call
        reqs = list(slots)
        sampling, stops, remaining = self._slot_arrays(reqs)
        host_last = np.array([r.last_token if r is not None else 0 for r in reqs], np.int32)
        host_active = np.array([r is not None for r in reqs])
        # where each slot's request ran in ``pending`` (-1: it did not, or was preempted since); a request
        # `_compact` moved continues from its old row
        was = {} if pending is None else {id(r): s for s, r in enumerate(pending.reqs) if r is not None}
        src = np.array([was.get(id(r), -1) if r is not None else -1 for r in reqs], np.int32)
        src = np.where([s >= 0 and pending.epochs[s] == r.epoch for s, r in zip(src, reqs)], src, -1)
        cont = src >= 0
        host_lengths, host_last, host_active = self._put((np.asarray(lengths), host_last, host_active))
        if cont.any():
            moved = not (src == np.arange(len(reqs)))[cont].all()  # usually nothing moved: no gather, no indices
            last, active, remaining, cache_lengths = _continue_rows(
                self._put(cont), (*pending.state, self.cache.lengths), (host_last, host_active, remaining, host_lengths),
                self._put(np.maximum(src, 0)) if moved else None)
        else:
            last, active, cache_lengths = host_last, host_active, host_lengths
        self.cache = self.cache.replace(page_table=self._put(page_table), lengths=cache_lengths)
        rows = self._bucket_rows(reqs)
        t0 = time.perf_counter()
        toks, lps, codes, self.cache, routing, state = decode_program()(
            self.params, self.cache, last, active, sampling, stops, remaining, steps=steps,
            truncation=self._truncation(reqs), rows=rows, **self._static)
        host_s = time.perf_counter() - self._clock
        # KV tokens read (stats): each row running at the call's start reads its whole context every
        # step; for a continuing row the host's length lags by the chunk in flight (up to ``steps``)
        ctx = int(lengths[host_active].sum()) + int(cont.sum()) * steps
        return _Chunk(t0, reqs, [r.epoch if r is not None else 0 for r in reqs], (toks, lps, codes, routing), state,
                      int(host_active.sum()), ctx, host_s, rows)

    def _compact(self, slots, pages, page_table, lengths, admitted_order) -> None:
        """Moves requests from slots at or past the decode bucket their number needs into free slots
        below it, so a decode call runs that bucket (the KV stays in its pages: a move is the host's
        page-table row, length and slot bookkeeping). A request with a chunk in flight continues from
        that chunk's device state at its new row (`_dispatch_decode`)."""
        occupied = [s for s, r in enumerate(slots) if r is not None]
        R = next(b for b in self.config.decode_rows if b >= len(occupied))
        if not occupied or occupied[-1] < R:
            return
        holes = [s for s in range(R) if slots[s] is None]
        for src in (s for s in occupied if s >= R):
            dst = holes.pop(0)
            slots[dst], slots[src] = slots[src], None
            pages[dst], pages[src] = pages[src], []
            page_table[dst] = page_table[src]
            lengths[dst], lengths[src] = lengths[src], 0
            admitted_order[admitted_order.index(src)] = dst
            self._count(slot_moves=1)

    def _bucket_rows(self, reqs: list[_Request | None]) -> int:
        """The smallest decode bucket holding every occupied slot."""
        top = max((s + 1 for s, r in enumerate(reqs) if r is not None), default=1)
        return next(b for b in self.config.decode_rows if b >= top)

    def _finish_decode(self, chunk: _Chunk, slots, lengths) -> None:
        """Reads a dispatched chunk's tokens into its requests: those still in their slot and not
        preempted since the dispatch (a preempted one is recomputed from its context later, and
        its sampling keys make the same tokens)."""
        B, steps = self.config.max_slots, self.config.steps_per_call
        toks, lps, codes, routing = chunk.outputs
        self._observe(chunk)
        toks, lps, codes = np.asarray(toks), np.asarray(lps), np.asarray(codes)
        n = chunk.rows
        self._count(decode_calls=1, decode_steps=steps, decode_s=chunk.device_s, decode_slot_steps=n * steps,
                    decode_row_steps=chunk.bucket * steps,
                    decode_kv_tokens=steps * chunk.context + n * steps * (steps + 1) // 2)
        self.decode_log.append((chunk.device_s, n, chunk.context, chunk.host_s, chunk.bucket))
        routing = None if routing is None else np.asarray(routing)
        where = {id(r): s for s, r in enumerate(slots) if r is not None}  # `_compact` may have moved a request
        for s in range(B):
            r = chunk.reqs[s]
            if r is None or id(r) not in where or r.epoch != chunk.epochs[s] or r.finish is not None:
                continue
            done = np.flatnonzero(codes[s])
            n_new = int(done[0]) + 1 if done.size else steps
            if routing is not None:  # step j fed the last context token, position len(context) - 1
                assert r.routed == len(r.prompt) + len(r.generated) - 1, (r.index, r.routed)
                r.routing.append(routing[s, :n_new])
                r.routed += n_new
            r.generated.extend(toks[s, :n_new].tolist())
            r.logprobs.extend(lps[s, :n_new].tolist())
            if done.size:
                r.finish = _FINISH_CODES[int(codes[s, done[0]])]
            lengths[where[id(r)]] += n_new

    def _progress(self, requests: list[_Request], queued: int, running: int) -> None:
        """Calls ``self.progress`` (if set) with this generate's counters so far: the ``stats`` keys,
        plus generated tokens, finished requests, preemptions, queued and running requests; beats
        the stall watchdog (``stall_timeout_s``)."""
        if self._watch is not None:
            self._watch.beat(dict(self.stats, preemptions=self._preemptions, queued=queued, running=running))
        if self.progress is None:
            return
        self.progress(dict(self.stats, generated_tokens=sum(len(r.generated) for r in requests),
                           finished=sum(r.finish is not None for r in requests), requests=len(requests),
                           preemptions=self._preemptions, queued=queued, running=running))

    def _count(self, **amounts) -> None:
        for k, v in amounts.items():
            self.stats[k] += v

    @staticmethod
    def _append(r: _Request, tok: int, lp: float, code: int) -> None:
        r.generated.append(tok)
        r.logprobs.append(lp)
        if code:
            r.finish = _FINISH_CODES[code]


def _on_devices(params: Any, devices: set) -> bool:
    """Whether every leaf is a jax.Array living only on ``devices`` (a jitted reshard can take it)."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(isinstance(x, jax.Array) and x.sharding.device_set <= devices for x in leaves)


def _head_sharding(mesh: jax.sharding.Mesh, cfg: ModelConfig) -> HeadSharding:
    """The tensor axis of a generator mesh, checked: whole query and kv heads per device, and no
    other axis of size > 1 (data-parallel replicas are separate engines)."""
    from fp8rl_jax.parallel import MeshAxis

    axis = MeshAxis.TENSOR.value
    if axis not in mesh.shape:
        raise ValueError(f"a generator mesh needs a {axis!r} axis; got axes {dict(mesh.shape)}")
    others = {a: n for a, n in mesh.shape.items() if a != axis and n > 1}
    if others:
        raise ValueError(f"a generator mesh shards over {axis!r} only; got {others} as well (data-parallel "
                         f"rollout = one engine per replica, each on its own sub-mesh)")
    tp = mesh.shape[axis]
    if cfg.num_heads % tp or cfg.num_kv_heads % tp:
        raise ValueError(f"tensor = {tp} must divide the query heads ({cfg.num_heads}) and the kv heads "
                         f"({cfg.num_kv_heads}): each device holds whole heads and their KV")
    return HeadSharding(mesh, axis)


def _shard_local_quantize(quantize, placed, model_config: ModelConfig, mesh: jax.sharding.Mesh, preset):
    """``quantize`` (params -> params with ``QuantizedWeight``s) jitted to the generator's layout.

    Where every quantized weight keeps its dense spec (block-aligned shards: the TP preset on
    Qwen3 shapes), it runs per shard under ``shard_map``: the Pallas quantization kernel (the GPU
    path) is a custom call XLA cannot partition, so a plain sharded jit would all-gather every
    weight to every device, quantize all of it there and keep one slice. Otherwise (a spec that
    only the FP8 blocks change) the plain jit with output shardings."""
    from flax import nnx

    from fp8rl_jax.parallel import param_shardings, plan_params
    from fp8rl_jax.numerics.fp8 import QuantizedWeight

    abstract = jax.eval_shape(quantize, placed)
    in_specs = plan_params(placed, model_config, mesh, preset).specs
    out_specs = plan_params(abstract, model_config, mesh, preset).specs
    ins = dict(nnx.to_flat_state(in_specs))
    aligned = all(
        (o.q == o.scale_inv == ins[path].get_value()) if isinstance(o, QuantizedWeight) else o == ins[path].get_value()
        for path, var in nnx.to_flat_state(out_specs) for o in [var.get_value()])
    if not aligned:
        return jax.jit(quantize, out_shardings=param_shardings(abstract, model_config, mesh, preset))
    return jax.jit(jax.shard_map(quantize, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False))


# --------------------------------------------------------------------------- jitted device steps
# Module-level, with the model config, policy and length limit static: engines with the same
# settings share compilations (the RL loop, tests and benchmarks build several).


_calibrate = calibrate_kv_scales_jit


def _finish_code(tok, stops, remaining, lengths, max_seq_len: int):
    """1 stop token, 2 max_tokens reached, 3 no room for another token, else 0."""
    is_stop = jnp.any(tok[:, None] == stops, axis=1)
    return jnp.where(is_stop, 1, jnp.where(remaining <= 1, 2, jnp.where(lengths + 1 >= max_seq_len, 3, 0)))


def _forward(params, tokens, *, model_config, policy, cache, num_new, record_routing, logits_at=None):
    """The cached forward; ``(logits, cache, experts or None)``."""
    kw = dict(config=model_config, policy=policy, cache=cache, num_new=num_new, logits_at=logits_at)
    if record_routing:
        return forward_with_routing(params, tokens, **kw)
    logits, cache = forward(params, tokens, **kw)
    return logits, cache, None


@functools.lru_cache(maxsize=32)
def _param_shapes(model_config: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    return {tuple(p): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(abstract_params(model_config))}


def _check_params(model_config: ModelConfig, params: Any) -> None:
    """`JaxEngine.update_weights`' input check (shapes only, host values or tracers): an
    ``nnx.State`` must hold every parameter of ``model_config`` in the Hugging Face layout (dense of
    any float dtype, or FP8 ``QuantizedWeight``), else a ``ValueError`` names the first one missing
    or misshapen. ~6 ms on the host for Qwen3-8B (flattening the State), so the jitted paths run it
    once per input signature (`_checked_prepare`, the mesh's reshard), not on every sync."""
    if not isinstance(params, nnx.State):
        return  # other pytrees go to the prepare step as given
    got = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(params)}
    for path, shape in _param_shapes(model_config).items():
        name = ".".join(map(str, path))
        if path not in got:
            raise ValueError(f"update_weights: parameter {name} is missing (expected shape {shape})")
        have = tuple(getattr(got[path], "shape", ()))
        if have != shape:
            raise ValueError(f"update_weights: parameter {name} has shape {have}, the model expects {shape}")


@functools.lru_cache(maxsize=32)
def _checked_prepare(prepare: Callable[[Any], Any], model_config: ModelConfig) -> Callable[[Any], Any]:
    """``prepare`` jitted behind `_check_params`, which runs at trace time: once per input
    signature, and again for any params of another structure or shape."""

    def run(params):
        _check_params(model_config, params)
        return prepare(params)

    return jax.jit(run)


@functools.lru_cache(maxsize=32)
def _prepare_fn(model_config: ModelConfig, block: tuple[int, int], fp8: bool, fused: bool, experts: bool = True):
    """The trainer's params -> the generator's layout (FP8 quantization and/or projection fusion),
    jitted once per setting and shared by engines (None: params are used as given). ``experts``:
    fuse the MoE experts' gate/up too (else only q/k/v and the dense MLPs' gate/up)."""
    layer_policy = LayerPolicy(block_size=block)
    quantize = functools.partial(quantize_params, config=model_config, layer_policy=layer_policy)
    if fp8 and fused:  # the fused parts quantized straight into their concatenation (no copy)
        concat = functools.partial(quantizing_concat, config=model_config, layer_policy=layer_policy)
        return jax.jit(lambda p: quantize(fuse_params(p, concat=concat)))
    if fp8:
        return jax.jit(quantize)
    if not fused:
        return None
    return jax.jit(fuse_params if experts else functools.partial(fuse_params, concat=_dense_concat))


def _dense_concat(parts: list, paths: list) -> Any:
    """`fuse_params`'s concat that keeps the MoE experts' gate/up separate."""
    return None if "experts" in paths[0] else concat_parts(parts)


@functools.partial(jax.jit, static_argnames=("model_config", "policy", "max_seq_len", "record_routing", "draw",
                                             "truncation"),
                   donate_argnums=(1,))
def _prefill(params, cache, slot_ids, tokens, num_new, sampling, stops, remaining, *, model_config, policy,
             max_seq_len, record_routing=False, draw=Draw.INVERSE_CDF, truncation=None):
    """Prefills rows ``slot_ids`` (out of range for padding rows) and samples their next token;
    with ``record_routing`` also returns the experts of every prefilled position [P, T, L_moe, k]."""
    view = cache.replace(page_table=jnp.take(cache.page_table, slot_ids, axis=0, mode="clip"),
                         lengths=jnp.zeros_like(slot_ids))
    logits, view, experts = _forward(params, tokens, model_config=model_config, policy=policy, cache=view,
                                     num_new=num_new, record_routing=record_routing,
                                     logits_at=jnp.maximum(num_new - 1, 0))
    last = logits[:, 0]
    tok, lp = sample(last, sampling, row_keys(sampling.seed, num_new), draw, truncation)
    code = _finish_code(tok, stops, remaining, num_new, max_seq_len)
    cache = cache.replace(k_pages=view.k_pages, v_pages=view.v_pages,
                          lengths=cache.lengths.at[slot_ids].set(view.lengths, mode="drop"))
    return tok, lp, code, cache, experts


@jax.jit
def _gather_pages(k_pages, v_pages, ids):
    """Pages ``ids`` of every layer's K and V pools: ``[L, len(ids), page_size, K, H]`` each (swap-out)."""
    return jnp.stack([kp[ids] for kp in k_pages]), jnp.stack([vp[ids] for vp in v_pages])


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(cache, ids, k, v):
    """`_gather_pages`' inverse into ``cache``'s pools (swap-in); ids out of range are dropped."""
    return cache.replace(k_pages=tuple(kp.at[ids].set(k[i], mode="drop") for i, kp in enumerate(cache.k_pages)),
                         v_pages=tuple(vp.at[ids].set(v[i], mode="drop") for i, vp in enumerate(cache.v_pages)))


def _pinned_host(devices) -> bool:
    """Whether every device of ``devices`` has pinned host memory (the swap copies' destination)."""
    return all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices)


def _to_host(x: jax.Array) -> Any:
    """``x`` copied to host memory: a pinned-host jax.Array where the backend has that memory (the copy runs
    asynchronously, after the program that makes ``x``), else a NumPy array."""
    if _pinned_host(x.sharding.device_set):
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    return np.asarray(x)


def _to_device(x: Any) -> Any:
    """`_to_host`'s copy back to device memory (NumPy arrays as they are: the program places them)."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, x.sharding.with_memory_kind("device"))
    return x


@jax.jit
def _continue_rows(cont, device, host, src=None):
    """The rows' decode state (tuples of [B] arrays: last token, active, tokens left, cache length): where
    ``cont``, the state the chunk in flight leaves on the device (at its row ``src`` unless None: `_compact`
    moved requests), else the host's. One compiled program: as eager ops these were ~10 programs compiled at a
    generate's first continued chunk (its dispatch took 0.34-0.35 s on the H200, session 26), and `warmup`
    compiles it."""
    take = (lambda x: x) if src is None else (lambda x: jnp.take(x, src, axis=0))  # noqa: E731
    return tuple(jnp.where(cont, take(d), h) for d, h in zip(device, host))


def _decode_steps(params, cache, last, active, sampling, stops, remaining, *, steps, model_config, policy, max_seq_len,
                  record_routing=False, draw=Draw.INVERSE_CDF, truncation=None):
    """``steps`` decode steps for every slot; finished or empty slots write nothing. With
    ``record_routing`` also returns the experts of the token each step fed in [B, steps, L_moe, k].
    The last element is the slots' state after the chunk (last token, still active, tokens left),
    from which the next chunk can start before the host has read this one's tokens."""
    B = last.shape[0]

    def step(j, carry):
        cache, last, active, remaining, out_tok, out_lp, out_code, out_routing = carry
        logits, cache, experts = _forward(params, last[:, None], model_config=model_config, policy=policy,
                                          cache=cache, num_new=active.astype(jnp.int32),
                                          record_routing=record_routing)
        tok, lp = sample(logits[:, 0], sampling, row_keys(sampling.seed, cache.lengths), draw, truncation)
        code = jnp.where(active, _finish_code(tok, stops, remaining, cache.lengths, max_seq_len), 0)
        if record_routing:
            out_routing = out_routing.at[:, j].set(experts[:, 0])
        return (cache, jnp.where(active, tok, last), active & (code == 0), remaining - active,
                out_tok.at[:, j].set(tok), out_lp.at[:, j].set(lp), out_code.at[:, j].set(code), out_routing)

    zeros = jnp.zeros((B, steps), jnp.int32)
    out_routing = None
    if record_routing:
        L, k = len(moe_layers(model_config)), model_config.num_experts_per_tok
        out_routing = jnp.full((B, steps, L, k), -1, jnp.int32)
    carry = (cache, last, active, remaining, zeros, jnp.zeros((B, steps), jnp.float32), zeros, out_routing)
    cache, last, active, remaining, out_tok, out_lp, out_code, out_routing = jax.lax.fori_loop(0, steps, step, carry)
    return out_tok, out_lp, out_code, cache, out_routing, (last, active, remaining)


def _decode_rows(params, cache, last, active, sampling, stops, remaining, *, rows=None, **kw):
    """`_decode_steps` on the first ``rows`` slots only (None: all), the others untouched: their
    outputs are empty (token 0, logprob 0, no finish code, routing -1) and their state is returned as
    given. The slots past ``rows`` must be idle (``active`` False): they are not computed."""
    B = last.shape[0]
    if rows is None or rows >= B:
        return _decode_steps(params, cache, last, active, sampling, stops, remaining, **kw)
    head = lambda x: x[:rows]  # noqa: E731
    view = cache.replace(page_table=cache.page_table[:rows], lengths=cache.lengths[:rows])
    toks, lps, codes, view, routing, state = _decode_steps(
        params, view, head(last), head(active), jax.tree.map(head, sampling), head(stops), head(remaining), **kw)

    def pad(x, fill):
        return jnp.concatenate([x, jnp.full((B - rows, *x.shape[1:]), fill, x.dtype)])

    cache = cache.replace(k_pages=view.k_pages, v_pages=view.v_pages,
                          lengths=jax.lax.dynamic_update_slice(cache.lengths, view.lengths, (0,)))
    state = tuple(jnp.concatenate([new, old[rows:]]) for new, old in zip(state, (last, active, remaining)))
    return (pad(toks, 0), pad(lps, 0.0), pad(codes, 0), cache, None if routing is None else pad(routing, -1),
            state)


_DECODE_JIT = dict(static_argnames=("steps", "model_config", "policy", "max_seq_len", "record_routing", "draw",
                                    "truncation", "rows"), donate_argnums=(1,))
# XLA:GPU's own split-K heuristic, as it runs by default.
_decode_xla_split_k = jax.jit(_decode_rows, **_DECODE_JIT)
# XLA:GPU splits the K of a GEMM whose M x N tiles fill fewer than ~1.5x the SMs into a batched cuBLAS GEMM plus a
# float32 reduction kernel. At decode's 256 rows that is the BF16 o_proj, down_proj and fused q/k/v (session 23's HLO):
# their partial sums make a round trip through HBM, and the reductions took 0.32 ms of an 8B kv step. cuBLAS picks
# its own split-K inside one call instead. This is the program the engine runs.
_decode = jax.jit(_decode_rows, **_DECODE_JIT, compiler_options={"xla_gpu_experimental_force_split_k": 1})


def decode_program():
    """The jitted decode program the engine runs: ``_decode``, or XLA's split-K heuristic
    (``_decode_xla_split_k``) when ``FP8RL_XLA_SPLIT_K=1`` is in the environment (the A/B switch)."""
    return _decode_xla_split_k if os.environ.get("FP8RL_XLA_SPLIT_K", "0") == "1" else _decode
