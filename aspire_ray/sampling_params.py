"""Per-request sampling and stopping parameters (validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad sampling values, empty or over-long prompt, ..."""


@dataclass
class SamplingParams:
    """How to sample and when to stop.

    temperature 0 means greedy (top_k/top_p are then ignored). ``seed`` makes sampling
    deterministic per request, independent of batching and preemption (the randomness for a
    token is a function of (seed, position) only).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               f"temperature must be in [0, 100], got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1,
               f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # NaN check


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
