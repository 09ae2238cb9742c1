"""Driver-side state of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from aspire_ray.outputs import RequestMetrics
from aspire_ray.plan import SamplingSpec
from aspire_ray.sampling_params import SamplingParams

from .detokenizer import DecodeState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Token bookkeeping (DESIGN.md §1.3): committed tokens x_1..x_n = prompt + output;
    ``num_computed`` tokens have exact KV (n - 1 once decoding); ``drafts`` are pending draft
    tokens whose approximate KV is written for all but the last."""

    req_id: str
    # a tuple, not a list: the cyclic collector visits every element of a list at each
    # collection of its generation, and untracks a tuple of ints the first time it sees it;
    # 160 prompts of 32k tokens as lists made every generation-2 collection in a decode
    # window ~50 ms (docs/benchmarks.md §8.60)
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    sampling: SamplingSpec
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # block table (global page ids)
    synced_pages: int = 0  # prefix of `pages` the workers hold
    worker_known: bool = False  # workers hold per-request state
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    decode_state: DecodeState = field(default_factory=DecodeState)  # incremental detokenizing
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # speculation state (owned by the draft policy)
    alpha: float = 0.0
    alpha_accepted: float = 0.0  # EMA sums of drafts accepted and tried (pooled estimator)
    alpha_tried: float = 0.0
    fsm_gamma: int = 0
    verified_once: bool = False
    plain_verifies: int = 0  # verifications with d = 0 since the last one with drafts

    @property
    def last_token(self) -> int:
        """The request's latest token (its last output token, else its last prompt token)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """(prompt + output)[start:stop] without concatenating the two (O(context) a step)."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return list(self.prompt_token_ids[start:stop])
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: stop - n_prompt]]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_tokens - self.num_computed > 1

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)
