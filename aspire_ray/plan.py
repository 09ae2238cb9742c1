"""The small data objects that cross the driver -> worker boundary, once per step.

Only these cross process/actor boundaries (never tensors or live Request objects).
Notation (DESIGN.md §1.3): x_1..x_n committed, KV exact for x_1..x_{n-1}.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum


class RowKind(IntEnum):
    PREFILL = 0  # a chunk of known tokens, full causal attention; samples at the end if `sample`
    DRAFT = 1  # input x_n or the last draft, sparse attention, emits one draft token
    VERIFY = 2  # input [x_n, d_1..d_d], full attention, d >= 0 (d = 0: plain AR decode)


class Stream(IntEnum):
    """Independent random streams of the counter-based sampler (see worker/sampler.py)."""

    TARGET = 0
    DRAFT = 1
    ACCEPT = 2
    RESIDUAL = 3


@dataclass(frozen=True)
class SamplingSpec:
    """What the worker needs of SamplingParams (the seed is always set by the driver)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RowPlan:
    req_id: str
    kind: RowKind
    token_ids: list[int]  # this row's input tokens
    start_pos: int  # position of token_ids[0]; the row's KV context is start_pos + len(token_ids)
    pages_keep: int  # truncate the worker's block table to this many pages first ...
    pages_new: list[int]  # ... then append these page ids
    sample: bool = True  # PREFILL: sample a token after the last input token
    num_drafts: int = 0  # VERIFY: d, so token_ids = [x_n, d_1..d_d]
    # DRAFT: draft this many tokens back to back (a draft chain): the worker feeds each draft
    # into the next draft step on the device, with no host round trip between them. VERIFY
    # without drafts (ar): this many decode steps back to back (a decode chain), each step's
    # token the next one's input; the row's result holds every step's token.
    num_steps: int = 1
    # DRAFT (a chain that ends its round): verify in the same plan right after the chain; the
    # verify row's inputs are these known tokens [x_n, d_1..d_d], then the chain's drafts
    verify_after: list[int] | None = None
    # DRAFT with verify_after = [x_n] (a fresh round): this many rounds back to back in the
    # worker, each num_steps drafts and their verification, each starting after the tokens
    # the last one committed; no engine round trip between them (RowResult.rounds)
    num_rounds: int = 1
    # DRAFT with async_gamma = g (an asynchronous run, ``aspire``): num_steps steps in which
    # the row drafts one token while it holds fewer than g drafts and otherwise verifies them
    # ([x_n, d_1..d_d], then drafts again after the tokens that verification committed);
    # verify_after holds the tokens known when the run starts, [x_n, d_1..d_d0]; the result's
    # ``verified`` and ``rounds`` hold the run's segments (``async_kinds``)
    async_gamma: int | None = None
    # with async_gamma: the draft length of the row in the run after this one, if that run
    # keeps this row (the worker may start that run's first steps before this plan returns:
    # ``SpecConfig.async_overlap_steps``); None: no such promise
    next_async_gamma: int | None = None
    # with next_async_gamma: the steps of that run (None: as many as this one's)
    next_async_steps: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def final_context_len(self) -> int:
        """KV context after the row's last step (the pages it needs)."""
        round_end = self.context_len + self.num_steps - 1 + (self.verify_after is not None)
        return round_end + (self.num_rounds - 1) * (self.num_steps + 1)  # rounds accepting all

    def async_kinds(self) -> list[int]:
        """The steps of an asynchronous run (``async_gamma``): -1 where the row drafts, else
        the number of drafts it verifies (the step's queries are that plus one). Known before
        the run: it follows the drafts held, never what the verifications accept."""
        return async_kinds(len(self.verify_after) - 1, self.async_gamma, self.num_steps)

    def next_round(self, committed: list[int]) -> RowPlan:
        """The row of the round after this one (``num_rounds``), given the tokens this one's
        verification committed: its last token drafts next, at the position after them."""
        start = self.start_pos - (len(self.verify_after) - 1) + len(committed)
        return RowPlan(self.req_id, RowKind.DRAFT, [committed[-1]], start, 0, [],
                       num_steps=self.num_steps, verify_after=[committed[-1]],
                       num_rounds=self.num_rounds - 1)  # fmt: skip

    def verify_row(self, drafts: list[int]) -> RowPlan:
        """The verify row that follows this chain row (``verify_after``), given its drafts."""
        known = self.verify_after
        return RowPlan(self.req_id, RowKind.VERIFY, known + drafts,
                       self.start_pos - (len(known) - 1), 0, [],
                       num_drafts=len(known) - 1 + len(drafts))  # fmt: skip


def async_kinds(held: int, gamma: int, steps: int) -> list[int]:
    """``RowPlan.async_kinds`` of a row that starts a run of ``steps`` steps holding ``held``
    drafts, with draft length ``gamma``."""
    return list(_async_kinds(held, gamma, steps))


@functools.lru_cache(maxsize=4096)
def _async_kinds(held: int, gamma: int, steps: int) -> tuple[int, ...]:
    # a few hundred calls a plan (scheduler, cost features, worker tracks, the next run's
    # start) over a few dozen distinct (held, gamma, steps): cached, on the host's critical path
    kinds = []
    for _ in range(steps):
        verifies = held >= gamma
        kinds.append(held if verifies else -1)
        held = 0 if verifies else held + 1
    return tuple(kinds)


