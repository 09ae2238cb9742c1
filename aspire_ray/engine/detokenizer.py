"""Committed tokens -> text, incrementally, and stop-string detection.

The engine decodes stop-string requests as it commits their tokens (to find the stops) and
every request's final text; a serving replica decodes the others' streamed text on its side
(``serving/async_engine.py``), and ``LLM.generate`` needs final texts only
(``LLMEngine.stream_text``).

Not ``tokenizers.decoders.DecodeStream``: it re-decodes every token since its last emitted
chunk, and emits nothing until that whole window decodes without a trailing U+FFFD, so on
output that stays invalid UTF-8 the window, and each step's work, grow with the output (issue 19
defect 5; ``tests/test_detokenizer.py`` shows the case).
"""

from __future__ import annotations

from dataclasses import dataclass

# A character is at most 4 bytes, so an incomplete one at the end spans at most 3 tokens: of the
# last HOLD_BACK cuts, the latest that ends on a whole character is emitted (so no character
# that completes straddles the cut at n - HOLD_BACK used below). A window still incomplete
# after MAX_PENDING new tokens holds bytes that will never decode (the model emitted invalid
# UTF-8): all but the last HOLD_BACK tokens are settled as they decode (with U+FFFD), keeping
# each step's work bounded.
MAX_PENDING = 8
HOLD_BACK = 4


@dataclass
class DecodeState:
    """Where a request's incremental decoding stands (the prefix-offset scheme of vLLM / TGI).

    ``text`` is the text of ``ids[:read]``; tokens before ``prefix`` are settled, and the window
    ``ids[prefix:]`` is decoded again when tokens arrive, so that a token whose text depends on
    its neighbours (a multi-byte character split over tokens) is emitted once complete.
    """

    text: str = ""
    prefix: int = 0
    read: int = 0
    prefix_text: str = ""  # the decoding of ids[prefix:read]


class Detokenizer:
    """Decodes requests' outputs; checks stop strings only in the newly produced tail."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        """The whole text of ``token_ids`` (the final text of a request)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, state: DecodeState, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (which extend those of earlier calls), decoding only the
        unsettled window: O(new tokens) rather than O(output) per step. An incomplete
        character at the end is held back (it would decode as U+FFFD); the text before it is
        emitted, even when several tokens arrive at once."""
        n = len(token_ids)
        if self.tokenizer is None or n <= state.read:
            return state.text
        for end in range(n, max(state.read, n - HOLD_BACK), -1):
            window = self.decode(token_ids[state.prefix : end])
            if len(window) > len(state.prefix_text) and not window.endswith("\ufffd"):
                self._settle(state, token_ids, end, window)
                break
        if n - state.read > MAX_PENDING:  # invalid UTF-8: settle all but the last HOLD_BACK
            end = n - HOLD_BACK
            self._settle(state, token_ids, end, self.decode(token_ids[state.prefix : end]))
        return state.text

    def _settle(self, state: DecodeState, token_ids: list[int], end: int, window: str) -> None:
        """Emit the text of ids[read:end] (window: the decoding of ids[prefix:end])."""
        state.text += window[len(state.prefix_text) :]
        state.prefix, state.read = state.read, end
        state.prefix_text = self.decode(token_ids[state.prefix : state.read])

    @staticmethod
    def find_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
        """Earliest stop string that ends after ``new_from`` (the old text length)."""
        best = None
        for stop in stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best
