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
deciding each verification as the device did (``rejection_sampler.verify_greedy``). Rows of
sampled requests move on by their queries' choices instead (``sampled_rows``: their draws,
and speculative rejection sampling's accepted drafts and last draw), which the same greedy
acceptance reads; the q of their drafts stay on the device between steps.

On the graphs the next run starts early (``SpecConfig.async_overlap_steps``): its first steps
replay from the state this run leaves on the device before the host waits for this run's
tokens (``Started``), and the next plan continues them or drops them (``_continue``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aspire_ray.plan import RowKind, RowPlan, RowResult, async_kinds, held_after

from . import rejection_sampler
from .device_result import DeviceResult
from .graph_clock import CLOCK
from .sampled_rows import chain_of, host_choices


class AsyncTrack:
    """One row of an asynchronous run, step by step: the tokens known ([x_n, d_1..d_d]) and
    where x_n sits; the segments (drafts, then the verification that ended them); a sampled
    row's q of the drafts it holds (host planning; float32 [V] each)."""

    def __init__(self, row: RowPlan, q: list[torch.Tensor] | None = None) -> None:
        self.req_id = row.req_id
        self.kinds = row.async_kinds()
        self.known = list(row.verify_after)
        self.q = list(q or [])
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

    def take_run(self, flat: np.ndarray, starts: np.ndarray) -> None:
        """``take`` at every step of the run at once: ``flat`` int64 [N] every step's argmax
        of every row, ``starts`` int64 [steps] where this row's queries begin in it at each
        step. Draft steps between two verifications are gathered in one index (a plan's
        host time is per row and step otherwise: 1,024 calls a plan at 64 rows)."""
        kinds, s, steps = self.kinds, 0, len(starts)
        while s < steps:
            v = next((i for i in range(s, steps) if kinds[i] >= 0), steps)
            if v > s:  # draft steps s..v-1: one token each
                drafts = flat[starts[s:v]].tolist()
                self.segments[-1].tokens += drafts
                self.known += drafts
                self.visible = self.x_pos + len(self.known) - 1
            if v < steps:  # a verification of kinds[v] drafts: its d + 1 queries
                at = int(starts[v])
                self.take(v, flat[at : at + kinds[v] + 1].tolist())
            s = v + 1

    def result(self) -> RowResult:
        """The first segment, the later ones in its ``rounds``."""
        first, *rest = self.segments
        if rest and not rest[-1].tokens:  # the run ended on a verification
            rest.pop()
        first.rounds = rest
        return first


def run_async(worker: Any, rows: list[RowPlan]) -> tuple[list[RowResult], float, float]:
    """An asynchronous run of ``rows`` on ``worker`` (the Worker: its requests, page table,
    ``async_graphs`` and ``_forward``; not imported, it imports this) -> (each row's result,
    the seconds the host waited for the device, the refresh layer's seconds). A sampled
    request's ``draft_probs`` hold the q of its drafts held before and after."""
    reqs = [worker.requests[row.req_id] for row in rows]
    tracks = [AsyncTrack(row, req.draft_probs[: len(row.verify_after) - 1])
              for row, req in zip(rows, reqs, strict=True)]  # fmt: skip
    steps = rows[0].num_steps
    for row in rows:
        if row.async_gamma is None or row.num_steps != steps:
            raise ValueError(f"an asynchronous run holds rows of {steps} steps only, "
                             f"got row {row.req_id!r}")
        slot = worker.requests[row.req_id].slot
        end = row.start_pos + steps  # KV positions up to start_pos + steps - 1
        if -(-end // worker.page_size) > worker.page_table.sizes[slot]:
            raise RuntimeError(f"request {row.req_id}: {worker.page_table.sizes[slot]} pages "
                               f"cannot hold {end} tokens")
    graphs = worker.async_graphs
    layout = [[t.queries(s) for t in tracks] for s in range(steps)]
    specs = [req.sampling for req in reqs]
    sampled = not all(spec.greedy for spec in specs)
    if graphs is not None and graphs.fits(len(rows), layout, sampled):
        return _on_graphs(worker, rows, tracks, layout)
    if graphs is not None:
        graphs.drop_started("host")
    wait = refresh = 0.0
    for s in range(steps):  # planned on the host, step by step
        hidden, batch, _ = worker._forward([t.step_row(s) for t in tracks])
        offsets = batch.logit_offsets
        choices = _host_choices(worker, hidden, offsets, tracks, specs, s, sampled)
        t0 = time.perf_counter()
        choices = choices.tolist()
        wait += time.perf_counter() - t0
        refresh += batch.attention.refresh_seconds
        for r, track in enumerate(tracks):
            track.take(s, choices[offsets[r] : offsets[r + 1]])
    for req, track in zip(reqs, tracks, strict=True):
        req.draft_probs = track.q
    return [t.result() for t in tracks], wait, refresh


def _host_choices(worker, hidden: torch.Tensor, offsets: list[int], tracks: list[AsyncTrack],
                  specs: list, step: int, sampled: bool) -> torch.Tensor:  # fmt: skip
    """A host-planned step's choices from hidden [N, hidden] at its logit rows, a run of rows
    at a time (``Worker.logit_runs``: a large step's logits, distributions and q store never
    all at once; a row's choices depend on its own alone): the argmax, and with sampled rows
    ``sampled_rows.host_choices`` (the graphs' code over tensors made from the tracks); each
    sampled draft row's q joins its track, a verification empties it."""
    coupled = worker.cfg.spec.coupled_sampling
    held = [len(t.known) - 1 for t in tracks]
    verify = [t.kinds[step] >= 0 for t in tracks]
    parts = []
    for a, b, run, logits in worker.logit_runs(hidden, offsets):
        argmax = logits.argmax(dim=-1)
        if not sampled:
            parts.append(argmax)
            del logits  # before the next run's
            continue
        chain = chain_of([t.known[1:] for t in tracks[a:b]], logits.device)
        choices, new_q = host_choices(logits, argmax, run, verify[a:b], held[a:b],
                                      [t.x_pos for t in tracks[a:b]], chain, specs[a:b],
                                      [t.q for t in tracks[a:b]], coupled)  # fmt: skip
        parts.append(choices)
        del logits
        for t, spec, v, q in zip(tracks[a:b], specs[a:b], verify[a:b], new_q, strict=True):
            if not spec.greedy and not coupled:
                t.q = [] if v else t.q + [q]
    return torch.cat(parts)


@dataclass
class Started:
    """The first steps of the next run, replayed before the current run's tokens were known
    (``SpecConfig.async_overlap_steps``), from the state the current run leaves on the device:
    the same rows in the same places, each with its promised draft length."""

    n: int  # row bucket of the state
    row_ids: list[str | None]  # device rows
    gammas: dict[str, int]  # the draft lengths they run with
    steps: int  # steps of the run they begin
    kinds: dict[str, list[int]]  # each row's ``async_kinds`` over the whole run
    layout: list[list[int]]  # queries of each device row at each started step
    outs: list[torch.Tensor]  # those steps' argmax, on the device
    # each row's tokens known at the run's start and the position of the last (its
    # RowPlan's verify_after and start_pos), and the pages of its table the started steps
    # read or write: filled once the current run's tokens are known
    starts: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)

    def learn_starts(self, tracks: list[AsyncTrack], page_size: int) -> None:
        """The rows' starts from the tracks of the run before this one."""
        for t in tracks:
            start = t.x_pos + len(t.known) - 1
            self.starts[t.req_id] = (list(t.known), start)
            # step s writes KV below start + s + 1 (a step moves the row's end on by one
            # position at most)
            self.pages[t.req_id] = -(-(start + len(self.layout)) // page_size)

    def mismatch(self, rows: list[RowPlan], tracks: list[AsyncTrack]) -> str | None:
        """Why the plan's run is not this one, or None where it is (its rows a subset of the
        started ones, each as started and with the pages it used unchanged: then it finishes
        on the device). The reasons, counted in ``AsyncStepGraphs.runs_dropped``: "row" (a row
        not started), "gamma" (another draft length), "steps" (another run length), "start"
        (other tokens or position), "kinds" (other steps), "pages" (pages the started steps
        used were given back)."""
        for row, track in zip(rows, tracks, strict=True):
            rid = row.req_id
            if rid not in self.starts:
                return "row"
            if row.async_gamma != self.gammas[rid]:
                return "gamma"
            if row.num_steps != self.steps:
                return "steps"
            if (row.verify_after, row.start_pos) != self.starts[rid]:
                return "start"
            if track.kinds != self.kinds[rid]:
                return "kinds"
            if row.pages_keep < self.pages[rid]:
                return "pages"
        return None


def _on_graphs(worker: Any, rows: list[RowPlan], tracks: list[AsyncTrack],
               layout: list[list[int]]) -> tuple[list[RowResult], float, float]:  # fmt: skip
    graphs = worker.async_graphs
    reqs = [worker.requests[row.req_id] for row in rows]
    started, graphs.started = graphs.started, None
    by_id = {row.req_id: r for r, row in enumerate(rows)}
    CLOCK.mark("async:launch")
    with CLOCK.phase("async:continue"):
        continued = _continue(worker, started, rows, tracks, by_id, len(layout))
    if continued is not None:
        outs, layouts, row_ids, n = continued
    else:
        with CLOCK.phase("async:run"):
            specs = [req.sampling for req in reqs]
            outs = graphs.run(rows, [req.slot for req in reqs],
                              [req.scored_pages > 0 for req in reqs], layout, worker.kv_caches,
                              specs, [t.q for t in tracks])  # fmt: skip
        layouts, row_ids = layout, [row.req_id for row in rows]
        n = next(b for b in graphs.row_buckets if b >= len(rows))
    waited_for = CLOCK.launched
    if graphs.variant is not None:  # the q of every draft a row may hold at the run's end
        graphs.snapshot_q(max(max(row.async_gamma, len(row.verify_after) - 1) for row in rows))
    pending = DeviceResult(outs, spin=worker.cfg.device_wait == "spin")
    with CLOCK.phase("async:early"):
        graphs.started = _start_next(worker, n, rows, tracks, by_id)
    flat, wait = pending.wait()
    CLOCK.mark("async:woke", waited_for)
    counts = np.asarray(layouts, dtype=np.int64)  # [steps, rows]: queries, step-major in flat
    starts = (np.cumsum(counts, axis=None) - counts.ravel()).reshape(counts.shape)
    for d, rid in enumerate(row_ids):
        if rid in by_id:
            tracks[by_id[rid]].take_run(flat, starts[:, d])
    if graphs.variant is not None and not graphs.coupled:  # the q of the drafts held now
        for d, rid in enumerate(row_ids):
            req = worker.requests[rid] if rid in by_id else None
            if req is not None and not req.sampling.greedy:
                req.draft_probs = graphs.pending_q(d, len(tracks[by_id[rid]].known) - 1)
    if graphs.started is not None:
        graphs.started.learn_starts(tracks, worker.page_size)
    if graphs.scoring:  # every step scored every row
        for req, track in zip(reqs, tracks, strict=True):
            req.scored_pages = -(-track.visible // worker.page_size)
    return [t.result() for t in tracks], wait, 0.0


def _continue(worker: Any, started: Started | None, rows: list[RowPlan],
              tracks: list[AsyncTrack], by_id: dict[str, int], steps: int):
    """The plan's run finished on the device from the steps started early, if it is that run
    -> (each step's argmax on the device, each step's queries by device row, the device rows'
    requests, the row bucket), else None."""
    graphs = worker.async_graphs
    if started is None:
        return None
    if (why := started.mismatch(rows, tracks)) is not None:
        graphs.runs_dropped[why] += 1  # (taken off ``graphs.started`` by the caller)
        return None
    layout = [[tracks[by_id[rid]].queries(s) if rid in by_id else 0 for rid in started.row_ids]
              for s in range(steps)]  # fmt: skip
    head = len(started.layout)
    gammas = [started.gammas.get(rid, 0) if rid else 0 for rid in started.row_ids]
    keep = [rid in by_id for rid in started.row_ids]
    if not graphs.ready(started.n, layout[head:], worker.kv_caches, gammas, keep):
        graphs.runs_dropped["graphs"] += 1  # a table moved, or a step's graph is missing
        return None
    graphs.set_rows(started.n, gammas, keep)
    outs = started.outs + graphs.replay(started.n, layout[head:])
    graphs.runs_continued += 1
    return outs, started.layout + layout[head:], started.row_ids, started.n


def _start_next(worker: Any, n: int, rows: list[RowPlan], tracks: list[AsyncTrack],
                by_id: dict[str, int]) -> Started | None:  # fmt: skip
    """Replay the first steps of the run that would follow this one (its rows again, their
    promised draft lengths), if every row has the pages and every step its graph."""
    graphs, steps = worker.async_graphs, rows[0].next_async_steps or rows[0].num_steps
    head = min(worker.cfg.spec.overlap_steps, steps)  # a short run (requests near their end)
    if head == 0 or any(row.next_async_gamma is None for row in rows):
        return None
    kinds = {}
    for row, track in zip(rows, tracks, strict=True):
        held = held_after(track.kinds, len(row.verify_after) - 1)
        kinds[row.req_id] = async_kinds(held, row.next_async_gamma, steps)
        # the next run starts at start_pos + this run's steps at most; its first steps write
        # KV up to head positions past that
        pages = -(-(row.start_pos + row.num_steps + head + 1) // worker.page_size)
        if pages > worker.page_table.sizes[worker.requests[row.req_id].slot]:
            return None
    row_ids = graphs.row_ids
    layout = [[_queries(kinds[rid][s]) if rid in by_id else 0 for rid in row_ids]
              for s in range(head)]  # fmt: skip
    gammas = {row.req_id: row.next_async_gamma for row in rows}
    device_gammas = [gammas.get(rid, 0) if rid else 0 for rid in row_ids]
    if not graphs.ready(n, layout, worker.kv_caches, device_gammas):
        return None
    graphs.set_rows(n, device_gammas)
    graphs.runs_started += 1
    return Started(n, list(row_ids), gammas, steps, kinds, layout, graphs.replay(n, layout))


def _queries(kind: int) -> int:
    return 1 if kind < 0 else kind + 1
