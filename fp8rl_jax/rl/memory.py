"""The memory plan of an RL run: per-device bytes of every buffer, per phase, before anything is allocated.

Design note
-----------
:func:`plan_memory` maps an ``RLConfig``, a device count and the HBM of one device to a
:class:`MemoryPlan`: exact shard sizes where they are known from shapes (``abstract_params`` and
the sharding rules' ``plan_params`` on a ``MeshConfig``, no device touched), and a stated model
where they depend on what XLA keeps (activations). Four phases, each a sum of terms per device:

* **rollout**: the trainer's resident state (float32 masters, AdamW ``mu``/``nu``), the
  generator's weight copy, its KV pool and its decode/prefill workspace.
* **logprobs** (the trainer's forward for ``old_logprobs``) and **update** (the train step):
  the resident state, the compute-dtype weight copy, under FSDP two layers' gathered weights, the
  micro-batch's activations and the batch arrays; the update adds the float32 gradients. The
  generator's weights and KV pool are gone when ``rollout.sleep_while_training``, else they stay.
* **sync** (the weight update): the resident state, the trainer's compute-dtype cast of the
  masters, the copy the generator receives (gathered to each replica) and its new FP8/BF16 copy;
  the KV pool stays unless the generator sleeps.

Terms (per device; ``P_dev`` = a device's share of the parameters under the trainer's rules:
``fsdp`` shards every array's largest divisible dim, ``tensor`` the heads/FFN/vocab, ``expert`` the
experts; a rule that cannot split replicates, and is counted replicated):

* masters ``4 P_dev``; AdamW ``8 P_dev`` (``mu``, ``nu`` float32; with ``offload_optimizer`` they live
  in host memory and the update streams them through the device a decoder layer at a time, ``rl.offload``:
  two layers' moments on the device, one in use and the next arriving);
* gradients ``8 P_dev``: the float32 accumulator of the micro-batch ``scan``, and as much again for
  one micro-batch's gradient or the optimizer's update tree (both transient, not at once);
* compute copy ``2 P_dev`` (BF16), and under FSDP 2 x the largest layer gathered (one in use, one
  prefetched) in BF16;
* generator weights: the W8A8 linears as E4M3 codes (1 byte) plus float32 ``scale_inv`` per
  128 x 128 block, everything else (embeddings, lm_head, norms, router) BF16; all BF16 without FP8
  weights; split over ``generator_tensor`` by the tensor-parallel rules;
* KV pool: ``num_pages`` pages of ``2 L page_size K H`` bytes (E4M3 or BF16) over ``generator_tensor``
  devices, plus the page table and the ``[L]`` float32 K/V scales. Sized as the engine sizes it:
  ``num_pages``, else ``kv_budget_fraction`` of what the rollout phase leaves, else
  ``kv_budget_gib``; the plan also reports what is left for it (``kv_room_bytes``);
* generator workspace: ``3 x max_slots x V`` float32 (logits and the sampler's copies) plus one
  layer's activations (below) for ``prefill_batch`` prompts of the longest prompt
  (``max_seq_len - max_new_tokens``; prefill attention is the flash kernel: linear in T);
* runtime reserve ``RESERVE_BYTES + RESERVE_FRACTION x HBM``: the CUDA context, cuBLAS(Lt)
  workspaces, NCCL buffers, executables' constants and the allocator's fragmentation. A round
  allowance, not a measurement.

Activation model (a micro-batch of ``b`` sequences padded to ``T = engine.max_seq_len`` tokens, the
longest a rollout can return; ``c`` = compute-dtype bytes; ``N, K, F, I, V`` divided by
``tensor`` where the rules split them). Per token and layer the backward keeps
``A = c (4 D + 3 (N + K) H + 3 F)`` (residual stream, norm outputs, q/k before and after norm +
RoPE, v, attention output, gate, up, their product); an MoE layer replaces ``3 F`` by
``k (2 D + 3 I)`` (the k dispatched copies of x, gate, up, product, down) plus ``8 E`` (router
logits and softmax, float32). The trainer's attention is ``models.attention.causal_attention``: up to
``QUERY_BLOCK`` tokens it materializes ``[b, N, T, T]`` scores, so each layer also holds
``ATT_SAVED = 14`` bytes per score for the backward (float32 logits, their masked copy, float32
softmax, compute-dtype probabilities); longer sequences go ``QUERY_BLOCK`` queries at a time under
``jax.checkpoint``, so only one block's ``[b, N, QUERY_BLOCK, T]`` scores are alive, in the forward
and in the backward, and none are saved. With ``S = min(T, QUERY_BLOCK)`` scores per query alive:

* ``remat``: ``L b T D c`` saved + the largest of one layer recomputed with its backward,
  ``b T (A + ATT_REMAT N S)`` (``ATT_REMAT = 16``), and the LM-head block
  ``min(logits_chunk, b T) V x 4 x copies`` (the chunk counts tokens across rows): float32 logits, softmax and cotangent
  (``HEAD_COPIES = 3``), 2 when chunked (``HEAD_COPIES_CHUNKED``: each chunk is rematerialized);
* no ``remat``: ``b T (sum over layers of A + ATT_SAVED N T)`` + the larger of the last layer's
  backward ``b T (A + ATT_BWD N T)`` (``ATT_BWD = 8``: float32 cotangents) and the head block; past
  ``QUERY_BLOCK`` no scores are saved and the backward's are one block's, ``b T ATT_REMAT N S``;
* both: ``b T (D (c + 4) + S)`` for the final hidden states, their cotangent and the boolean causal
  mask (``[T, T]``, or one block's).
* logprob pass (forward only): ``b T (A + ATT_FWD N S)`` (``ATT_FWD = 7``) or the head block with
  ``HEAD_COPIES_FWD = 1``, whichever is larger, + ``b T (2 D c + S)``.

The coefficients come from XLA's buffer assignment (``memory_analysis().temp_size_in_bytes``) of the
trainer's step and logprob pass compiled for the CPU at small shapes (D = 256, remat and not,
T = 256..1024, V = 2k..32k): with the compute copy added, the model's totals are within 3% of them
where the scores dominate (T = 1024) and above them by up to 18% (update) and 35% (logprob pass) at
the smallest shapes, where fixed terms weigh more. The GPU compiler fuses differently,
and the plan is to be held against measured peaks there (``memory_stats()['peak_bytes_in_use']``).
The blocked attention keeps the scores linear in T: for one Qwen3-8B sequence at T = 22528 one block
is ~3 GiB (dense ``T^2`` scores would be ~240 GiB per layer's backward). Micro-batches are whole
padded sequences: the plan picks the largest ``b`` dividing the per-device batch that
fits (a token budget of ``b T`` per device, verl's ``ppo_max_token_len_per_gpu``) separately for the
logprob pass and the update, assuming each micro-batch is split evenly over the batch shards.
Not modeled: XLA's involuntary full gathers under FSDP (``rl.sharded``'s note), FP8 training's
per-GEMM copies (``precision.train_fp8`` is planned as BF16), the value head (``D + 1`` floats).
The vLLM backend is one term, ``rollout.vllm_memory`` of the HBM, in every phase.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.models.attention import QUERY_BLOCK
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.qwen3 import abstract_params
from fp8rl_jax.numerics.fp8 import QuantizedWeight
from fp8rl_jax.parallel.mesh import MeshConfig
from fp8rl_jax.parallel.rules import ShardingFallbackWarning, ShardingPreset, plan_params
from fp8rl_jax.quant.policy import LayerPolicy, site_of
from fp8rl_jax.rl.config import ConfigError, RLConfig, RolloutBackend, override
from fp8rl_jax.rl.offload import group_of
from fp8rl_jax.rl.sharded import mesh_rules

GIB = 2**30
RESERVE_BYTES = 2 * GIB  # CUDA context, library workspaces, NCCL buffers, executables
RESERVE_FRACTION = 0.05  # the allocator's fragmentation, per byte of HBM
ATT_SAVED, ATT_REMAT, ATT_BWD, ATT_FWD = 14, 16, 8, 7  # bytes per attention score (module note)
HEAD_COPIES, HEAD_COPIES_CHUNKED, HEAD_COPIES_FWD = 3, 2, 1  # float32 [b, chunk, V] blocks alive in the LM head
PHASES = ("rollout", "logprobs", "update", "sync")
TERMS: dict[str, str] = {  # term -> its row label in the table
    "masters": "float32 master weights",
    "optimizer": "AdamW mu + nu (float32)",
    "gradients": "float32 gradients (accumulator + one more)",
    "compute_copy": "compute-dtype weight copy",
    "gathered": "FSDP-gathered weights (2 layers)",
    "activations": "activations of one micro-batch",
    "batch": "batch arrays (tokens, masks, routing)",
    "offload_stream": "optimizer moments streamed from host (2 layers)",
    "sync_copy": "weights handed to the generator",
    "generator": "generator weight copy",
    "kv_pool": "KV pool",
    "workspace": "generator decode + prefill workspace",
    "vllm": "vLLM (rollout.vllm_memory)",
    "reserve": "runtime reserve (CUDA, XLA, NCCL)",
}
# keeping AdamW's moments in host memory (one device: rl.offload); the run's key, and fp8rl plan's flag
OFFLOAD_FIX = "trainer.offload_optimizer=true (fp8rl plan --offload-optimizer)"
PRESET_GROUP = "fp8rl_jax.presets"  # entry-point group naming the RL presets (pyproject.toml)


def _split(n: int, ways: int) -> int:
    """``n`` per device when split ``ways`` ways, or whole when it does not divide (the rules replicate)."""
    return n // ways if n % ways == 0 else n


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


# ------------------------------------------------------------------------------------ byte counts


def _shard_bytes(shape: Sequence[int], itemsize: int, spec: Any, sizes: Mapping[str, int], skip: str = "") -> int:
    """Bytes of one device's shard of an array of ``shape`` under ``spec`` (mesh axis ``skip`` not split)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    n = itemsize
    for dim, entry in zip(shape, entries):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        n *= math.ceil(dim / math.prod(sizes[a] for a in axes if a != skip))
    return n


