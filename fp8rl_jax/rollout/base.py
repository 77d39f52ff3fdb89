"""The narrow generator interface the RL loop uses, and the rollout batch it returns.

Every generator (the built-in JAX engine, the vLLM backend) implements ``Generator``:
``generate(prompts, sampling) -> RolloutBatch``, ``update_weights(params)``,
``set_kv_scales(k, v)``, ``sleep(weights)`` / ``wake()`` and ``params``. Prompts are token-id
lists; the batch holds only the generated tokens, with per-token logprobs under the convention
of ``fp8rl_jax.rollout.sampling`` (log-softmax of logits / T before truncation).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Protocol, Sequence

import numpy as np


class FinishReason(enum.Enum):
    """Why a sequence stopped."""

    STOP = "stop"  # an EOS or stop token was generated (it is included in the tokens)
    LENGTH = "length"  # max_tokens were generated
    MAX_LEN = "max_len"  # prompt + generation reached the engine's max_seq_len


@dataclasses.dataclass
class RolloutBatch:
    """Generated tokens of N requests, in request order.

    Attributes:
      tokens: [N, max_new] int32, generated token ids, right-padded with 0.
      logprobs: [N, max_new] float32, the logprob of each generated token (0 on padding).
      lengths: [N] int32, generated tokens per request.
      finish_reasons: N FinishReason values.
      preemptions: how many times a running sequence was preempted (its KV pages freed and
        later recomputed) during this call; the tokens do not depend on it.
      routing: [N, S, L_moe, k] int32 or None (the default; set by a generator asked to record
        MoE routing, e.g. ``EngineConfig.record_routing``): the experts chosen at every position
        of prompt + response, ``S = max(len(prompt_i) + lengths[i])``; position ``j`` of row ``i``
        is ``prompt_i[j]`` for ``j < len(prompt_i)``, else ``tokens[i, j - len(prompt_i)]``. Axis
        2 follows ``fp8rl_jax.models.qwen3.moe_layers``, axis 3 the router's top-k order. ``-1``
        where nothing was recorded (padding, and the last generated token, which the generator
        never feeds back). The trainer replays it (``TrainBatch.routing``).
      routing_recompute_mismatches: positions whose recomputed prefill after a preemption chose
        other experts than first recorded (the first recording is kept); 0 without recording.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[FinishReason]
    preemptions: int = 0
    routing: np.ndarray | None = None
    routing_recompute_mismatches: int = 0

    def token_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]

    def logprob_lists(self) -> list[list[float]]:
        return [row[:n].tolist() for row, n in zip(self.logprobs, self.lengths)]


class Generator(Protocol):
    """What the RL loop needs from a rollout backend, and all it uses (``GENERATOR_MEMBERS``).

    Implemented by ``fp8rl_jax.rollout.engine.JaxEngine`` and
    ``fp8rl_jax.rollout.vllm_backend.VLLMGenerator``. One RL step calls ``generate``, then
    ``sleep(weights=True)`` (with ``rollout.sleep_while_training``) while the trainer runs, then
    ``update_weights`` with the trainer's new params, ``set_kv_scales`` with trainer-side FP8 KV
    calibration, and waits on ``params`` to time the sync.
    """

    @property
    def params(self) -> Any:
        """The weights the generator holds now, as JAX arrays in its own layout (re-quantized,
        fused), or None when it holds none as JAX arrays (after ``sleep(weights=True)``, or a
        backend that keeps them elsewhere and whose ``update_weights`` returns only once they are in
        place). ``jax.block_until_ready(params)`` waits for the device work of ``update_weights``."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> RolloutBatch:
        """Generates one response per prompt (token ids in, token ids and logprobs out); ``sampling``
        is one ``SamplingConfig`` for all prompts or one per prompt. Wakes a sleeping generator."""

    def update_weights(self, params: Any) -> None:
        """Takes the trainer's new parameters (the model's params in the compute dtype), converted
        as the generator's precision needs (FP8 re-quantization, fused layout). FP8 KV scales then
        become stale: the next ``generate`` measures new ones (inference-side calibration) or
        ``set_kv_scales`` must come first (trainer-side)."""

    def set_kv_scales(self, k_scale: Any, v_scale: Any) -> None:
        """Sets the FP8 KV cache's per-layer dequantization scales (``[L]`` float32 each, from
        ``fp8rl_jax.models`` ``calibrate_kv_scales``), marking them fresh."""

    def sleep(self, weights: bool = False) -> None:
        """Frees the generator's device memory (its KV cache; with ``weights``, its weight copy too)
        while a colocated trainer runs. The cache comes back on ``wake`` or on the next call that
        needs it; after ``sleep(weights=True)`` call ``update_weights`` before the next ``generate``
        (a backend may keep the weights elsewhere meanwhile, as vLLM's level-1 sleep does on the
        host). Idempotent."""

    def wake(self) -> None:
        """Allocates what ``sleep`` freed again, ahead of the next ``generate`` (a no-op when awake)."""


GENERATOR_MEMBERS = ("generate", "update_weights", "set_kv_scales", "sleep", "wake", "params")
