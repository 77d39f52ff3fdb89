"""Model presets: the public Qwen3 shapes and tiny variants for tests and demos.

``qwen3_8b`` and ``qwen3_30b_a3b`` copy the public Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B
config.json files field for field. Derive variants with ``dataclasses.replace``::

    cfg = dataclasses.replace(qwen3_8b, num_layers=4)
"""

import dataclasses

from fp8rl_jax.models.config import ModelConfig

# Qwen/Qwen3-8B: 8.19B parameters.
qwen3_8b = ModelConfig(
    vocab_size=151_936,
    hidden_size=4096,
    intermediate_size=12_288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40_960,
    tie_word_embeddings=False,
    bos_token_id=151_643,
    eos_token_ids=(151_645,),
)

# Qwen/Qwen3-1.7B: 2.03B parameters (1.7B without the tied embedding); the mid-size model of
# the end-to-end RL step benchmark (trainer + generator fit one GPU).
qwen3_1_7b = dataclasses.replace(qwen3_8b, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                                 num_kv_heads=8, tie_word_embeddings=True)

# Qwen/Qwen3-4B: 4.02B parameters; the largest dense Qwen3 whose RL step (float32 masters, AdamW) is planned
# for one 80 GB GPU.
qwen3_4b = dataclasses.replace(qwen3_8b, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                               num_kv_heads=8, tie_word_embeddings=True)

# Qwen/Qwen3-30B-A3B: 30.5B parameters in all, 3.3B active per token.
qwen3_30b_a3b = ModelConfig(
    vocab_size=151_936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40_960,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=(),
    bos_token_id=151_643,
    eos_token_ids=(151_645,),
)

# Tiny variants with the same structure (GQA 2:1, q/k norm, untied head) for tests and demos.
tiny_qwen3 = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
    max_position_embeddings=512,
    eos_token_ids=(1,),
)

tiny_qwen3_moe = dataclasses.replace(
    tiny_qwen3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)

PRESETS = {
    "qwen3_8b": qwen3_8b,
    "qwen3_1_7b": qwen3_1_7b,
    "qwen3_4b": qwen3_4b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "tiny_qwen3": tiny_qwen3,
    "tiny_qwen3_moe": tiny_qwen3_moe,
}