def _per_device(params: nnx.State, config: ModelConfig, mesh: MeshConfig, rules: Any, skip: str = "",
                itemsize: int | None = None) -> dict[tuple, int]:
    """Bytes per device of every leaf of ``params`` (a ``QuantizedWeight``: codes + scales) under ``rules``
    on ``mesh``, keyed by path; ``itemsize`` overrides the dtype of plain leaves."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingFallbackWarning)  # fallbacks are counted replicated
        specs = dict(nnx.to_flat_state(plan_params(params, config, mesh, rules).specs))
    sizes = {a.value: n for a, n in mesh.sizes.items()}
    out = {}
    for path, var in nnx.to_flat_state(params):
        value, spec = var.get_value(), specs[path].get_value()
        if isinstance(value, QuantizedWeight):
            out[tuple(path)] = sum(_shard_bytes(a.shape, jnp.dtype(a.dtype).itemsize, spec.q, sizes, skip)
                                   for a in (value.q, value.scale_inv))
        else:
            size = itemsize or jnp.dtype(value.dtype).itemsize
            out[tuple(path)] = _shard_bytes(value.shape, size, spec, sizes, skip)
    return out


def generator_params(config: ModelConfig, fp8_weights: bool, dtype: Any = jnp.bfloat16,
                     block: tuple[int, int] = (128, 128)) -> nnx.State:
    """Abstract generator params: the W8A8 linears as ``QuantizedWeight`` (E4M3 codes, float32 scales
    per block) with ``fp8_weights``, every other leaf in ``dtype``; no device work."""
    policy, out = LayerPolicy(block_size=tuple(block)), []
    for path, var in nnx.to_flat_state(abstract_params(config, dtype)):
        w = var.get_value()
        if fp8_weights and policy.quantizes(site_of(tuple(path)), config.num_layers):
            *lead, n, k = w.shape
            scales = (*lead, -(-n // block[0]), -(-k // block[1]))
            w = QuantizedWeight(jax.ShapeDtypeStruct(w.shape, jnp.float8_e4m3fn),
                                jax.ShapeDtypeStruct(scales, jnp.float32), tuple(block))
        out.append((path, var.replace(w)))
    return nnx.from_flat_state(out)


def generator_weight_bytes(config: ModelConfig, fp8_weights: bool, dtype: Any = jnp.bfloat16,
                           block: tuple[int, int] = (128, 128), tensor: int = 1) -> int:
    """Per-device bytes of the generator's weights (:func:`generator_params`) on ``tensor`` devices."""
    params = generator_params(config, fp8_weights, dtype, block)
    return sum(_per_device(params, config, MeshConfig(tensor=tensor), ShardingPreset.TENSOR_PARALLEL).values())


