"""Math prompt datasets read at run time (jsonl or parquet): training prompts and evaluation sets.

Rows need a question and an answer. Field names differ between datasets, so the first present
of ``QUESTION_KEYS`` / ``ANSWER_KEYS`` is used (``problem``/``answer`` for AIME24/25, AMC23 and
MATH500 files; ``prompt``/``solution`` or a chat-style ``prompt`` list plus
``reward_model.ground_truth`` for DAPO-Math-17k). Rows without both are an error naming the
file and line. Nothing is downloaded: the user passes a path.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from fp8rl_jax.tasks.arithmetic import Example

QUESTION_KEYS = ("problem", "question", "prompt", "query")
ANSWER_KEYS = ("answer", "ground_truth", "solution", "expected_answer")

# The paper's recipe: ask for step-by-step reasoning and a boxed final answer.
PROMPT_TEMPLATE = ("{question}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}.")

# Qwen's chat format for one user turn, ending where the assistant's reply begins (what the
# tokenizer's chat template renders for ``[{"role": "user", ...}]`` with a generation prompt).
QWEN_CHAT_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def chat_prompt(prompt: str, template: str = QWEN_CHAT_TEMPLATE) -> str:
    """``prompt`` as one user turn of a chat format (``template`` with ``{prompt}``)."""
    return template.format(prompt=prompt)


def _question(row: dict) -> str | None:
    for k in QUESTION_KEYS:
        v = row.get(k)
        if isinstance(v, str) and v.strip():
            return v
        if isinstance(v, list) and v and isinstance(v[-1], dict) and isinstance(v[-1].get("content"), str):
            return v[-1]["content"]  # chat format: the last (user) message
    return None


def _answer(row: dict) -> str | None:
    for k in ANSWER_KEYS:
        v = row.get(k)
        if isinstance(v, (str, int, float)) and str(v).strip():
            return str(v)
    rm = row.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return str(rm["ground_truth"])
    return None


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert to jsonl") from None
        return pq.read_table(path).to_pylist()
    rows = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return rows


def examples_from_rows(rows, *, source: str, template: str | None = PROMPT_TEMPLATE, limit: int = 0
                       ) -> list[Example]:
    """Examples of already-read rows (dicts, e.g. a Hugging Face dataset); ``source`` names them in errors."""
    out = []
    for i, row in enumerate(rows, 1):
        q, a = _question(row), _answer(row)
        if q is None or a is None:
            raise ValueError(f"{source}: row {i} has no question ({'/'.join(QUESTION_KEYS)}) or no answer "
                             f"({'/'.join(ANSWER_KEYS)}, reward_model.ground_truth); keys: {sorted(row)}")
        out.append(Example(template.format(question=q) if template else q, a))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"dataset file {source} has no rows")
    return out


def load_examples(path: str | Path, *, template: str | None = PROMPT_TEMPLATE, limit: int = 0) -> list[Example]:
    """Examples of a jsonl/parquet file; ``template`` (with ``{question}``) wraps each question."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    return examples_from_rows(_rows(path), source=str(path), template=template, limit=limit)


@dataclasses.dataclass
class PromptDataset:
    """Epoch-shuffled batches over a fixed example list with a resumable cursor."""

    examples: list[Example]
    seed: int = 0
    cursor: int = 0  # examples consumed so far (across epochs)

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def next_batch(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.cursor, len(self.examples))
            out.append(self.examples[int(self._order(epoch)[pos])])
            self.cursor += 1
        return out
