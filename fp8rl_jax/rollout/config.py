"""The JAX engine's configuration: sizing, precision and scheduling knobs (`EngineConfig`)."""

from __future__ import annotations

import dataclasses
import enum

from fp8rl_jax.models.policy import Fp8Mode
from fp8rl_jax.quant.policy import GemmBackend
from fp8rl_jax.rollout.sampling import Draw


class KvCalibration(enum.Enum):
    """Where FP8 KV scales come from after each weight update."""

    INFERENCE = "inference"  # the engine measures them on the first prompts it serves
    TRAINER = "trainer"  # the trainer measures them on a calibration batch and syncs them


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizing and precision.

    Attributes:
      max_slots: sequences decoded together (the decode batch).
      page_size: tokens per KV page.
      num_pages: pages in the pool; 0 derives it from ``kv_budget_gib``.
      kv_budget_gib: KV pool size in GiB (per device) when ``num_pages`` is 0.
      kv_budget_fraction: if > 0 (and ``num_pages`` is 0), the KV pool takes this fraction of the
        device memory still free once the weights are placed (allocator limit minus bytes in
        use; GPU only), instead of ``kv_budget_gib``. Leave room for activations: e.g. 0.85.
      max_seq_len: prompt + generated tokens per sequence (capped by the model's positions).
      steps_per_call: decode steps per host round trip.
      prefill_batch: prompts per prefill call.
      prefill_buckets: padded prompt lengths (one compilation each). Above 2048 they step by 1.5x and 4/3x
        rather than 2x: a preempted sequence's recompute prefills its whole context (W2 on the H200: 25
        sequences of ~5.3-6k tokens, 160k tokens), and at powers of two their rows were padded to 8192, ~30%
        of the call's GEMM rows (session 26; untimed). Each bucket costs a compile in `warmup`.
      precision: FP8 mode: NONE, W8A8 (FP8 linears), KV (FP8 KV cache) or ALL.
      dtype: compute dtype of everything not in FP8.
      kv_calibration: where FP8 KV scales come from after a weight update.
      kv_calibration_prompts: prompts used by inference-side calibration.
      kv_percentile, kv_margin: scale = percentile(|x|) * margin / 448.
      fp8_block: FP8 weight block (rows, cols) of W8A8; activations are grouped 1 x cols. The
        Pallas GEMMs need (128, 128) (the default, the HF/vLLM convention); smaller blocks run
        the reference (tests of sharded FP8 on tiny models).
      record_routing: MoE models only: record the experts chosen at every prompt and generated
        position and return them as ``RolloutBatch.routing`` for routing replay in the trainer
        (off by default: it costs a [rows, T, L_moe, k] int32 transfer per device call).
      stall_timeout_s: if > 0, a generate whose prefill groups and decode chunks stop completing
        for this long reports its last progress and every thread's stack and exits the process
        with code 3 (`fp8rl_jax.rollout.watchdog`): a device program that never finishes blocks
        the host inside XLA, beyond any exception, and would hang the job silently. Set it above
        the longest compile a generate may do (8B on the H200: ~30 s; `warmup` first avoids
        them), e.g. 300. 0 (default): off.
      overlap_host: dispatch each decode chunk before the host reads the previous one's tokens, so
        the host's bookkeeping (appending tokens, finishing and admitting requests, page tables)
        runs while the device decodes instead of between device calls. The tokens are the same
        either way (sampling keys depend on request seed and position only); a slot freed by a
        finished request is refilled one chunk later, and pages are reserved two chunks ahead.
      fuse_projections: keep the weights in the generator's fused layout, q/k/v as one GEMM and
        MLP gate/up as one (``fp8rl_jax.models.fusion``): fewer, wider GEMMs at decode sizes and one
        activation quantization per fused group. None (default): on, on one device; for BF16
        weights q/k/v and the dense MLPs' gate/up only (the BF16 experts' fused grouped GEMM is
        untimed). BF16 weights then cost a copy per update (the previous copy is freed first), for
        a faster step: XLA merges separate BF16 q/k/v dots into one Triton fusion that concatenates
        the weights on the fly, 1.45 ms of a Qwen3-8B decode step at 256 rows against 0.79 on cuBLAS
        fused (H200, session 15: step 17.89 -> 17.24 ms in mode kv). True: the experts too. Not with
        a mesh.
      fp8_gemm: the dense FP8 GEMM on the GPU (`fp8rl_jax.quant.policy.GemmBackend`): our Mosaic
        kernel, our Triton kernel or cuBLASLt's block-scaled FP8 (``fp8rl_jax.quant.cublaslt``); AUTO reads
        ``FP8RL_FP8_GEMM``, else the Triton kernel where its measured table found it faster for the shape
        (``fp8rl_jax/quant/fp8_gemm_triton.json``; H200: Qwen3-8B's q/k/v, o_proj and gate/up at up to 64
        rows), else the faster of the other two measured for the shape on this device kind
        (``fp8rl_jax/quant/fp8_gemm_backends.json``), else that table's default for the device kind
        (cuBLASLt on the H200), else the Mosaic kernel.
      fused_cast: the BF16 GEMMs (every linear of a BF16 generator, lm_head and router beside FP8 ones)
        write BF16 themselves (`DensePolicy.fused_cast`) instead of float32 that a convert kernel then
        rounds: the same float32 accumulation and rounding, without a kernel and a float32 write per GEMM
        (H200, Qwen3-8B at 256 rows, session 17 A/B on one machine: none step 22.70 -> 22.11 ms, kv
        17.04 -> 16.62). Default on.
      decode_buckets: the row counts a decode call may run (each one compiled program); a call runs the
        smallest that holds every occupied slot, and ``max_slots`` is always one. Empty (default): the
        powers of two from 16 below ``max_slots``. Results do not depend on them (rows are independent).
        Why: a decode step's GEMMs read the weights once whatever the rows, but at 256 rows BF16 they are
        compute-bound; vLLM likewise runs CUDA graphs captured at the batch size in use.
      swap_space_gib: host memory (GiB) for the KV of preempted sequences (vLLM's ``swap_space``): a
        preempted sequence's pages go to host memory and come back into new pages when it is readmitted,
        instead of a prefill recomputing its whole context; preemption recomputes when the space is full.
        0 (default): recompute only. Why: W2 on the H200 recomputes 25 sequences of ~5.8k tokens in BF16, 5-6 s
        of prefill in a 166 s run, where the copies move ~0.9 GB each way per sequence. Results are the same
        either way (tokens and logprobs: decode continues from the same KV). On a GPU the space is pinned once,
        at the first ``warmup`` or ``generate`` (`JaxEngine.reserve_swap_space`), as vLLM allocates its swap
        space at start: XLA's pinned-host allocator grows by doubling regions, and pinning each new one inside
        a run stalled it (H200 session 27: 0.4 -> 8 s per growth, ~16 s of a 174 s W2 run).
      sampling_draw: how sampled rows draw their token (`fp8rl_jax.rollout.sampling.Draw`): the inverse
        CDF (default: one uniform per row) or Gumbel-max (V threefry numbers per row): the same
        distribution, other tokens for a seed. H200, Qwen3-8B kv decode at 256 rows (session 19, one
        machine): 16.30 ms per step against Gumbel's 16.52. Greedy rows and the logprobs do not depend on it.
    """

    max_slots: int = 32
    page_size: int = 16
    num_pages: int = 0
    kv_budget_gib: float = 1.0
    kv_budget_fraction: float = 0.0
    max_seq_len: int = 4096
    steps_per_call: int = 8
    prefill_batch: int = 4
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384,
                                        24576, 32768)
    precision: Fp8Mode = Fp8Mode.NONE
    dtype: str = "bfloat16"
    kv_calibration: KvCalibration = KvCalibration.INFERENCE
    kv_calibration_prompts: int = 16
    kv_percentile: float = 99.9
    kv_margin: float = 1.05
    record_routing: bool = False
    fp8_block: tuple[int, int] = (128, 128)
    stall_timeout_s: float = 0.0
    overlap_host: bool = True
    fuse_projections: bool | None = None
    fp8_gemm: GemmBackend = GemmBackend.AUTO
    fused_cast: bool = True
    sampling_draw: Draw = Draw.INVERSE_CDF
    decode_buckets: tuple[int, ...] = ()
    swap_space_gib: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_slots", "page_size", "max_seq_len", "steps_per_call", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 0 or (self.num_pages == 0 and self.kv_budget_gib <= 0 and not self.kv_budget_fraction):
            raise ValueError("EngineConfig needs num_pages > 0, kv_budget_gib > 0 or kv_budget_fraction > 0")
        if not 0 <= self.kv_budget_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_budget_fraction must be in [0, 1], got {self.kv_budget_fraction}")
        if not isinstance(self.precision, Fp8Mode):
            raise ValueError(f"EngineConfig.precision must be an Fp8Mode, got {self.precision!r}")
        if not isinstance(self.fp8_gemm, GemmBackend):
            raise ValueError(f"EngineConfig.fp8_gemm must be a GemmBackend, got {self.fp8_gemm!r}")
        if not isinstance(self.sampling_draw, Draw):
            raise ValueError(f"EngineConfig.sampling_draw must be a Draw, got {self.sampling_draw!r}")
        if not isinstance(self.kv_calibration, KvCalibration):
            raise ValueError(f"EngineConfig.kv_calibration must be a KvCalibration, got {self.kv_calibration!r}")
        b = self.fp8_block
        if not (isinstance(b, tuple) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
            raise ValueError(f"EngineConfig.fp8_block must be a pair of positive ints, got {b!r}")
        if not 0 < self.kv_percentile <= 100 or self.kv_margin <= 0 or self.kv_calibration_prompts < 1:
            raise ValueError("EngineConfig needs 0 < kv_percentile <= 100, kv_margin > 0, kv_calibration_prompts >= 1")
        if not self.swap_space_gib >= 0:
            raise ValueError(f"EngineConfig.swap_space_gib must be >= 0 (0: recompute only), got {self.swap_space_gib}")
        if not self.stall_timeout_s >= 0:
            raise ValueError(f"EngineConfig.stall_timeout_s must be >= 0 (0: off), got {self.stall_timeout_s}")
        if not isinstance(self.decode_buckets, tuple) or not all(
                isinstance(b, int) and 1 <= b <= self.max_slots for b in self.decode_buckets):
            raise ValueError(f"EngineConfig.decode_buckets must be a tuple of ints in [1, max_slots = "
                             f"{self.max_slots}], got {self.decode_buckets!r}")

    @property
    def decode_rows(self) -> tuple[int, ...]:
        """The decode buckets in use, ascending, ``max_slots`` last (`decode_buckets`)."""
        chosen = self.decode_buckets or tuple(1 << i for i in range(4, self.max_slots.bit_length())
                                              if 1 << i < self.max_slots)
        return tuple(sorted(set(chosen) | {self.max_slots}))

    @property
    def fp8_kv(self) -> bool:
        return self.precision.fp8_kv
