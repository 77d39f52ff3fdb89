"""The narrow generator interface the RL loop uses, and the rollout batch it returns.

Every generator (the built-in JAX engine, the vLLM backend) implements ``Generator``:
``generate(prompts, sampling) -> RolloutBatch`` and ``update_weights(params)``. Prompts are
token-id lists; the batch holds only the generated tokens, with per-token logprobs under the
convention of ``fp8rl_jax.rollout.sampling`` (log-softmax of logits / T before truncation).
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
    """What the RL loop needs from a rollout backend."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> RolloutBatch:
        """Generates for every prompt; ``sampling`` is one SamplingConfig or one per prompt."""

    def update_weights(self, params: Any) -> None:
        """Takes the trainer's new parameters (re-quantized as the generator's precision needs)."""
