"""AIME24 RL on Qwen3-8B: DAPO-style GRPO with FP8 rollout + TIS (preset ``configs.rl.AIME24_QWEN3_8B``).

    python experiments/aime24_qwen3_8b.py --model-path Qwen3-8B/ --train-data dapo-math-17k.parquet \\
        [--eval-data aime24.jsonl | hf:HuggingFaceH4/aime_2024] [--out runs/aime24_qwen3_8b] [--resume] \\
        [--set rollout.n_samples=8 ...]
    python experiments/aime24_qwen3_8b.py --preset tiny     # a tiny random Qwen3 on the CPU, no weights

The recipe, its inputs and outputs are described in ``experiments/aime24.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aime24

from configs.models import tiny_qwen3
from configs.rl import AIME24_QWEN3_8B

PRESET = AIME24_QWEN3_8B
TINY = aime24.tiny_preset(PRESET, tiny_qwen3, "runs/aime24_qwen3_8b_tiny")
MODEL_NAME = "Qwen3-8B"
main = aime24.main


def cli(argv: list[str] | None = None) -> int:
    return aime24.cli(argv, preset=PRESET, tiny=TINY, model_name=MODEL_NAME, description=__doc__)


if __name__ == "__main__":
    sys.exit(cli())
