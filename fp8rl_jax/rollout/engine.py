"""The built-in JAX rollout engine: paged KV cache, continuous batching, multi-step decode.

`JaxEngine` is a facade over four parts, split by job as vLLM's v1 core is:

- `fp8rl_jax.rollout.scheduler`: host bookkeeping of one generate: the request queue, slots,
  admission, preemption, compaction into decode buckets (pure host, no device work);
- `fp8rl_jax.rollout.kv_pool`: the device KV pool: sizing, allocation, sleep/wake, FP8 scales, swap
  space (`fp8rl_jax.rollout.pages` is its host page table);
- `fp8rl_jax.rollout.weights`: weight updates: check, fuse, quantize, reshard onto the engine's mesh;
- `fp8rl_jax.rollout.programs`: the jitted prefill and decode programs and the runner that calls them.

The model is the trainer's model definition under the engine's matmul policy (BF16, or W8A8 with
block-FP8 weights): precision is the only difference between trainer and generator. The engine's
loop admits requests and prefills them, reserves pages (preempting when short), compacts, dispatches a
decode call of ``steps_per_call`` steps and reads the previous call's tokens; with ``overlap_host``
(default) the next call is dispatched from the device state of the one in flight before the host reads
its tokens, so the host's bookkeeping runs while the device decodes. Sampling keys depend only on
(request seed, token position), so batch composition, buckets and preemption never change the tokens.

FP8 KV (precision KV or ALL): every ``update_weights`` marks the scales stale; they are recalibrated
before the next generation, inference-side (``KvCalibration.INFERENCE``, on the first prompts of that
call) or trainer-side (``KvCalibration.TRAINER``: ``set_kv_scales``; until then ``generate`` refuses).
MoE routing replay (``record_routing``): the experts chosen at every position that runs through the
model are recorded per request; a recompute after preemption keeps the first recording and counts its
disagreements. Tensor parallelism (``mesh`` with a ``tensor`` axis): parameters take the
``TENSOR_PARALLEL`` preset, the KV pools split over kv heads, the same programs run partitioned by XLA
and the host loop is unchanged. Without a mesh the engine lives on ``device`` (default: the first), so
several engines can share a host as data-parallel replicas (`fp8rl_jax.rollout.replicas`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from fp8rl_jax.models import ModelConfig, PagedKVCache
from fp8rl_jax.models.calibration import calibrate_kv_scales_jit, calibration_batch
from fp8rl_jax.models.qwen3 import moe_layers
from fp8rl_jax.rollout.base import RolloutBatch
from fp8rl_jax.rollout.config import EngineConfig, KvCalibration
from fp8rl_jax.rollout.kv_pool import KvPool, head_sharding
from fp8rl_jax.rollout.programs import ModelRunner, continue_rows_jit
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.rollout.scheduler import DecodeBatch, Request, Scheduler, make_requests, prefill_bucket
from fp8rl_jax.rollout.watchdog import StallWatchdog
from fp8rl_jax.rollout.weights import WeightSync, generator_policy

__all__ = ["EngineConfig", "JaxEngine", "KvCalibration"]

_STATS = ("prefill_calls", "prefill_tokens", "prefill_s", "decode_calls", "decode_steps", "decode_s",
          "decode_slot_steps", "decode_row_steps", "decode_kv_tokens", "slot_moves", "swap_outs", "swap_ins",
          "swapped_tokens")


@dataclasses.dataclass
class _Chunk:
    """A dispatched decode call: its batch, device outputs (tokens, logprobs, finish codes, routing) and
    end state, when it was dispatched and the host seconds from the last observed completion to its launch."""

    batch: DecodeBatch
    outputs: tuple
    state: tuple
    dispatched: float
    host_s: float
    device_s: float | None = None  # set when the host first waits for it


class JaxEngine:
    """``Generator`` on the one model definition with a paged KV cache (module note).

    Attributes set by a generate: ``stats`` (device-call counts, seconds and tokens), ``decode_log`` (one
    entry per decode call read, in order: device seconds, rows running at its start, context tokens they
    read at its first step, host seconds from the previous call's observed completion to its launch, rows
    the program ran). A call's device seconds run until the host observes its completion, so with
    ``overlap_host`` they include any time the GPU waited for the next launch. Settable: ``progress``
    (called after every device call with a snapshot of the generate's counters) and ``on_stall`` (what the
    stall watchdog does; None: report and exit with code 3).
    """

    def __init__(self, model_config: ModelConfig, params: Any, config: EngineConfig = EngineConfig(), *,
                 mesh: jax.sharding.Mesh | None = None, device: jax.Device | None = None, asleep: bool = False):
        if mesh is not None and device is not None:
            raise ValueError("JaxEngine takes a mesh (tensor parallel) or one device, not both")
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.device = device
        self.heads = head_sharding(mesh, model_config) if mesh is not None else None
        self.max_seq_len = min(config.max_seq_len, model_config.max_position_embeddings)
        self.weight_sync = WeightSync(model_config, config, mesh)
        if config.record_routing and not moe_layers(model_config):
            raise ValueError("EngineConfig.record_routing needs an MoE model; this config has no MoE layer "
                             "(num_experts = 0)")
        self.params = None
        self.stats: dict[str, float] = {}
        self.decode_log: list[tuple[float, int, int, float, int]] = []
        self.progress: Callable[[dict], None] | None = None
        self.on_stall: Callable[[str], None] | None = None
        self._watch: StallWatchdog | None = None
        self._sched: Scheduler | None = None  # of the last generate
        self.update_weights(params)  # first: a fractional KV budget is taken from what the weights leave
        self.runner = ModelRunner(model_config, generator_policy(config, mesh, self.params), self.max_seq_len,
                                  record_routing=config.record_routing, draw=config.sampling_draw, mesh=mesh,
                                  device=device)
        self.pool = KvPool(model_config, config, self.max_seq_len, mesh, self.heads, device)
        if not asleep:
            self.wake()

    # ----------------------------------------------------------------------- parts' state

    @property
    def policy(self) -> Any:
        """The matmul policy the programs run (`fp8rl_jax.rollout.weights.generator_policy`)."""
        return self.runner.policy

    @policy.setter
    def policy(self, policy: Any) -> None:
        self.runner.policy = policy

    @property
    def cache(self) -> PagedKVCache | None:
        """The KV pool's cache (None while asleep)."""
        return self.pool.cache

    @cache.setter
    def cache(self, cache: PagedKVCache) -> None:
        self.pool.cache = cache

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def max_pages(self) -> int:
        """Pages of one ``max_seq_len`` sequence."""
        return self.pool.max_pages

    @property
    def kv_dtype(self) -> Any:
        return self.pool.kv_dtype

    @property
    def fused(self) -> bool:
        """Whether the weights are kept in the fused projection layout (``EngineConfig.fuse_projections``)."""
        return self.weight_sync.fused

    @property
    def last_sync(self) -> dict[str, float]:
        """With a mesh: seconds of the last update's reshard and quantize."""
        return self.weight_sync.last_sync

    @property
    def reshard_path(self) -> str:
        """With a mesh: how the last update moved the params ("jit" or "device_put")."""
        return self.weight_sync.reshard_path

    @property
    def swap_reserve_s(self) -> float | None:
        """Seconds `reserve_swap_space` took (None: not yet run)."""
        return self.pool.swap_reserve_s

    @property
    def sequences_that_fit(self) -> int:
        """Full-length sequences (max_seq_len tokens) the KV pool holds at once."""
        return self.num_pages // self.max_pages

    @property
    def kv_pool_bytes(self) -> int:
        """Device bytes of the KV pool when allocated (all devices of the mesh together)."""
        return self.pool.nbytes

    @property
    def asleep(self) -> bool:
        """Whether the KV pool is freed (`sleep`); the next `generate` or `warmup` allocates it."""
        return self.pool.cache is None

    # ----------------------------------------------------------------------- public interface

    def update_weights(self, params: Any) -> None:
        """Swaps in new parameters (re-quantized to FP8 when the engine runs W8A8); FP8 KV scales
        become stale and are recalibrated (or must be synced) before the next generation. With a
        mesh, the params are first resharded into the generator's layout (``last_sync`` times it)."""
        if self.weight_sync.replaces:
            self.params = None  # the previous copy goes before the new one is built
        if self.device is not None:
            params = jax.device_put(params, self.device)
        self.params = self.weight_sync(params)
        self.kv_scales_fresh = False

    def sleep(self, weights: bool = False) -> None:
        """Frees the KV pool's device memory, e.g. while a colocated trainer runs its step (the role of
        vLLM's sleep mode): the pool is the engine's largest allocation and holds nothing between
        generates. The FP8 KV scales stay, and so does whether they are fresh. `wake` (or the next
        ``generate`` / ``warmup``) allocates a pool of the same shape, so no program recompiles.
        ``weights=True`` also drops the engine's reference to its weights (arrays the caller still holds
        are not touched); ``update_weights`` must come before the next generate. Idempotent."""
        if weights:
            self.params = None
        self.pool.sleep()

    def wake(self) -> None:
        """Allocates the KV pool again after `sleep` (a no-op when awake). Raises a ``RuntimeError``
        that names the pool's size when the device cannot hold it (e.g. the trainer still holds its
        memory); the engine then stays asleep and can be woken later."""
        self.pool.wake()

    def set_kv_scales(self, k_scale: Any, v_scale: Any) -> None:
        """Trainer-side FP8 KV scales ([L] float32 each, from ``calibrate_kv_scales``)."""
        self.pool.set_scales(k_scale, v_scale)
        self.kv_scales_fresh = True

    def reserve_swap_space(self) -> float:
        """Pins ``swap_space_gib`` of host memory for swap preemption, once per engine (a no-op without swap
        space, where the devices have no pinned host memory, or after the first call; ``generate`` and
        ``warmup`` call it) and returns the seconds it took (`fp8rl_jax.rollout.kv_pool.KvPool.reserve_swap_space`)."""
        return self.pool.reserve_swap_space()

    def _need_weights(self) -> None:
        if self.params is None:
            raise RuntimeError("JaxEngine has no weights: sleep(weights=True) dropped them, or the last "
                               "update_weights failed; call update_weights before generating")

    def _bucket(self, n: int) -> int:
        return prefill_bucket(n, self.config.prefill_buckets)

    def warmup(self, min_prompt_len: int = 1, max_prompt_len: int | None = None,
               progress: Callable[[str, float], None] | None = None, recompute: bool = True,
               truncation: bool = False) -> float:
        """Compiles every program a generate can need, without changing the engine's state: the decode loop
        of every row bucket (``EngineConfig.decode_buckets``) and the merge of a continued chunk's state, swap
        preemption's copies (with ``swap_space_gib``), the prefill of every bucket from
        ``bucket(min_prompt_len)`` up to ``bucket(max_seq_len)`` (a sequence recomputed after preemption is
        prefilled at its whole context), and, for FP8 KV with inference-side calibration, the calibration
        forward of the prompt buckets up to ``bucket(max_prompt_len)`` (default ``max_seq_len``). Every call
        is made with padding rows only, which write nothing. ``progress(program, seconds)`` is called after
        each program (compile and one run). ``recompute=False`` stops the prefill buckets at
        ``bucket(max_prompt_len)``: right when no preemption can happen (every request fits at
        ``max_seq_len`` at once, see ``sequences_that_fit``). The programs are those of calls without
        top-k / top-p rows; ``truncation=True`` compiles those of calls with such rows too. Returns the
        seconds spent."""
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

        run, put = self.runner, self.runner.put
        lo, hi = self._bucket(min_prompt_len), self._bucket(self.max_seq_len if recompute else top)
        buckets = sorted({b for b in self.config.prefill_buckets if lo <= b <= hi} | {hi})
        P, B = self.config.prefill_batch, self.config.max_slots
        for trunc in (False, True) if truncation else (False,):
            tag = " (top-k/top-p)" if trunc else ""
            rows = run.row_inputs([None] * P)
            for T in buckets:  # padding rows: slot ids out of range, no token to write
                out = run.prefill(self.params, self.cache, *put((np.full((P,), B, np.int32), np.zeros((P, T), np.int32),
                                                                 np.zeros((P,), np.int32))), *rows, truncation=trunc)
                self.cache = out[3]
                done(f"prefill {P}x{T}{tag}", out)
            rows = run.row_inputs([None] * B)
            for R in self.config.decode_rows:
                out = run.decode(self.params, self.cache, *put((np.zeros((B,), np.int32), np.zeros((B,), bool))),
                                 *rows, steps=self.config.steps_per_call, truncation=trunc, rows=R)
                self.cache = out[3]
                done(f"decode {R}x{self.config.steps_per_call}{tag}", out)
        # the merge of a continued chunk's device state with the host's rows (`_dispatch_decode`), as it runs
        cont, src = put((np.zeros((B,), bool), np.zeros((B,), np.int32)))
        state = (*put((np.zeros((B,), np.int32), np.zeros((B,), bool), np.zeros((B,), np.int32))), self.cache.lengths)
        for moved in (None, src):
            done(f"decode continuation{' (moved rows)' if moved is not None else ''}",
                 continue_rows_jit(cont, state, state, moved))
        if self.config.swap_space_gib > 0:
            done("swap copies", self.pool.warm_swap_copies())
            self.reserve_swap_space()
            done("swap space pinned", self.cache)
        if self.config.fp8_kv and self.config.kv_calibration is KvCalibration.INFERENCE:
            n = self.config.kv_calibration_prompts
            for T in (b for b in buckets if b <= self._bucket(top)):
                done(f"kv calibration {n}x{T}",
                     self._calibrate(*put((np.zeros((n, T), np.int32), np.zeros((n,), np.int32)))))
        return time.perf_counter() - t0

    def _calibrate(self, tokens: jax.Array, lengths: jax.Array) -> tuple:
        return calibrate_kv_scales_jit(self.params, tokens, lengths, config=self.model_config, policy=self.policy,
                                       percentile=self.config.kv_percentile, margin=self.config.kv_margin)

    def _ensure_kv_scales(self, requests: list[Request]) -> None:
        if not self.config.fp8_kv or self.kv_scales_fresh:
            return
        if self.config.kv_calibration is KvCalibration.TRAINER:
            raise RuntimeError("FP8 KV scales are stale after update_weights: with trainer-side calibration the "
                               "trainer must call calibrate_kv_scales and set_kv_scales first")
        self.set_kv_scales(*self.measure_kv_scales([r.prompt for r in requests]))

    def measure_kv_scales(self, prompts: Sequence[Sequence[int]]) -> tuple[jax.Array, jax.Array]:
        """Inference-side FP8 KV scales ``(k, v)`` ([L] float32 each) of the current weights, measured on
        the first ``kv_calibration_prompts`` of ``prompts`` (what ``generate`` does when they are stale)."""
        self._need_weights()
        prompts = list(prompts[: self.config.kv_calibration_prompts])
        # one compiled calibration per prompt bucket, whatever the batch size
        tokens, lengths = calibration_batch(prompts, self.config.kv_calibration_prompts,
                                            self._bucket(max(len(p) for p in prompts)))
        return self._calibrate(*self.runner.put((tokens, lengths)))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig]
                 ) -> RolloutBatch:
        """Generates for every prompt (``sampling``: one config, or one per prompt). Bad input (empty prompt,
        ids outside the vocabulary, a prompt that cannot fit, bad sampling settings) raises ``ValueError``
        naming the request before anything runs."""
        requests = make_requests(prompts, sampling, self.model_config, self.config, self.max_seq_len, self.num_pages)
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
                            [r.finish for r in requests], self._sched.preemptions, routing=routing,
                            routing_recompute_mismatches=self._sched.routing_mismatches)

    def _routing_array(self, requests: list[Request]) -> np.ndarray:
        """[N, S, L_moe, k] int32 over prompt + generated positions, -1 where nothing was recorded."""
        L, k = len(moe_layers(self.model_config)), self.model_config.num_experts_per_tok
        S = max(len(r.context) for r in requests)
        out = np.full((len(requests), S, L, k), -1, np.int32)
        for i, r in enumerate(requests):
            if r.routed:
                out[i, : r.routed] = np.concatenate(r.routing, axis=0)
        return out

    # ----------------------------------------------------------------------- the loop

    def _run(self, requests: list[Request]) -> None:
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

    def _run_loop(self, requests: list[Request]) -> None:
        steps = self.config.steps_per_call
        sched = self._sched = Scheduler(requests, self.config, self.max_seq_len, self.num_pages, self.max_pages)
        self.stats = dict.fromkeys(_STATS, 0)
        self.pool.swap_bytes = 0
        self.decode_log = []
        # device work completes in dispatch order: each call's device time runs from the later of its
        # dispatch and the previous call's observed completion to its own (`_completed`)
        self._clock = time.perf_counter()
        pending: _Chunk | None = None  # a decode call dispatched but not read yet (overlap_host)
        while sched.busy or pending is not None:
            group = []
            for slot, r in sched.admit():
                if r.swapped is not None:  # its KV comes back from host memory: no prefill
                    self.pool.swap_in(r.swapped, sched.pages.pages[slot])
                    r.swapped = None
                    self._count(swap_ins=1)
                else:
                    group.append(slot)
            if group and pending is not None:  # its device time ends before the prefill's starts
                self._observe(pending)
            for start in range(0, len(group), self.config.prefill_batch):
                self._prefill(sched, group[start : start + self.config.prefill_batch])
                self._progress(requests, len(sched.queue), len(group))
            sched.release_finished()
            chunk = None
            if sched.running:
                # pages for the coming call, and for the one in flight (which may add ``steps`` tokens first)
                sched.reserve(steps * (2 if pending is not None else 1), self._swap_out)
                if sched.running:
                    self._count(slot_moves=sched.compact())
                    chunk = self._dispatch_decode(sched, pending)
            if not self.config.overlap_host:  # read the call just dispatched now (nothing is in flight)
                pending, chunk = chunk, None
            if pending is not None:
                self._finish_decode(sched, pending)
                self._progress(requests, len(sched.queue), sched.running)
                sched.release_finished()
            pending = chunk

    def _swap_out(self, r: Request, page_ids: list[int], tokens: int) -> None:
        """A preempted request's KV to host memory if the swap space has room (else it is recomputed)."""
        r.swapped = self.pool.swap_out(page_ids, tokens)
        if r.swapped is not None:
            self._count(swap_outs=1, swapped_tokens=tokens)

    def _prefill(self, sched: Scheduler, slots: list[int]) -> None:
        batch = sched.prefill_batch(slots)
        P = self.config.prefill_batch
        rows = self.runner.row_inputs(batch.reqs + [None] * (P - len(batch.reqs)))
        # the page table only: the other slots' lengths are the device's (a decode call may be in flight)
        self.cache = self.cache.replace(page_table=self.runner.put(sched.pages.table))
        t0 = time.perf_counter()
        tok, lp, code, self.cache, routing = self.runner.prefill(
            self.params, self.cache, *self.runner.put((batch.slot_ids, batch.tokens, batch.num_new)), *rows,
            truncation=self.runner.truncation(batch.reqs))
        self._count(prefill_calls=1, prefill_tokens=int(batch.num_new.sum()),
                    prefill_s=self._completed((tok, lp, code), t0))
        sched.update_from_prefill(batch, np.asarray(tok), np.asarray(lp), np.asarray(code),
                                  None if routing is None else np.asarray(routing))

    def _dispatch_decode(self, sched: Scheduler, pending: _Chunk | None) -> _Chunk:
        """Dispatches ``steps_per_call`` decode steps for the slots' requests, without waiting; rows that
        continue from ``pending`` start from the state it leaves on the device (`Scheduler.decode_batch`)."""
        batch = sched.decode_batch(None if pending is None else pending.batch)
        put = self.runner.put
        sampling, stops, remaining = self.runner.row_inputs(batch.reqs)
        host_lengths, host_last, host_active = put((np.asarray(batch.lengths), batch.last, batch.active))
        if batch.continues.any():
            last, active, remaining, cache_lengths = continue_rows_jit(
                put(batch.continues), (*pending.state, self.cache.lengths),
                (host_last, host_active, remaining, host_lengths),
                put(np.maximum(batch.src, 0)) if batch.moved else None)
        else:
            last, active, cache_lengths = host_last, host_active, host_lengths
        self.cache = self.cache.replace(page_table=put(batch.page_table), lengths=cache_lengths)
        t0 = time.perf_counter()
        toks, lps, codes, self.cache, routing, state = self.runner.decode(
            self.params, self.cache, last, active, sampling, stops, remaining, steps=self.config.steps_per_call,
            truncation=self.runner.truncation(batch.reqs), rows=batch.rows)
        return _Chunk(batch, (toks, lps, codes, routing), state, t0, time.perf_counter() - self._clock)

    def _finish_decode(self, sched: Scheduler, chunk: _Chunk) -> None:
        """Reads a dispatched call's outputs into its requests (`Scheduler.update_from_decode`)."""
        steps, batch = self.config.steps_per_call, chunk.batch
        toks, lps, codes, routing = chunk.outputs
        self._observe(chunk)
        n = batch.running
        self._count(decode_calls=1, decode_steps=steps, decode_s=chunk.device_s, decode_slot_steps=n * steps,
                    decode_row_steps=batch.rows * steps,
                    decode_kv_tokens=steps * batch.context + n * steps * (steps + 1) // 2)
        self.decode_log.append((chunk.device_s, n, batch.context, chunk.host_s, batch.rows))
        sched.update_from_decode(batch, np.asarray(toks), np.asarray(lps), np.asarray(codes),
                                 None if routing is None else np.asarray(routing))

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
        """Waits for a decode call once, keeping its device seconds (`_completed`)."""
        if chunk.device_s is None:
            chunk.device_s = self._completed(chunk.outputs, chunk.dispatched)

    def _progress(self, requests: list[Request], queued: int, running: int) -> None:
        """Calls ``self.progress`` (if set) with this generate's counters so far: the ``stats`` keys,
        plus generated tokens, finished requests, preemptions, queued and running requests; beats
        the stall watchdog (``stall_timeout_s``)."""
        preemptions = self._sched.preemptions
        if self._watch is not None:
            self._watch.beat(dict(self.stats, preemptions=preemptions, queued=queued, running=running))
        if self.progress is None:
            return
        self.progress(dict(self.stats, generated_tokens=sum(len(r.generated) for r in requests),
                           finished=sum(r.finish is not None for r in requests), requests=len(requests),
                           preemptions=preemptions, queued=queued, running=running))

    def _count(self, **amounts) -> None:
        for k, v in amounts.items():
            self.stats[k] += v
