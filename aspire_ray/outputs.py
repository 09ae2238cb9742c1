"""What generation returns to users (plain data, safe to send across processes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Speculation and timing figures of one request."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0  # draft tokens produced
    accepted: int = 0  # draft tokens accepted by verification
    verifications: int = 0  # verify steps (d >= 1) this request took part in
    decode_steps: int = 0  # steps with a draft or verify/decode row for this request
    preemptions: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [j]: accepted at draft pos j
    drafted_by_position: list[int] = field(default_factory=list)  # [j]: verified drafts at pos j
    gamma_history: list[int] = field(default_factory=list)  # draft length d of each verification
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def acceptance_rate(self) -> float:
        verified = sum(self.drafted_by_position)
        return self.accepted / verified if verified else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification (accepted drafts + the target's own token)."""
        if not self.verifications:
            return 0.0
        return (self.accepted + self.verifications) / self.verifications

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position,
                                                    self.drafted_by_position, strict=True)]

    def gamma_summary(self) -> dict[str, float]:
        g = self.gamma_history
        if not g:
            return {"count": 0, "mean": 0.0, "min": 0, "max": 0}
        return {"count": len(g), "mean": sum(g) / len(g), "min": min(g), "max": max(g)}


@dataclass
class RequestOutput:
    """One prompt's result. During streaming, ``token_ids``/``text`` hold everything so far.
    ``prompt_token_ids``: a list in finished outputs and in a served stream's outputs; in an
    unfinished output of ``LLMEngine.step`` the engine's own tuple (not copied each step)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    metrics: RequestMetrics
    error: str | None = None
