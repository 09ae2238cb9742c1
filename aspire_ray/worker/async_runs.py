"""Asynchronous runs (``RowPlan.async_gamma``, ``aspire``): several steps in one plan, each
request drafting until it holds its draft length and then verifying, every step one forward of
all rows (DESIGN.md §1.4: draft and verify rows side by side).

Which rows draft and which verify at each step is known before the run
(``RowPlan.async_kinds``: it follows the drafts held, not what the verifications accept), so
the host knows every step's layout (its queries, its token bucket); the tokens and positions
after a verification it learns only from the device. On a GPU the steps replay the graphs of
``async_graphs.py``, which plan themselves from device state, with one host sync per run;
elsewhere each step is planned on the host from the tracks below, one sync per step. Either
way the host replays each row's steps on its ``AsyncTrack`` from the argmax of its queries,
deciding each verification as the device did (``rejection_sampler.verify_greedy``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from aspire_ray.plan import RowKind, RowPlan, RowResult

from . import rejection_sampler


class AsyncTrack:
    """One row of an asynchronous run, step by step: the tokens known ([x_n, d_1..d_d]) and
    where x_n sits; the segments (drafts, then the verification that ended them)."""

    def __init__(self, row: RowPlan) -> None:
        self.req_id = row.req_id
        self.kinds = row.async_kinds()
        self.known = list(row.verify_after)
        self.x_pos = row.start_pos - (len(self.known) - 1)
        self.segments = [RowResult(row.req_id, RowKind.DRAFT, [])]
        self.visible = 0  # KV tokens the row's last step saw (the pages it scored)

    def queries(self, step: int) -> int:
        return 1 if self.kinds[step] < 0 else self.kinds[step] + 1

    def step_row(self, step: int) -> RowPlan:
        """The row's RowPlan at a step (host planning)."""
        if self.kinds[step] < 0:
            return RowPlan(self.req_id, RowKind.DRAFT, [self.known[-1]],
                           self.x_pos + len(self.known) - 1, 0, [])  # fmt: skip
        return RowPlan(self.req_id, RowKind.VERIFY, list(self.known), self.x_pos, 0, [],
                       num_drafts=self.kinds[step])  # fmt: skip

    def take(self, step: int, argmax: list[int]) -> None:
        """The target's argmax at the row's queries of a step: a draft, or a verification."""
        self.visible = self.x_pos + len(self.known)
        seg = self.segments[-1]
        if self.kinds[step] < 0:
            seg.tokens.append(argmax[0])
            self.known.append(argmax[0])
            return
        accepted, committed = rejection_sampler.verify_greedy(argmax, self.known[1:])
        seg.verified = RowResult(self.req_id, RowKind.VERIFY, committed, accepted)
        self.segments.append(RowResult(self.req_id, RowKind.DRAFT, []))
        self.x_pos += len(committed)
        self.known = [committed[-1]]

    def result(self) -> RowResult:
        """The first segment, the later ones in its ``rounds``."""
        first, *rest = self.segments
        if rest and not rest[-1].tokens:  # the run ended on a verification
            rest.pop()
        first.rounds = rest
        return first


def run_async(worker: Any, rows: list[RowPlan]) -> tuple[list[RowResult], float, float]:
    """An asynchronous run of ``rows`` (greedy) on ``worker`` (the Worker: its requests, page
    table, ``async_graphs`` and ``_forward``; not imported, it imports this) -> (each row's
    result, the seconds the host waited for the device, the refresh layer's seconds)."""
    tracks = [AsyncTrack(row) for row in rows]
    steps = rows[0].num_steps
    for row in rows:
        if row.async_gamma is None or row.num_steps != steps or \
                not worker.requests[row.req_id].sampling.greedy:  # fmt: skip
            raise ValueError(f"an asynchronous run holds greedy rows of {steps} steps only, "
                             f"got row {row.req_id!r}")
        slot = worker.requests[row.req_id].slot
        end = row.start_pos + steps  # KV positions up to start_pos + steps - 1
        if -(-end // worker.page_size) > worker.page_table.sizes[slot]:
            raise RuntimeError(f"request {row.req_id}: {worker.page_table.sizes[slot]} pages "
                               f"cannot hold {end} tokens")
    graphs = worker.async_graphs
    layout = [[t.queries(s) for t in tracks] for s in range(steps)]
    if graphs is not None and graphs.fits(len(rows), layout):
        return _on_graphs(worker, rows, tracks, layout)
    wait = refresh = 0.0
    for s in range(steps):  # planned on the host, step by step
        logits, batch, _ = worker._forward([t.step_row(s) for t in tracks])
        t0 = time.perf_counter()
        argmax = logits.argmax(dim=-1).tolist()
        wait += time.perf_counter() - t0
        refresh += batch.attention.refresh_seconds
        offsets = batch.logit_offsets
        for r, track in enumerate(tracks):
            track.take(s, argmax[offsets[r] : offsets[r + 1]])
    return [t.result() for t in tracks], wait, refresh


def _on_graphs(worker: Any, rows: list[RowPlan], tracks: list[AsyncTrack],
               layout: list[list[int]]) -> tuple[list[RowResult], float, float]:  # fmt: skip
    reqs = [worker.requests[row.req_id] for row in rows]
    outs = worker.async_graphs.run(rows, [req.slot for req in reqs],
                                   [req.scored_pages > 0 for req in reqs], layout,
                                   worker.kv_caches)  # fmt: skip
    t0 = time.perf_counter()
    flat = torch.cat(outs).tolist()  # the run's one device sync
    wait = time.perf_counter() - t0
    at = 0
    for s, queries in enumerate(layout):
        for track, q in zip(tracks, queries, strict=True):
            track.take(s, flat[at : at + q])
            at += q
    if worker.async_graphs.scoring:  # every step scored every row
        for req, track in zip(reqs, tracks, strict=True):
            req.scored_pages = -(-track.visible // worker.page_size)
    return [t.result() for t in tracks], wait, 0.0
