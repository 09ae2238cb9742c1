"""The serving threads' tokenizers: copies of the engine's, never the engine's own.

A HF fast tokenizer is one Rust object behind PyO3's borrow check: a call that mutates it (the
truncation and padding that ``encode`` resets, ``encode_special_tokens``) while another thread
is inside a call that released the GIL can raise ``RuntimeError: Already borrowed`` (vLLM issue
40949). The engine thread decodes every step's text (with a copy of its own,
``AsyncLLMEngine._deliver``; in-process, the engine's tokenizer too for stop strings and final
texts), so the HTTP side (prompts and chat templates, tokenized in asyncio's thread pool) uses
its own copies, made once when the replica starts: the engine thread's per-step decoding takes
no lock.

Invariant: each copy is used by at most one thread at a time (``_borrow`` hands a copy to one
caller until it returns); the engine's tokenizer is read only while the copies are made, before
the engine thread starts.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Iterator
from contextlib import contextmanager

from aspire_ray.engine.engine import encode_text

COPIES = 2  # prompts tokenize in parallel (encoding releases the GIL) on this many copies


class TokenizerPool:
    def __init__(self, tokenizer, copies: int = COPIES) -> None:
        if copies < 1:
            raise ValueError(f"a tokenizer pool needs at least one copy, got {copies}")
        self.has_tokenizer = tokenizer is not None
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(copies if self.has_tokenizer else 0):
            self._free.put(copy.deepcopy(tokenizer))

    def encode(self, text: str) -> list[int]:
        """A text prompt's token ids, as ``LLMEngine.tokenize`` makes them (blocking)."""
        if not self.has_tokenizer:
            return encode_text(None, text)  # raises: this model has no tokenizer
        with self._borrow() as tok:
            return encode_text(tok, text)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text of a chat, generation prompt appended (blocking)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template")
        with self._borrow() as tok:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @contextmanager
    def _borrow(self) -> Iterator:
        tok = self._free.get()  # waits while every copy is in use
        try:
            yield tok
        finally:
            self._free.put(tok)
