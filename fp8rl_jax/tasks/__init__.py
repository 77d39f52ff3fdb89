"""Prompt sources for the RL loop: synthetic verifiable tasks and jsonl/parquet math datasets."""

from fp8rl_jax.tasks.arithmetic import AdditionTask, Example, exact_match_reward, supervised_batch
from fp8rl_jax.tasks.datasets import PROMPT_TEMPLATE, PromptDataset, load_examples

__all__ = ["PROMPT_TEMPLATE", "AdditionTask", "Example", "PromptDataset", "exact_match_reward", "load_examples", "supervised_batch"]