def kv_page_bytes(config: ModelConfig, page_size: int, fp8_kv: bool, dtype: Any = jnp.bfloat16) -> int:
    """Bytes of one KV page over every layer, K and V (``rollout.kv_pool.KvPool.bytes_per_page``)."""
    item = 1 if fp8_kv else jnp.dtype(dtype).itemsize
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * item


def _layer_token_bytes(m: ModelConfig, layer: int, tensor: int, c: int) -> int:
    """``A``: activation bytes per token of one layer (module note)."""
    N, K, H, D = _split(m.num_heads, tensor), _split(m.num_kv_heads, tensor), m.head_dim, m.hidden_size
    attn = 4 * D + 3 * (N + K) * H
    if m.layer_is_moe(layer):
        return c * (attn + m.num_experts_per_tok * (2 * D + 3 * _split(m.moe_intermediate_size, tensor))) + \
            8 * m.num_experts
    return c * (attn + 3 * _split(m.intermediate_size, tensor))


def train_activation_bytes(m: ModelConfig, rows: int, T: int, *, remat: bool, logits_chunk: int | None,
                           itemsize: int = 2, tensor: int = 1) -> int:
    """Peak activation bytes of the backward of ``rows`` sequences of ``T`` tokens (module note)."""
    c, D, L = itemsize, m.hidden_size, m.num_layers
    N, V = _split(m.num_heads, tensor), _split(m.vocab_size, tensor)
    A = [_layer_token_bytes(m, i, tensor, c) for i in range(L)]
    tokens = rows * T
    chunked = logits_chunk is not None and logits_chunk < tokens
    head = min(logits_chunk or tokens, tokens) * V * 4 * (HEAD_COPIES_CHUNKED if chunked else HEAD_COPIES)
    S = min(T, QUERY_BLOCK)
    if remat:
        saved, layer = L * rows * T * D * c, rows * T * (max(A) + ATT_REMAT * N * S)
    elif T <= QUERY_BLOCK:
        saved, layer = rows * T * (sum(A) + L * ATT_SAVED * N * T), rows * T * (max(A) + ATT_BWD * N * T)
    else:  # blocked: no scores saved, one block's recomputed in the backward
        saved, layer = rows * T * sum(A), rows * T * (max(A) + ATT_REMAT * N * S)
    return saved + max(layer, head) + rows * T * (D * (c + 4) + S)


