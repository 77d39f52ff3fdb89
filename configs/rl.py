"""RL run presets (``fp8rl_jax.rl.config.RLConfig``); derive variants with ``dataclasses.replace`` or
``fp8rl_jax.rl.config.override(cfg, ["section.field=value", ...])``.

``QUICKSTART``: the CPU quickstart (tiny 2-layer Qwen3 on multi-digit addition), FP8 W8A8 + FP8
KV rollout with token TIS. ``AIME24_QWEN3_8B`` / ``AIME24_QWEN3_30B_A3B``: the DAPO-style recipe of
the FP8-RL paper (n = 16 samples per prompt, clip-higher 0.28, token-mean loss, TIS cap 2,
responses up to 20k tokens with DAPO's soft overlong punishment over the last 4k, lr 1e-6), evaluated on AIME24 (avg@16) every 5 steps; the 30B-A3B
preset adds MoE routing replay (``rollout.engine.record_routing``).
"""

import dataclasses

from configs.models import qwen3_8b, qwen3_30b_a3b, tiny_qwen3
from fp8rl_jax.models.policy import Fp8Mode
from fp8rl_jax.rl.algos import Correction, LossAgg
from fp8rl_jax.rl.config import (AlgorithmConfig, DataConfig, LoggingConfig, PrecisionConfig, RLConfig, RolloutConfig,
                                 TrainConfig)
from fp8rl_jax.rl.trainer import LossConfig, OptimizerConfig
from fp8rl_jax.rollout.config import EngineConfig

QUICKSTART = RLConfig(
    model=dataclasses.replace(tiny_qwen3, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                              head_dim=32, max_position_embeddings=64),
    # KV pool: 4 MiB, 1024 BF16 / 2048 FP8 pages of 8 tokens: all 256 slots at full length (32 tokens) in
    # either precision. A larger pool would only slow the CPU decode (XLA's CPU backend upcasts an FP8
    # pool's scatter, so each FP8 decode step costs time in proportion to the whole pool)
    rollout=RolloutConfig(n_samples=8, temperature=1.0, max_new_tokens=5,
                          engine=EngineConfig(max_seq_len=32, max_slots=256, page_size=8, kv_budget_gib=0.004,
                                              steps_per_call=5, prefill_batch=256)),
    algorithm=AlgorithmConfig(loss=LossConfig(clip_low=0.2, clip_high=0.28, agg=LossAgg.TOKEN_MEAN,
                                              correction=Correction.TOKEN_TIS, tis_cap=2.0)),
    optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0, max_grad_norm=1.0),
    trainer=TrainConfig(logits_chunk=None),  # all logits of 512 x 32 tokens over 256 entries: 16 MiB, no chunks
    precision=PrecisionConfig(rollout=Fp8Mode.ALL),
    data=DataConfig(prompts_per_step=64, steps=200, eval_every=25),
    logging=LoggingConfig(out_dir="runs/quickstart"),
)

AIME24_QWEN3_8B = RLConfig(
    model=qwen3_8b,
    rollout=RolloutConfig(n_samples=16, temperature=1.0, max_new_tokens=20_480,
                          sleep_while_training=True,  # the trainer gets the KV pool's memory during its step
                          # the KV pool takes 85% of what each GPU has free once the train state and the
                          # generator's weights are placed (fp8rl plan shows the split)
                          engine=EngineConfig(max_seq_len=22_528, max_slots=256, page_size=16, kv_budget_fraction=0.85,
                                              steps_per_call=16, prefill_batch=16,
                                              stall_timeout_s=900.0)),  # a stalled decode exits (code 3); --resume restarts
    algorithm=AlgorithmConfig(loss=LossConfig(clip_low=0.2, clip_high=0.28, agg=LossAgg.TOKEN_MEAN,
                                              correction=Correction.TOKEN_TIS, tis_cap=2.0),
                              overlong_buffer=4096, overlong_penalty=1.0),  # DAPO's soft overlong punishment
    optimizer=OptimizerConfig(lr=1e-6, warmup_steps=10, weight_decay=0.1, max_grad_norm=1.0),
    trainer=TrainConfig(micro_batches=64, remat=True),
    precision=PrecisionConfig(rollout=Fp8Mode.ALL),
    data=DataConfig(prompts_per_step=32, steps=500, eval_every=5, eval_samples=16),
    logging=LoggingConfig(out_dir="runs/aime24_qwen3_8b", checkpoint_every=10),
)

# MoE routing replay: the engine records the experts each token was routed to and the trainer's
# forwards use the same experts (``fp8rl_jax.rl.loop.build_batch``), so a router that flips between
# the FP8 rollout and the BF16 trainer adds nothing to their mismatch
AIME24_QWEN3_30B_A3B = dataclasses.replace(
    AIME24_QWEN3_8B, model=qwen3_30b_a3b,
    rollout=dataclasses.replace(AIME24_QWEN3_8B.rollout,
                                engine=dataclasses.replace(AIME24_QWEN3_8B.rollout.engine, record_routing=True)),
    logging=dataclasses.replace(AIME24_QWEN3_8B.logging, out_dir="runs/aime24_qwen3_30b_a3b"))

PRESETS = {"quickstart": QUICKSTART, "aime24_qwen3_8b": AIME24_QWEN3_8B, "aime24_qwen3_30b_a3b": AIME24_QWEN3_30B_A3B}
