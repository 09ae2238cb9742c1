"""Committed tokens -> text, and stop-string detection (driver side)."""

from __future__ import annotations


class Detokenizer:
    """Decodes a request's output; checks stop strings only in the newly produced tail."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @staticmethod
    def find_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
        """Earliest stop string that ends after ``new_from`` (the old text length)."""
        best = None
        for stop in stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best
