"""`ar`'s greedy decode chains replayed by the draft-step graphs (every page: ``FullPages``),
one device sync a plan; and the next plan's chain started early (``SpecConfig.ar_overlap``).

A decode chain is k decode steps of the same rows, each step's argmax the next one's input
on the device. The next plan of a decoding batch is, as a rule, k more steps of the same rows,
each starting at the token and position this chain leaves on the device. So before the host
waits for this chain's tokens the worker replays k more steps from that state: the GPU decodes
while the host commits, schedules and plans. The next plan either continues it (its rows a
subset of the started ones, the same k, each starting at the token and position the device
holds and keeping the pages the started steps wrote) or it is dropped: its KV lies past every
row's exact tokens and is rewritten before it is read. Greedy rows only (a sampled chain
draws from the host's positions; it runs in ``Worker._chain_round``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aspire_ray.kernels.host import upload
from aspire_ray.plan import RowKind, RowPlan, RowResult, SamplingSpec

from .device_result import DeviceResult
from .graph_clock import CLOCK


@dataclass
class StartedChain:
    """The next plan's decode chain, replayed from the state this plan leaves on the device."""

    n: int  # row bucket of the state
    row_ids: list[str | None]  # device rows
    steps: int
    outs: list[torch.Tensor]  # each step's tokens of the device rows, int64 [len(row_ids)]
    # each row's first token and position in the next plan, and the pages the started steps
    # write into: filled once this plan's tokens are known
    starts: dict[str, tuple[int, int]] = field(default_factory=dict)
    pages: dict[str, int] = field(default_factory=dict)

    def learn_starts(self, rows: list[RowPlan], results: list[RowResult], page_size: int) -> None:
        for row, res in zip(rows, results, strict=True):
            start = row.start_pos + self.steps  # this chain's last token is the next input
            self.starts[row.req_id] = (res.tokens[-1], start)
            self.pages[row.req_id] = -(-(start + self.steps) // page_size)

    def continues(self, rows: list[RowPlan], steps: int) -> bool:
        return steps == self.steps and all(
            row.req_id in self.starts and (row.token_ids[0], row.start_pos) ==
            self.starts[row.req_id] and row.pages_keep >= self.pages[row.req_id]
            for row in rows)  # fmt: skip


def runs_on_graphs(graphs: Any, rows: list[RowPlan], specs: list[SamplingSpec]) -> bool:
    """Whether ``graph_decode_chain`` runs these rows: a decode chain (verify rows without
    drafts) of greedy rows that a bucket holds."""
    return graphs is not None and graphs.bucket(len(rows)) is not None \
        and all(row.kind == RowKind.VERIFY and row.num_drafts == 0 for row in rows) \
        and all(spec.greedy for spec in specs)  # fmt: skip


def graph_decode_chain(worker: Any, rows: list[RowPlan], steps: int,
                       started: StartedChain | None) -> tuple[list[RowResult], float]:  # fmt: skip
    """A greedy decode chain of ``steps`` steps (``runs_on_graphs``) -> (each row's tokens, the
    seconds the host waited). ``worker``: the Worker (its requests, page table and
    ``draft_graphs``; not imported, it imports this); started: the chain the last plan started
    early, if any."""
    graphs, page_size = worker.draft_graphs, worker.page_size
    reqs = [worker.requests[row.req_id] for row in rows]
    CLOCK.mark("chain:launch")
    for row, req in zip(rows, reqs, strict=True):
        if -(-(row.start_pos + steps) // page_size) > worker.page_table.sizes[req.slot]:
            raise RuntimeError(f"request {row.req_id}: {worker.page_table.sizes[req.slot]} "
                               f"pages cannot hold {row.start_pos + steps} tokens")
    if isinstance(started, StartedChain) and started.continues(rows, steps) \
            and graphs.chain_ready(started.n, worker.kv_caches):  # fmt: skip
        n, live = started.n, {row.req_id for row in rows}
        graphs.stop_rows(n, [rid in live for rid in started.row_ids])  # finished rows stop
        row_ids = graphs.row_ids
        # uploaded through pinned memory: torch.tensor(..., device=cuda) copies from pageable
        # memory and syncs the stream, i.e. waits for the chain started early to finish
        at = upload(np.array([row_ids.index(row.req_id) for row in rows], dtype=np.int64),
                    worker.device)
        outs = [out.index_select(0, at) for out in started.outs]
        graphs.chains_continued += 1
    else:
        with CLOCK.phase("chain:run"):
            outs, _ = graphs.run(rows, [req.sampling for req in reqs],
                                 [req.slot for req in reqs],
                                 [req.scored_pages > 0 for req in reqs], steps,
                                 worker.kv_caches, keep_q=False)  # fmt: skip
        n, row_ids = graphs.bucket(len(rows)), [row.req_id for row in rows]
        graphs.row_ids = list(row_ids)
    waited_for = CLOCK.launched
    pending = DeviceResult([torch.stack(outs, dim=1).flatten()],  # [R * steps], row-major
                           spin=worker.cfg.device_wait == "spin")
    with CLOCK.phase("chain:early"):
        graphs.started = _start_next(worker, n, row_ids, rows, steps)
    flat, wait = pending.wait()
    CLOCK.mark("chain:woke", waited_for)
    flat = flat.tolist()
    results = [RowResult(row.req_id, RowKind.VERIFY, flat[r * steps : (r + 1) * steps])
               for r, row in enumerate(rows)]  # fmt: skip
    if graphs.started is not None:
        graphs.started.learn_starts(rows, results, page_size)
    return results, wait


def _start_next(worker: Any, n: int, row_ids: list[str | None], rows: list[RowPlan],
                steps: int) -> StartedChain | None:  # fmt: skip
    """Replay the chain the next plan would run, if every row has its pages."""
    graphs = worker.draft_graphs
    if not worker.cfg.spec.ar_overlap or not graphs.chain_ready(n, worker.kv_caches):
        return None
    for row in rows:  # the next chain writes KV at start_pos + steps .. start_pos + 2 steps - 1
        end = row.start_pos + 2 * steps
        if -(-end // worker.page_size) > worker.page_table.sizes[worker.requests[row.req_id].slot]:
            return None
    graphs.chains_started += 1
    return StartedChain(n, list(row_ids), steps, graphs.replay_steps(n, len(row_ids), steps))