def logprob_activation_bytes(m: ModelConfig, rows: int, T: int, *, logits_chunk: int | None, itemsize: int = 2,
                             tensor: int = 1) -> int:
    """Peak activation bytes of the forward-only logprob pass of ``rows`` sequences of ``T`` tokens."""
    c, D = itemsize, m.hidden_size
    N, V = _split(m.num_heads, tensor), _split(m.vocab_size, tensor)
    A = max(_layer_token_bytes(m, i, tensor, c) for i in range(m.num_layers))
    head = min(logits_chunk or rows * T, rows * T) * V * 4 * HEAD_COPIES_FWD
    S = min(T, QUERY_BLOCK)
    return max(rows * T * (A + ATT_FWD * N * S), head) + rows * T * (2 * D * c + S)


def runtime_reserve(hbm_bytes: int) -> int:
    """The bytes a plan leaves to the runtime on a device of ``hbm_bytes`` (module note)."""
    return int(RESERVE_BYTES + RESERVE_FRACTION * hbm_bytes)


# ------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of an RL run, by phase and term (module note), and the choices made.

    Attributes:
      name: what is planned (a preset's name, or empty).
      devices, hbm_bytes: the devices and each one's HBM.
      mesh: the trainer's mesh; ``generator_tensor`` devices per engine replica, ``replicas`` of them.
      params: parameters of the model.
      batch, batch_per_device, seq_len: sequences per step, per device (over data x fsdp x expert),
        and the padded length a micro-batch row is planned at (``rollout.engine.max_seq_len``).
      phases: phase -> term -> bytes per device (``PHASES``, ``TERMS``), at the chosen micro-batches.
      update_rows, logprob_rows: sequences per device in one micro-batch of the update and of the
        logprob pass (the largest divisor of ``batch_per_device`` that fits; 1 when none does).
      configured_micro_batches: ``trainer.micro_batches`` of the config.
      kv_pages, kv_room_bytes, kv_sequences, kv_source: the KV pool's pages (per replica), the
        bytes per device the rollout phase leaves for it, full-length sequences it holds, and
        what sized it.
      host_bytes: host memory per device (the optimizer state with ``offload_optimizer``).
      remat, offload_optimizer, sleep: the settings the plan depends on.
      head_bound: whether the LM-head block, not a layer's attention, is the update's largest
        activation (what to change when it does not fit).
    """

    name: str
    devices: int
    hbm_bytes: int
    mesh: MeshConfig
    generator_tensor: int
    replicas: int
    params: int
    batch: int
    batch_per_device: int
    seq_len: int
    phases: Mapping[str, Mapping[str, int]]
    update_rows: int
    logprob_rows: int
    configured_micro_batches: int
    kv_pages: int
    kv_room_bytes: int
    kv_sequences: int
    kv_source: str
    host_bytes: int
    remat: bool
    offload_optimizer: bool
    sleep: bool
    head_bound: bool = False

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak(self) -> int:
        return max(self.total(p) for p in PHASES)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hbm_bytes

    @property
    def micro_batches(self) -> int:
        """The update's micro-batch count (``trainer.micro_batches``) the plan chooses."""
        return self.batch_per_device // self.update_rows

    @property
    def logprob_micro_batches(self) -> int:
        return self.batch_per_device // self.logprob_rows

    def problem(self) -> str | None:
        """One line naming the phase and the largest term that do not fit and what to change (None: fits)."""
        if self.fits:
            return None
        phase = max(PHASES, key=self.total)
        terms = {k: v for k, v in self.phases[phase].items() if k != "reserve"}
        term = max(terms, key=terms.get)
        over = self.total(phase) - self.hbm_bytes
        fix = self._fix(term, terms[term] - over)
        return (f"the {phase} phase needs {_gib(self.total(phase))} GiB per device, {_gib(over)} GiB over the "
                f"{_gib(self.hbm_bytes)} GiB of HBM; its largest term is {TERMS[term]} at {_gib(terms[term])} "
                f"GiB: {fix}")

    def _fix(self, term: str, room: int) -> str:
        m, more = self.mesh, f"use more devices (now {self.devices})"
        if term == "kv_pool":
            if room <= 0:
                return "nothing is left for any KV pool: " + self._fix("optimizer", 0)
            offload = "" if self.offload_optimizer or self.devices > 1 else f"{OFFLOAD_FIX}, "
            return (f"lower rollout.engine.kv_budget_gib to {room / GIB:.2f} or less (or set "
                    f"rollout.engine.kv_budget_fraction), or free the trainer's state: {offload}more devices or "
                    f"parallel.fsdp (now {m.fsdp})")
        if term in ("masters", "optimizer", "gradients", "compute_copy", "gathered", "offload_stream"):
            offload = ("" if self.offload_optimizer or self.devices > 1 or term == "gathered"
                       else f", or {OFFLOAD_FIX}")
            return f"{more} or shard wider with parallel.fsdp (now {m.fsdp}){offload}"
        if term == "activations":
            rows = f"one micro-batch row of {self.seq_len} tokens does not fit"
            if not self.remat:
                return f"{rows}: set trainer.remat=true"
            if self.head_bound:
                return f"{rows}: lower trainer.logits_chunk or split the vocabulary: parallel.tensor (now {m.tensor})"
            return (f"{rows} (the trainer's attention scores grow as T^2): split the heads with parallel.tensor "
                    f"(now {m.tensor}) or lower rollout.engine.max_seq_len")
        if term in ("generator", "sync_copy"):
            return f"split the generator with parallel.generator_tensor (now {self.generator_tensor})"
        if term == "workspace":
            return "lower rollout.engine.max_slots or rollout.engine.prefill_batch"
        if term == "batch":
            return f"{more} or lower data.prompts_per_step"
        return "lower rollout.vllm_memory"

    def table(self) -> str:
        """The per-device table of every term (GiB, two decimals) for each phase, then the choices."""
        m = self.mesh
        count = f"{self.params / 1e9:.2f}B" if self.params >= 1e8 else f"{self.params / 1e6:.2f}M"
        head = (f"memory plan{' ' + self.name if self.name else ''}: {count} parameters on "
                f"{self.devices} device(s) x {_gib(self.hbm_bytes)} GiB\n"
                f"trainer mesh: data {m.data} x fsdp {m.fsdp} x expert {m.expert} x tensor {m.tensor}; generator: "
                f"{self.replicas} replica(s) x {self.generator_tensor} device(s)\n"
                f"batch: {self.batch} sequences per step, {self.batch_per_device} per device, rows padded to "
                f"{self.seq_len} tokens\n")
        lines = [f"{'per device (GiB)':44s}" + "".join(f"{p:>10s}" for p in PHASES)]
        for term, label in TERMS.items():
            if any(term in self.phases[p] for p in PHASES):
                lines.append(f"  {label:42s}" + "".join(
                    f"{_gib(self.phases[p][term]) if term in self.phases[p] else '-':>10s}" for p in PHASES))
        lines.append(f"  {'total':42s}" + "".join(f"{_gib(self.total(p)):>10s}" for p in PHASES))
        lines.append(f"  {'HBM':42s}" + f"{_gib(self.hbm_bytes):>10s}" * len(PHASES))
        T = self.seq_len
        choice = [
            f"update: {self.update_rows} sequence(s) per device per micro-batch ({self.update_rows * T} tokens) -> "
            f"trainer.micro_batches = {self.micro_batches} (configured {self.configured_micro_batches})",
            f"logprobs: {self.logprob_rows} sequence(s) per device per micro-batch ({self.logprob_rows * T} tokens) "
            f"-> {self.logprob_micro_batches} micro-batch(es)",
        ]
        if self.kv_pages:
            choice.append(f"KV pool: {self.kv_pages} pages per replica from {self.kv_source}, "
                          f"{self.kv_sequences} full-length sequences; room for {_gib(self.kv_room_bytes)} GiB per "
                          "device")
        if self.host_bytes:
            choice.append(f"host: {_gib(self.host_bytes)} GiB per device of offloaded optimizer state")
        choice.append("fits" if self.fits else f"does not fit: {self.problem()}")
        return head + "\n".join(lines) + "\n" + "\n".join(choice)


def _check(cfg: RLConfig, devices: int, hbm_bytes: int) -> tuple[MeshConfig, int]:
    """The mesh and per-device batch, or a ``ConfigError`` naming what does not divide."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(f"devices must be an int >= 1, got {devices!r}")
    if not hbm_bytes > 0:
        raise ConfigError(f"the HBM per device must be > 0, got {hbm_bytes!r} bytes")
    mesh = cfg.parallel.mesh_config(devices)
    m, gt = cfg.model, cfg.parallel.generator_tensor
    if m.num_heads % mesh.tensor:
        raise ConfigError(f"parallel.tensor = {mesh.tensor} does not divide the {m.num_heads} query heads: each "
                          "device must hold whole heads")
    if m.num_experts and m.num_experts % mesh.expert:
        raise ConfigError(f"parallel.expert = {mesh.expert} does not divide the {m.num_experts} experts")
    if m.num_heads % gt or m.num_kv_heads % gt:
        raise ConfigError(f"parallel.generator_tensor = {gt} must divide the query heads ({m.num_heads}) and the "
                          f"kv heads ({m.num_kv_heads}): each device of a replica holds whole heads and their KV")
    batch, shards = cfg.data.prompts_per_step * cfg.rollout.n_samples, mesh.batch_shards
    if batch % shards:
        raise ConfigError(f"the batch data.prompts_per_step x rollout.n_samples = {batch} does not split over "
                          f"data x fsdp x expert = {mesh.data} x {mesh.fsdp} x {mesh.expert} = {shards} devices")
    return mesh, batch // shards


def plan_memory(cfg: RLConfig, devices: int, hbm_bytes: int, *, choose_micro_batches: bool = True,
                name: str = "") -> MemoryPlan:
    """The :class:`MemoryPlan` of ``cfg`` on ``devices`` devices of ``hbm_bytes`` each (pure: shapes only).

    ``choose_micro_batches``: pick the largest micro-batches that fit (else plan
    ``trainer.micro_batches`` as configured, for both passes). ``trainer.offload_optimizer`` plans AdamW's
    moments in host memory (``rl.offload``). Raises ``ConfigError`` for a mesh that does not divide the
    heads, experts or batch, fewer than one device or no HBM."""
    mesh, per_dev = _check(cfg, devices, hbm_bytes)
    m, eng, tr = cfg.model, cfg.rollout.engine, cfg.trainer
    offload_optimizer = tr.offload_optimizer
    gt, T = cfg.parallel.generator_tensor, eng.max_seq_len
    c = jnp.dtype(tr.compute_dtype.value).itemsize
    masters_tree = abstract_params(m, jnp.float32)
    rules = mesh_rules(mesh)  # the rules the trainer shards its state by (rl.sharded.make_mesh_trainer)
    leaves = _per_device(masters_tree, m, mesh, rules)
    full = _per_device(masters_tree, m, mesh, rules, skip="fsdp", itemsize=c)
    P_bytes = sum(leaves.values())  # 4 bytes x P_dev
    params = sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(masters_tree))
    groups: dict[tuple, int] = {}  # the compute-dtype bytes FSDP gathers at once
    moments: dict[tuple, int] = {}  # the float32 bytes of one group's parameters on this device
    for path, n in full.items():
        groups[group_of(path)] = groups.get(group_of(path), 0) + n
        moments[group_of(path)] = moments.get(group_of(path), 0) + leaves[path]
    resident = {"masters": P_bytes, "optimizer": 0 if offload_optimizer else 2 * P_bytes}
    copy = {"compute_copy": P_bytes * c // 4}
    if mesh.fsdp > 1:
        copy["gathered"] = 2 * max(groups.values())
    batch_arrays = per_dev * T * 4 * 8  # tokens, loss mask, advantages, 3 logprobs, 2 outputs
    if eng.record_routing and m.is_moe:
        batch_arrays += per_dev * T * sum(map(m.layer_is_moe, range(m.num_layers))) * m.num_experts_per_tok * 4
    reserve = runtime_reserve(hbm_bytes)

    # the generator: weights, KV pool, workspace (or vLLM's share)
    mode, vllm = cfg.precision.rollout, cfg.rollout.backend is RolloutBackend.VLLM
    gen: dict[str, int] = {}
    kv_pages = kv_room = kv_seqs = 0
    kv_source = ""
    if vllm:
        gen["vllm"] = int(cfg.rollout.vllm_memory * hbm_bytes)
    else:
        gen["generator"] = generator_weight_bytes(m, mode.fp8_weights, tr.compute_dtype.value, eng.fp8_block, gt)
        D, V, P_len = m.hidden_size, m.vocab_size, max(T - cfg.rollout.max_new_tokens, 1)
        A = max(_layer_token_bytes(m, i, gt, c) for i in range(m.num_layers))
        gen["workspace"] = 3 * eng.max_slots * V * 4 + eng.prefill_batch * P_len * (A + 2 * D * c)
        page = kv_page_bytes(m, eng.page_size, mode.fp8_kv, tr.compute_dtype.value)
        max_pages = -(-T // eng.page_size)
        extra = eng.max_slots * (max_pages + 1) * 4 + 2 * m.num_layers * 4  # page table, lengths, scales
        kv_room = hbm_bytes - reserve - sum(resident.values()) - sum(gen.values()) - extra
        if eng.num_pages:
            kv_pages, kv_source = eng.num_pages, "rollout.engine.num_pages"
        elif eng.kv_budget_fraction:
            kv_pages = int(eng.kv_budget_fraction * max(kv_room, 0) * gt // page)
            kv_source = f"rollout.engine.kv_budget_fraction = {eng.kv_budget_fraction:g}"
        else:
            kv_pages = int(eng.kv_budget_gib * GIB * gt // page)
            kv_source = f"rollout.engine.kv_budget_gib = {eng.kv_budget_gib:g}"
        gen["kv_pool"] = kv_pages * page // gt + extra
        kv_seqs = kv_pages // max_pages
    sleep = cfg.rollout.sleep_while_training and not vllm
    awake = {} if sleep else gen
    stream = {}
    if offload_optimizer:  # one group's mu + nu on the device at a time, and the next one's arriving
        stream["offload_stream"] = 2 * 2 * max(moments.values())

    def update(rows: int) -> dict[str, int]:
        acts = train_activation_bytes(m, rows, T, remat=tr.remat, logits_chunk=tr.logits_chunk, itemsize=c,
                                      tensor=mesh.tensor)
        return {**resident, "gradients": 2 * P_bytes, **copy, "activations": acts, "batch": batch_arrays, **stream,
                **awake, "reserve": reserve}

    def logprobs(rows: int) -> dict[str, int]:
        acts = logprob_activation_bytes(m, rows, T, logits_chunk=tr.logits_chunk, itemsize=c, tensor=mesh.tensor)
        return {**resident, **copy, "activations": acts, "batch": batch_arrays, **awake, "reserve": reserve}

    def choose(phase) -> int:
        if not choose_micro_batches:
            return max(per_dev // tr.micro_batches, 1)
        fitting = [r for r in range(per_dev, 0, -1) if per_dev % r == 0 and sum(phase(r).values()) <= hbm_bytes]
        return fitting[0] if fitting else 1

    up_rows, lp_rows = choose(update), choose(logprobs)
    # the trainer's cast of its shard; on a mesh also the dense copy each replica device receives
    handed = P_bytes * c // 4
    if mesh.size > 1:
        handed += generator_weight_bytes(m, False, tr.compute_dtype.value, tensor=gt)
    sync = {**resident, "sync_copy": handed}
    if vllm:
        sync["vllm"] = gen["vllm"]
    else:
        sync["generator"] = gen["generator"]
        if not sleep:
            sync["kv_pool"] = gen["kv_pool"]
    sync["reserve"] = reserve
    phases = {"rollout": {**resident, **gen, "reserve": reserve}, "logprobs": logprobs(lp_rows),
              "update": update(up_rows), "sync": sync}
    return MemoryPlan(
        name=name, devices=devices, hbm_bytes=int(hbm_bytes), mesh=mesh, generator_tensor=gt, replicas=devices // gt,
        params=params, batch=per_dev * mesh.batch_shards, batch_per_device=per_dev, seq_len=T, phases=phases,
        update_rows=up_rows, logprob_rows=lp_rows, configured_micro_batches=tr.micro_batches, kv_pages=kv_pages,
        kv_room_bytes=max(kv_room, 0), kv_sequences=kv_seqs, kv_source=kv_source,
        host_bytes=2 * P_bytes if offload_optimizer else 0, remat=tr.remat, offload_optimizer=offload_optimizer,
        sleep=sleep, head_bound=_head_bound(m, T, tr.logits_chunk, mesh.tensor, c))


def _head_bound(m: ModelConfig, T: int, chunk: int | None, tensor: int, c: int) -> bool:
    """Whether the LM-head block outweighs one layer's backward in :func:`train_activation_bytes`."""
    N, V = _split(m.num_heads, tensor), _split(m.vocab_size, tensor)
    A = max(_layer_token_bytes(m, i, tensor, c) for i in range(m.num_layers))
    copies = HEAD_COPIES_CHUNKED if chunk is not None and chunk < T else HEAD_COPIES
    return min(chunk or T, T) * V * 4 * copies > T * (A + ATT_REMAT * N * min(T, QUERY_BLOCK))


# ------------------------------------------------------------------------------------ fp8rl plan


def presets() -> dict[str, Any]:
    """The RL presets registered under the ``fp8rl_jax.presets`` entry-point group, by name (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=PRESET_GROUP)}


def load_preset(name: str) -> RLConfig:
    """The ``RLConfig`` preset ``name``; a ``ConfigError`` listing the known names for an unknown one."""
    known = presets()
    if name not in known:
        names = ", ".join(sorted(known)) or f"none registered (install the package: the {PRESET_GROUP} entry points)"
        raise ConfigError(f"unknown preset {name!r}; presets: {names}")
    cfg = known[name].load()
    if not isinstance(cfg, RLConfig):
        raise ConfigError(f"preset {name!r} ({known[name].value}) is a {type(cfg).__name__}, not an RLConfig")
    return cfg


def add_plan_arguments(p: Any) -> None:
    """The flags of ``fp8rl plan`` on the argparse parser ``p`` (dispatching to :func:`plan_command`)."""
    p.add_argument("--preset", required=True, help="an RL preset (e.g. aime24_qwen3_8b)")
    p.add_argument("--devices", type=int, required=True, help="devices of the run (all hosts)")
    p.add_argument("--hbm-gib", type=float, required=True, help="HBM per device in GiB (what JAX may use)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, as everywhere (e.g. parallel.tensor=8); repeatable")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="plan AdamW's mu/nu in host memory (sets trainer.offload_optimizer)")
    p.add_argument("--table", action="store_true", help="print the table also when the run does not fit")
    p.set_defaults(func=plan_command)


def plan_command(args: Any) -> int:
    """``fp8rl plan``: prints the table and exits 0 when the run fits; else one ``error:`` line on stderr
    (naming what does not fit and what to change) and exit status 2. Bad input exits 2 the same way."""
    try:
        cfg = override(load_preset(args.preset), args.set)
        if args.offload_optimizer:
            cfg = override(cfg, ["trainer.offload_optimizer=true"])
        plan = plan_memory(cfg, args.devices, int(args.hbm_gib * GIB), name=args.preset)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if plan.fits or args.table:
        print(plan.table())
    if not plan.fits:
        print(f"error: {plan.problem()}", file=sys.stderr)
        return 2
    return 0


# ------------------------------------------------------------------------------------ tools that size themselves


def device_bytes_limit(device: Any = None) -> int | None:
    """The allocator's limit on ``device`` (default the first device); None where the backend does not
    report one (the CPU)."""
    d = jax.devices()[0] if device is None else device
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check_fits(terms: Mapping[str, int], limit: int | None, *, what: str, fixes: Mapping[str, str]) -> None:
    """Raises ``ValueError`` with one line when the buffers ``terms`` (label -> bytes) that ``what`` is about
    to allocate exceed ``limit`` bytes: the total, each term, and ``fixes[largest term]``. ``limit`` None
    (a backend without memory statistics): no check. The terms are a lower bound (no activations)."""
    if limit is None:
        return
    total = sum(terms.values())
    if total <= limit:
        return
    top = max(terms, key=terms.get)
    parts = " + ".join(f"{k} {_gib(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v)
    raise ValueError(f"{what} needs at least {_gib(total)} GiB ({parts}) of the device's {_gib(limit)} GiB; the "
                     f"largest is the {top}: {fixes.get(top, 'use a smaller configuration')}")