def held_after(kinds: list[int], held: int) -> int:
    """Drafts a row holds after a run of these ``async_kinds``, starting with ``held``."""
    for kind in kinds:
        held = 0 if kind >= 0 else held + 1
    return held


@dataclass(frozen=True)
class ShardInfo:
    """What the driver learns of its shard workers once, at start-up (``Executor.describe``)."""

    num_pages: int  # KV pages of a shard's pool (with tensor parallelism: every rank's)
    num_layers: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    refresh_layer: int
    device_name: str
    # start-up measurements for the cost model's lower bounds (spec/cost_model.py, CostBounds):
    # a shard's KV bytes per token over all layers; the weight bytes a forward reads (all but
    # the input embedding, of which a step gathers only its rows); the device memory bandwidth
    # in bytes/s. None: not measured (the bounds are then off)
    kv_bytes_per_token: int | None = None
    weight_bytes: int | None = None
    memory_bandwidth: float | None = None
    tp_size: int = 1
    # one all-reduce of [n, hidden] activations on the TP group takes all_reduce_latency +
    # all_reduce_per_token * n seconds (tp/collective_cost.py, measured at start-up, the same
    # on every rank); 0 at TP=1
    all_reduce_latency: float = 0.0
    all_reduce_per_token: float = 0.0
    # query tokens of one row that share a KV read (the attention backend's query tile over a
    # GQA group): a row of more queries reads its KV once per tile. None: once for any count
    query_tile_tokens: int | None = None


@dataclass
class StepPlan:
    step_id: int
    rows: list[RowPlan]
    new_requests: dict[str, SamplingSpec] = field(default_factory=dict)  # req_id -> sampling
    dropped_req_ids: list[str] = field(default_factory=list)  # finished/aborted/preempted


@dataclass
class RowResult:
    req_id: str
    kind: RowKind
    # PREFILL (sample) / VERIFY: tokens to commit = accepted drafts + one target token.
    # DRAFT: the new draft tokens (num_steps of them). PREFILL without sample: [].
    tokens: list[int]
    num_accepted: int = 0  # VERIFY: drafts accepted
    verified: RowResult | None = None  # DRAFT with verify_after: the verify row's result
    # DRAFT with num_rounds > 1: the results of the rounds after the first, in order (each a
    # DRAFT result with its ``verified``). An asynchronous run: its segments after the first,
    # each the drafts made and the verification that ended it (the last one's may be None)
    rounds: list[RowResult] = field(default_factory=list)


@dataclass(frozen=True)
class StepTimings:
    """Worker-side seconds of one step (rank 0's clock). A step that syncs with the device
    once at its end (a chain, rounds, an asynchronous run) reports the host's wait as
    ``forward`` and the rest of its time as ``prepare``."""

    prepare: float = 0.0  # planning and uploads, before the forward
    forward: float = 0.0  # the forward(s), to the device sync
    sample: float = 0.0  # sampling and verification on the logits
    refresh: float = 0.0  # host time of the refresh layer's page scoring (within forward)
    total: float | None = None  # the whole step; None: not timed (no cost-model sample)

    @property
    def measured(self) -> bool:
        return self.total is not None

    def as_dict(self) -> dict[str, float]:
        """name -> seconds, for sums and JSON: ``total`` only where the step was timed."""
        out = {"prepare": self.prepare, "forward": self.forward, "sample": self.sample,
               "refresh": self.refresh}  # fmt: skip
        if self.total is not None:
            out["total"] = self.total
        return out


@dataclass
class StepOutput:
    step_id: int
    results: list[RowResult]
    timings: StepTimings = field(default_factory=StepTimings)  # default: not timed


def rounds_of(row: RowPlan, res: RowResult) -> Iterator[tuple[RowPlan, RowResult]]:
    """(row, result) of each round a plan row ran, in order: the row itself, then for a row
    of several rounds (``num_rounds``) each next round's row and result. An asynchronous run
    (``async_gamma``): each segment as a DRAFT row whose ``verify_after`` holds the tokens
    known when it started, its result the drafts it made and the verification that ended it
    (None: the run ended first)."""
    if row.async_gamma is not None:
        yield from _segments_of(row, res)
        return
    yield row, res
    for result in res.rounds:
        row = row.next_round(res.verified.tokens)
        res = result
        yield row, res


def _segments_of(row: RowPlan, res: RowResult) -> Iterator[tuple[RowPlan, RowResult]]:
    known = list(row.verify_after)
    x_pos = row.start_pos - (len(known) - 1)  # x_n's position
    for seg in (res, *res.rounds):
        yield RowPlan(row.req_id, RowKind.DRAFT, [known[-1]], x_pos + len(known) - 1, 0, [],
                      num_steps=len(seg.tokens), verify_after=known), seg  # fmt: skip
        if seg.verified is None:
            known = known + seg.tokens
            continue
        x_pos += len(seg.verified.tokens)
        known = [seg.verified.tokens[-1]]
