"""A synthetic verifiable task for the CPU quickstart: multi-digit addition, exact-match reward.

Prompt ``"a+b="``, answer ``str(a + b)``; the model must write the answer and stop (EOS). The
reward is 1.0 when the response, cut at the first EOS, equals the answer exactly, else 0.0.
Operands are drawn uniformly with ``digits`` digits each (leading digit non-zero unless
``digits == 1``), so the answer has ``digits`` or ``digits + 1`` digits.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt and its reference answer (the reward function's ground truth)."""

    prompt: str
    answer: str


def supervised_batch(examples: list[Example], encode, eos: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, mask)`` [B, T] for supervised warm-up: ``prompt + answer + EOS`` right-padded with 0,
    the mask on the answer and EOS tokens (the trainer's alignment: entry t scores ``tokens[t]``)."""
    tokens = np.zeros((len(examples), T), np.int32)
    mask = np.zeros((len(examples), T), np.float32)
    for i, e in enumerate(examples):
        p, a = list(encode(e.prompt)), list(encode(e.answer)) + [eos]
        if len(p) + len(a) > T:
            raise ValueError(f"example {i} ({e.prompt!r} -> {e.answer!r}) needs {len(p) + len(a)} tokens, more than T = {T}")
        tokens[i, : len(p) + len(a)] = p + a
        mask[i, len(p) : len(p) + len(a)] = 1.0
    return tokens, mask


def exact_match_reward(response: str, ground_truth: str) -> float:
    """1.0 when ``response`` (stripped) equals ``ground_truth``, else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


@dataclasses.dataclass(frozen=True)
class AdditionTask:
    """``a+b=`` with ``digits``-digit operands."""

    digits: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"AdditionTask.digits must be an int in [1, 9], got {self.digits!r}")

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1

    def sample(self, rng: np.random.Generator, n: int) -> list[Example]:
        lo = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        a = rng.integers(lo, 10**self.digits, n)
        b = rng.integers(lo, 10**self.digits, n)
        return [Example(f"{x}+{y}=", str(x + y)) for x, y in zip(a.tolist(), b.tolist())]

    def reward(self, response: str, answer: str) -> float:
        return exact_match_reward(response, answer)

    def noisy_teacher(self, rng: np.random.Generator, n: int, p_correct: float, max_offset: int = 3) -> list[Example]:
        """Supervised warm-up data from an unreliable teacher: the right sum with probability
        ``p_correct``, otherwise the sum off by a nonzero offset in ``[-max_offset, max_offset]``.
        A model fit to it puts mass near the right answer but rarely on it: the situation of
        an LLM before RL, which verifiable rewards then sharpen."""
        if not 0.0 <= p_correct <= 1.0 or max_offset < 1:
            raise ValueError(f"need 0 <= p_correct <= 1 and max_offset >= 1, got {p_correct}, {max_offset}")
        out = []
        for e in self.sample(rng, n):
            total = int(e.answer)
            if rng.random() >= p_correct:
                offsets = [d for d in range(-max_offset, max_offset + 1) if d != 0 and total + d >= 0]
                total += int(rng.choice(offsets))
            out.append(Example(e.prompt, str(total)))
        return out
