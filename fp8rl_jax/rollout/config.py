"""The JAX engine's configuration: sizing, precision and scheduling knobs (`EngineConfig`)."""

from __future__ import annotations

import dataclasses
import enum

from fp8rl_jax.fields import check_field_types
from fp8rl_jax.models.policy import Fp8Mode
from fp8rl_jax.quant.policy import GemmBackend
from fp8rl_jax.rollout.sampling import Draw


class KvCalibration(enum.Enum):
    """Where FP8 KV scales come from after each weight update."""

    INFERENCE = "inference"  # the engine measures them on the first prompts it serves
    TRAINER = "trainer"  # the trainer measures them on a calibration batch and syncs them


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizing, precision and scheduling.

    Attributes:
      max_slots: sequences decoded together (the largest decode batch); raise it for throughput while
        the KV pool holds that many sequences.
      page_size: tokens per KV page.
      num_pages: pages in the pool; 0 (default) derives it from ``kv_budget_fraction`` or ``kv_budget_gib``.
      kv_budget_gib: KV pool size in GiB per device, when ``num_pages`` and ``kv_budget_fraction`` are 0.
      kv_budget_fraction: if > 0, the pool takes this fraction of the device memory still free once the
        weights are placed (GPU only); leave room for activations, e.g. 0.85.
      max_seq_len: prompt + generated tokens per sequence (capped by the model's positions).
      steps_per_call: decode steps per device call (one host round trip each).
      prefill_batch: prompts per prefill call.
      prefill_buckets: padded prompt lengths, one compiled prefill each (`warmup` compiles them). Above
        2048 they step by 1.5x and 4/3x so that long recompute prefills after preemption pad little.
      precision: FP8 mode: NONE, W8A8 (FP8 linears), KV (FP8 KV cache) or ALL.
      dtype: compute dtype of everything not in FP8.
      kv_calibration: where FP8 KV scales come from after a weight update (`KvCalibration`).
      kv_calibration_prompts: prompts used by inference-side calibration.
      kv_percentile, kv_margin: scale = percentile(|x|) * margin / 448.
      fp8_block: FP8 weight block (rows, cols) of W8A8; activations are grouped 1 x cols. The Pallas
        GEMMs need (128, 128) (the default, the HF/vLLM convention); smaller blocks run the reference.
      record_routing: MoE models only: record the experts chosen at every position and return them as
        ``RolloutBatch.routing`` for routing replay in the trainer (costs a device-to-host transfer per call).
      stall_timeout_s: if > 0, a generate that makes no progress for this long reports its state and every
        thread's stack and exits with code 3 (`fp8rl_jax.rollout.watchdog`); set it above the longest
        compile a generate may do (or `warmup` first), e.g. 300. 0 (default): off.
      overlap_host: dispatch each decode call before the host reads the previous one's tokens, so host
        bookkeeping overlaps device work (same tokens either way). Turn off only to debug the loop.
      fuse_projections: keep q/k/v and MLP gate/up as one GEMM each (``fp8rl_jax.models.fusion``): fewer,
        wider GEMMs at decode sizes. None (default): on for one device (BF16 experts stay separate);
        True: the experts too. Not with a mesh.
      fp8_gemm: the dense FP8 GEMM backend on the GPU (`fp8rl_jax.quant.policy.GemmBackend`); AUTO picks
        per shape from the measured tables (``FP8RL_FP8_GEMM`` overrides).
      fused_cast: the BF16 GEMMs write BF16 themselves instead of float32 that a convert kernel rounds
        (same numbers, one kernel and one float32 write less per GEMM). Default on.
      decode_buckets: the row counts a decode call may run, one compiled program each; a call runs the
        smallest holding every occupied slot (``max_slots`` is always one). Empty (default): the powers
        of two from 16 below ``max_slots``. Results do not depend on them.
      swap_space_gib: host memory (GiB) for the KV of preempted sequences: their pages are copied out and
        back instead of recomputed by a prefill (same results); preemption recomputes when it is full.
        Pinned once, at the first `warmup` or `generate`. 0 (default): recompute only.
      sampling_draw: how sampled rows draw their token (`fp8rl_jax.rollout.sampling.Draw`): inverse CDF
        (default, one uniform per row) or Gumbel-max; the same distribution, other tokens for a seed.
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
        check_field_types(self)
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
