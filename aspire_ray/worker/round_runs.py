"""Greedy rounds of the synchronized modes (``RowPlan.num_rounds``: k drafts and their
verification, several rounds a plan) replayed whole by the draft-step and verify graphs, one
device sync a plan; and the next plan's first round started early.

The next plan of such a batch is, as a rule, more rounds of the same rows, each starting where
this plan's last verification left it, which is the state the graphs leave on the device. So
before the host waits for this plan's tokens the worker replays one more round from that state
(``SpecConfig.rounds_overlap``); the GPU works while the host commits, schedules and plans.
The next plan either continues it (its rows a subset of the started ones, with the same draft
count, each starting at the token and position the device holds and keeping the pages the
round used; rows that finished stop in their places) or it is dropped: its KV lies past every
row's exact tokens and is rewritten before it is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from aspire_ray.plan import RowKind, RowPlan, RowResult, SamplingSpec

from . import rejection_sampler
from .device_result import DeviceResult
from .graph_clock import CLOCK


@dataclass
class StartedRound:
    """The next plan's first round, replayed from the state this plan leaves on the device."""

    n: int  # row bucket of the state
    row_ids: list[str | None]  # device rows
    steps: int  # drafts of the round
    outs: list[torch.Tensor]  # its drafts and argmax, on the device
    # each row's first token and its position in the next plan, and the pages of its table
    # the round reads or writes: filled once this plan's tokens are known
    starts: dict[str, tuple[int, int]] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)

    def learn_starts(self, next_rows: list[RowPlan], page_size: int) -> None:
        for row in next_rows:
            self.starts[row.req_id] = (row.token_ids[0], row.start_pos)
            # k draft steps and their verification write KV at start .. start + k
            self.pages[row.req_id] = -(-(row.start_pos + self.steps + 1) // page_size)

    def continues(self, rows: list[RowPlan], steps: int) -> bool:
        return steps == self.steps and all(
            row.req_id in self.starts and (row.token_ids[0], row.start_pos) ==
            self.starts[row.req_id] and row.pages_keep >= self.pages[row.req_id]
            for row in rows)  # fmt: skip


def graph_rounds(worker: Any, rows: list[RowPlan], specs: list[SamplingSpec], steps: int,
                 rounds: int, started: StartedRound | None) -> tuple[list[RowResult], float]:
    """Greedy rounds replayed whole by the draft-step and verify graphs, back to back, one
    device sync -> (each row's result, later rounds in ``rounds``; the seconds the host
    waited). The host reads each round's drafts and argmax and verifies as the device did
    (``rejection_sampler.verify_greedy``; the device moved on by the same rule). ``worker``:
    the Worker (its requests, page table and ``draft_graphs``; not imported, it imports this);
    started: the round the last plan started early, if any."""
    graphs = worker.draft_graphs
    reqs = [worker.requests[row.req_id] for row in rows]
    CLOCK.mark("round:launch")
    for row, req in zip(rows, reqs, strict=True):
        end = row.start_pos + rounds * (steps + 1)  # every round accepting all
        if -(-end // worker.page_size) > worker.page_table.sizes[req.slot]:
            raise RuntimeError(f"request {row.req_id}: {worker.page_table.sizes[req.slot]} "
                               f"pages cannot hold {end} tokens")
    by_id = {row.req_id: r for r, row in enumerate(rows)}
    if isinstance(started, StartedRound) and started.continues(rows, steps) \
            and graphs.ready(started.n, steps, worker.kv_caches):  # fmt: skip
        n = started.n
        graphs.stop_rows(n, [rid in by_id for rid in started.row_ids])
        with CLOCK.phase("round:continue"):
            outs = started.outs + graphs.replay_rounds(n, steps, rounds - 1)
        row_ids = started.row_ids
        graphs.rounds_continued += 1
    else:
        with CLOCK.phase("round:run"):
            outs = graphs.run_rounds(rows, specs, [req.slot for req in reqs],
                                     [req.scored_pages > 0 for req in reqs], steps, rounds,
                                     worker.kv_caches)  # fmt: skip
        n, row_ids = graphs.bucket(len(rows)), [row.req_id for row in rows]
    waited_for = CLOCK.launched
    pending = DeviceResult(outs, spin=worker.cfg.device_wait == "spin")
    with CLOCK.phase("round:early"):
        graphs.started = _start_next(worker, n, rows, steps, rounds)
    flat, wait = pending.wait()
    CLOCK.mark("round:woke", waited_for)
    flat = flat.tolist()
    width, d = len(row_ids) * (2 * steps + 1), len(row_ids) * steps
    at = {row.req_id: row_ids.index(row.req_id) for row in rows}  # device row of each row
    by_round: list[list[RowResult]] = []
    for i in range(rounds):
        if i:  # each round starts after the tokens the last one committed
            rows = [row.next_round(res.verified.tokens)
                    for row, res in zip(rows, by_round[-1], strict=True)]  # fmt: skip
        out = flat[i * width : (i + 1) * width]
        this = []
        for row in rows:
            r = at[row.req_id]
            chain = out[r * steps : (r + 1) * steps]
            accepted, committed = rejection_sampler.verify_greedy(
                out[d + r * (steps + 1) : d + (r + 1) * (steps + 1)], chain)
            res = RowResult(row.req_id, RowKind.DRAFT, chain)
            res.verified = RowResult(row.req_id, RowKind.VERIFY, committed, accepted)
            this.append(res)
        by_round.append(this)
    results = by_round[0]
    for later in by_round[1:]:
        for first, res in zip(results, later, strict=True):
            first.rounds.append(res)
    if graphs.started is not None:
        graphs.started.learn_starts([row.next_round(res.verified.tokens) for row, res
                                     in zip(rows, by_round[-1], strict=True)],
                                    worker.page_size)  # fmt: skip
    if graphs.refresh or graphs.verify.score:
        for req, row in zip(reqs, rows, strict=True):  # the last verification's pages
            req.scored_pages = -(-(row.start_pos + steps + 1) // worker.page_size)
    return results, wait


def _start_next(worker: Any, n: int, rows: list[RowPlan], steps: int,
                rounds: int) -> StartedRound | None:  # fmt: skip
    """Replay the round the next plan would start with, if every row has its pages."""
    graphs = worker.draft_graphs
    if not worker.cfg.spec.rounds_overlap or not graphs.ready(n, steps, worker.kv_caches):
        return None
    for row in rows:  # the next plan starts at start_pos + rounds * (steps + 1) at most
        end = row.start_pos + (rounds + 1) * (steps + 1)
        if -(-end // worker.page_size) > worker.page_table.sizes[worker.requests[row.req_id].slot]:
            return None
    graphs.rounds_started += 1
    return StartedRound(n, list(graphs.row_ids), steps, graphs.replay_rounds(n, steps, 1))
