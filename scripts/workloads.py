"""Benchmark workloads from real text available offline.

Long-context prompts are windows of CPython's pydoc topics (`pydoc_data/topics.py`, shipped
with every CPython, PSF licence, ~172k SmolLM2 tokens of real technical English with code):
it is on every machine we run on (CPU boxes and the GPU host), so the same tokens feed both.
The model continues the document (plain completion), which is what long-context decoding with
a mostly-copied, mostly-predictable context looks like. Short prompts are chat requests that
ask for long answers (the short-prompt / long-generation workload).
"""

from __future__ import annotations

import functools

SHORT_TASKS = [
    "Write a detailed tutorial on Python decorators with several code examples.",
    "Explain how a hash table works, with an implementation in Python.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the history of the printing press and its effects on Europe.",
    "Explain step by step how to solve a system of linear equations by Gaussian elimination.",
    "Write a Python class for a bank account with deposits, withdrawals and tests.",
    "Explain the difference between processes and threads, with examples.",
    "Write a guide to planting and caring for a vegetable garden.",
]


@functools.cache
def _topics_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@functools.cache
def document_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(_topics_text(), add_special_tokens=False))


def long_context_prompts(tokenizer, n: int, context_tokens: int) -> list[list[int]]:
    """n prompts of exactly `context_tokens` tokens: windows spread over the document."""
    doc = document_ids(tokenizer)
    if context_tokens > len(doc):
        raise ValueError(f"the document has only {len(doc)} tokens")
    span = len(doc) - context_tokens
    step = span // max(n, 1)
    return [list(doc[i * step : i * step + context_tokens]) for i in range(n)]


def short_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": SHORT_TASKS[i % len(SHORT_TASKS)]}], tokenize=False,
            add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts
