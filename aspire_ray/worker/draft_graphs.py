"""Draft steps of a chain as CUDA graphs that plan themselves on the device (issue 14 items 1, 3).

A draft chain (``Worker._execute_chain``) runs k greedy draft steps of the same rows, one query
each, at positions p, p + 1, ..., p + k - 1. Everything such a step needs follows from three
numbers per row kept on the device (its page-table slot, the position of its input token, the
input token) and the device tables (pages, page scores), so one graph per bucket of rows runs
the whole step, its planning included:

    plan     KV slots and page counts from the positions; the full and sparse page lists (the
             policy's ``layout``; ``step_rows.plan_rows``, one launch on a GPU), the top-k
             middle chosen from the score table; the attention and scoring work lists
             (``kernels/device_plan.py``, fixed capacities)
    layers   before the refresh layer l_r: sparse lists
    l_r      refresh while drafting (scored policies): full lists, page scores into the score
             table, the middles re-chosen from them; otherwise sparse lists
    layers   after l_r: sparse lists
    logits   the next step's input token (greedy rows: the argmax; sampled rows: a draw
             from their q, kept for the verification); position + 1

The host uploads the rows' numbers once per chain and replays the graph k times: no host
planning between the draft steps, no eager layer between two graphs. The lists and work items
are those ``StepBatch`` and the host plans give (same order, same split), so the drafts are the
same (``tests/test_draft_graphs.py``).

The decode chains of ``ar`` run on the same graphs with the ``FullPages`` policy (every row
lists all its pages, no refresh) and the target's random stream: their steps are plain decode
steps whose tokens the engine commits.

Padding rows of a bucket hold no page: no KV written, no work item, their page scores go to the
score table's scratch row. The graphs read the page and score tables at fixed addresses: a
resized table (more slots or pages than the worker sized them for) means a recapture.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from aspire_ray.kernels.host import upload
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.plan import RowPlan, SamplingSpec, Stream

from . import sampler
from .cuda_graphs import row_buckets
from .device_memory import SPARE_BYTES, RowStore
from .draft_pages import (
    PageScoreTable,
    choose_top_pages,
    rescore_first_last,
    sync_tables,
)
from .page_policies import PageSelector
from .page_table import PageTable, list_capacity
from .step_graphs import StepGraphs
from .step_rows import plan_rows, policy_layout
from .verify_graphs import VerifyGraphs

if TYPE_CHECKING:
    from aspire_ray.kernels.paged_attention import FixedPlan

_LIVE, _SCORED, _SAMPLED = 1, 2, 4  # row flag bits: a real row; has page scores; samples
# A graph variant: None (every row greedy) or the (need_k, need_p) of its sampling
# (``sampler.probs_from_logits``); a bucket has all five.
VARIANTS = [None, (False, False), (True, False), (False, True), (True, True)]
SAMPLED_VARIANTS = VARIANTS[1:]


class DraftStepGraphs:
    def __init__(self, step_graphs: StepGraphs, selector: PageSelector, refresh_layer: int,
                 refresh: bool, page_table: PageTable, scores: PageScoreTable | None,
                 max_rows: int, stream: Stream = Stream.DRAFT,
                 max_steps: int = 0, fused_rows: bool = True, kind: str = "draft",
                 spare: int = SPARE_BYTES) -> None:  # fmt: skip
        """refresh: the refresh layer attends to full lists and rescores (refresh while
        drafting with a scored policy); max_rows: the most rows of a chain; stream: the random
        stream sampled rows draw from (drafts; the target's for ar's decode chains);
        max_steps: the longest chain whose verification replays a graph (``run_rounds``; 0:
        none); fused_rows: rows planned (and rounds accepted) in one launch each
        (``step_rows``); kind: its steps' name on the graph clock ("decode": ar's chains);
        spare: bytes its q store leaves free (``device_memory.RowStore``)."""
        self.stream, self.fused_rows, self.kind = stream, fused_rows, kind
        self.step_graphs, self.pieces = step_graphs, step_graphs.pieces
        self.model = self.pieces.model
        self.selector, self.refresh_layer, self.refresh = selector, refresh_layer, refresh
        self.page_table, self.scores = page_table, scores
        self.buckets = row_buckets(self.pieces.buckets, max_rows)
        # n -> int64 [6, n]: ids, pos, slot, flags, top_k, seed; float32 [2, n]: temperature,
        # top_p (sampled rows)
        self.state: dict[int, torch.Tensor] = {}
        self.fstate: dict[int, torch.Tensor] = {}
        # n -> int64 [2, n]: a round's start (ids, pos); int64 [max_steps, n]: its drafts
        self.start: dict[int, torch.Tensor] = {}
        self.chain: dict[int, torch.Tensor] = {}
        self.max_steps = max_steps
        self.verify = VerifyGraphs(self, selector.uses_scores) if max_steps else None
        self.graphs: dict[tuple, object] = {}  # (n, variant) -> graph
        self.probs: dict[tuple, torch.Tensor] = {}  # (n, variant) -> float32 [n, V]: each q
        # sampled rounds: n -> float32 [max_steps, n, V], the q of each draft of the round,
        # every bucket a view of one store (``rounds_q``) made at the first sampled
        # verification's capture (start-up, ``capture_all``, or a round's), where the memory
        # holds it (``verifies``); coupled sampling (drafts on the target's stream) keeps no q:
        # a placeholder of one value a row
        self.coupled = stream == Stream.TARGET and kind == "draft"
        planes, vocab = (1, 1) if self.coupled else (max_steps, self.model.arch.vocab_size)
        self.rounds_q = RowStore(planes, self.buckets[-1] if self.buckets else 1, vocab,
                                 self.pieces.device, self.model.tp, spare=spare)  # fmt: skip
        self.q_round: dict[int, torch.Tensor] = {}
        self.variant = None  # the sampling variant of the rows on the device (None: greedy)
        self.plans: dict[tuple[int, bool], FixedPlan] = {}
        self._key = None
        self._pool_pages = 0
        self._layouts: torch.Tensor | None = None  # int32 [3, W + 1]: policy_layout
        self.steps = 0  # draft steps replayed
        # greedy rounds (run_rounds) and decode chains: the request of each row of the state on
        # the device (None: padding or a row that stopped), the next plan's first round or
        # chain if started early (round_runs.StartedRound, decode_chains.StartedChain), and how
        # many were started and continued
        self.row_ids: list[str | None] = []
        self.started = None
        self.rounds_started = self.rounds_continued = 0
        # `ar`'s greedy decode chains started early (decode_chains.StartedChain) and continued
        self.chains_started = self.chains_continued = 0

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    # ---- capture -------------------------------------------------------------------------------
    def _tables_key(self, kv_caches: list[torch.Tensor]) -> tuple:
        scores = self.scores.scores if self.scores is not None else None
        return (kv_caches[0].data_ptr(), self.page_table.table.data_ptr(),
                tuple(self.page_table.table.shape),
                None if scores is None else (scores.data_ptr(), tuple(scores.shape)))

    def ensure(self, n: int, variant, kv_caches: list[torch.Tensor]) -> None:
        """Bucket n's graph of this variant, captured against the current tables (recaptured
        if they moved)."""
        key = self._tables_key(kv_caches)
        if key != self._key:
            self.graphs.clear()
            self.plans.clear()  # capacities follow the pool and the tables
            if self.verify is not None:
                self.verify.clear()
            self._key, self._pool_pages = key, kv_caches[0].shape[0]
        if (n, variant) not in self.graphs:
            self._capture(n, variant, kv_caches)

    def capture_all(self, kv_caches: list[torch.Tensor], verify_steps: int = 0,
                    sampled: bool = False) -> None:  # fmt: skip
        """Every bucket's graphs; with verify_steps, the verification of chains that long, and
        with ``sampled`` its sampling variants' too, where the q store fits."""
        for n in reversed(self.buckets):
            for variant in VARIANTS:
                self.ensure(n, variant, kv_caches)
            if self.verify is not None and 1 <= verify_steps <= self.max_steps \
                    and self.verify.fits(n, verify_steps + 1):  # fmt: skip
                self.verify.ensure(n, verify_steps + 1, kv_caches)
                if sampled and self._q_round_fits(n):
                    self._round_q(n)  # the verification's sampled variants read it
                    for variant in SAMPLED_VARIANTS:
                        self.verify.ensure(n, verify_steps + 1, kv_caches, variant)

    def _plan(self, n: int, full: bool) -> FixedPlan:
        """The attention plan of bucket n's sparse (full=False) or full lists."""
        if (n, full) not in self.plans:
            from aspire_ray.kernels.paged_attention import FixedPlan  # imports triton

            attn = self.model.layers[0].self_attn
            # plans run one after another: they may share their partial buffers
            largest = max(self.plans.values(), key=lambda p: p.plan.part_rows, default=None)
            self.plans[n, full] = FixedPlan.for_decode(
                n, self._capacity(n, full), attn.q_heads, attn.kv_heads, attn.head_dim,
                self.pieces.device, self.step_graphs.config, share=largest)
        return self.plans[n, full]

    def _capacity(self, n: int, full: bool) -> int:
        """Most pages bucket n's lists hold: full lists at most the table's width each and the
        pool in all (rows never share a page), sparse lists at most the budget of the widest
        request each."""
        if full:
            return list_capacity(n, self.page_table.table, self._pool_pages)
        return min(n * self.selector.budget(self.page_table.width), self._pool_pages)

    def _capture(self, n: int, variant, kv_caches: list[torch.Tensor]) -> None:
        p = self.pieces
        with torch.inference_mode():
            p.inputs_for(n, kv_caches)
            if n not in self.state:
                self.state[n] = torch.zeros(6, n, dtype=torch.int64, device=p.device)
                self.fstate[n] = torch.ones(2, n, dtype=torch.float32, device=p.device)
                self.start[n] = torch.zeros(2, n, dtype=torch.int64, device=p.device)
                self.chain[n] = torch.zeros(max(self.max_steps, 1), n, dtype=torch.int64,
                                            device=p.device)  # fmt: skip
            self._layout(self.page_table.table.shape[1])
            fn = lambda: self._step(n, variant, kv_caches)  # noqa: E731
            graph, _ = p.capture_idle(fn, [self.state[n]], self.kind)
        self.graphs[n, variant] = graph

    # ---- the captured step ---------------------------------------------------------------------
    def _step(self, n: int, variant, kv_caches: list[torch.Tensor]) -> None:
        state = self.state[n]
        ps = kv_caches[0].shape[2]
        ids, pos, slot, flags, top_k, seed = state
        table = self.page_table.table  # int32 [slots, W]
        # the rows' tokens, KV slots and page lists (sparse; full ones for the refresh layer):
        # one launch on a GPU
        rp = plan_rows(dict(slot=slot, flags=flags, x_id=ids, x_pos=pos), self.chain[n], table,
                       self._layout(table.shape[1]), ps, n, self.pieces.inputs[n],
                       self._capacity(n, False),
                       self._capacity(n, True) if self.refresh else 0, queries=1,
                       fused=self.fused_rows)  # fmt: skip
        last = rp["last"]
        sparse = self._meta(n, rp["qo"], rp["indptr"], rp["indices"], last, ps, full=False)
        choice = None
        if self.selector.uses_scores:
            first = int(self.selector.cfg.keep_sink_page)
            choice = (rp["indices"], rp["choose"], first, self.page_table.width - first)
            sparse.kv_indices = self._choose(choice, (flags & _SCORED) > 0)

        layers, lr = self.model.layers, self.refresh_layer
        q, attn_out = self.pieces.q[:n], self.pieces.attn_out[:n]
        if not self.refresh:
            hidden = self.step_graphs.layers(n, 0, len(layers), sparse, kv_caches)
        else:
            self.step_graphs.layers(n, 0, lr, sparse, kv_caches)
            full = self._meta(n, rp["qo"], rp["full_indptr"], rp["full_indices"], last, ps,
                              full=True)  # fmt: skip
            scale = layers[lr].self_attn.scale
            out, lse = self.pieces.backend.attention(q, kv_caches[lr], full, scale,
                                                     return_lse=True)  # fmt: skip
            attn_out.copy_(out)
            live = rp["rows"][5] > 0
            self._rescore(q, lse, kv_caches[lr], scale, rp["rows"], live, slot)
            post = PagedKVMeta(sparse.qo_indptr, sparse.kv_indptr,
                               self._choose(choice, live) if choice else sparse.kv_indices,
                               sparse.kv_last_page_len, ps, fixed_plan=sparse.fixed_plan)
            flags.bitwise_or_(rp["rows"][5] * _SCORED)
            hidden = self.step_graphs.layers(n, lr + 1, len(layers), post, kv_caches)
        if variant is None:
            tokens = self.model.greedy_tokens(hidden)
        else:  # as Worker._chain_tokens draws, at position context_len
            logits, tokens = self.model.sampling_logits(hidden)
            temperature, top_p = self.fstate[n]
            probs = sampler.probs_from_logits(logits, temperature, top_k, top_p, *variant)
            drawn = sampler.sample_from_probs(probs, seed, pos + 1, self.stream)
            tokens = torch.where((flags & _SAMPLED) > 0, drawn, tokens)
            self.probs[n, variant] = probs
        ids.copy_(tokens)
        pos.add_(1)

    def _meta(self, n: int, qo: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
              last: torch.Tensor, ps: int, full: bool) -> PagedKVMeta:  # fmt: skip
        plan = self._plan(n, full)
        plan.load_decode(indptr, last, ps)
        return PagedKVMeta(qo, indptr, indices, last, ps, fixed_plan=plan)

    def _layout(self, width: int) -> torch.Tensor:
        """The policy's list layout by page count (``step_rows.policy_layout``), made before
        the first capture at this width; the verification's graphs share it."""
        if self._layouts is None or self._layouts.shape[1] != width + 1:
            self._layouts = policy_layout(self.selector, width, self.pieces.device)
        return self._layouts

    def _choose(self, choice, has_scores: torch.Tensor) -> torch.Tensor:
        template, rows, first, max_candidates = choice
        return choose_top_pages(template, self.page_table.table, self.scores, rows, has_scores,
                                first, max_candidates)  # fmt: skip

    def _rescore(self, q, lse, kv_cache, scale: float, rows: torch.Tensor, live: torch.Tensor,
                 slot: torch.Tensor) -> None:  # fmt: skip
        """Each live row's page scores (its one query's, DESIGN.md §1.2) replace its row of the
        score table; padding rows write the scratch row. rows: ``plan_rows``' int64 [6, n]."""
        end, row_slot = rows[2], rows[4]
        rescore_first_last(self.pieces.backend, q, lse, kv_cache, scale, self.page_table.table,
                           self.scores, None, None, end, end, live, slot, row_slot,
                           self._pool_pages, fused=self.fused_rows,
                           tp=self.pieces.model.tp)  # fmt: skip

    # ---- one chain -----------------------------------------------------------------------------
    def _load(self, rows: list[RowPlan], specs: list[SamplingSpec], slots: list[int],
              scored: list[bool], kv_caches: list[torch.Tensor], q: int = 0) -> tuple[int, object]:
        """Capture what the rows need (the draft graph; with q, the verification of rows of q
        queries), then upload their state -> (bucket, graph variant)."""
        n = self.bucket(len(rows))
        variant = sampling_variant(specs)
        sync_tables(self.page_table, self.scores)
        self.ensure(n, variant, kv_caches)
        if q and variant is not None:
            self._round_q(n)
        if q:
            self.verify.ensure(n, q, kv_caches, variant)
        self.variant = variant
        r, sampled = len(rows), [not spec.greedy for spec in specs]
        state = np.zeros((6, n), dtype=np.int64)
        state[0, :r] = [row.token_ids[0] for row in rows]
        state[1, :r] = [row.start_pos for row in rows]
        state[2, :r] = slots
        state[3, :r] = _LIVE | np.where(scored, _SCORED, 0) | np.where(sampled, _SAMPLED, 0)
        state[4, :r] = [spec.top_k for spec in specs]
        state[5, :r] = [spec.seed for spec in specs]
        upload(state, self.pieces.device, self.state[n])
        if variant is not None:
            fstate = np.ones((2, n), dtype=np.float32)
            fstate[0, :r] = [1.0 if spec.greedy else spec.temperature for spec in specs]
            fstate[1, :r] = [spec.top_p for spec in specs]
            upload(fstate, self.pieces.device, self.fstate[n])
        return n, variant

    def run(self, rows: list[RowPlan], specs: list[SamplingSpec], slots: list[int],
            scored: list[bool], steps: int, kv_caches: list[torch.Tensor],
            keep_q: bool = True) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Replay ``steps`` steps of ``rows`` (rows of one query; their pages in the page
        table; specs: their sampling; slots: their page-table slots; scored: whether their
        requests have page scores) -> (each step's tokens, int64 [R]; with keep_q, each step's
        q of the sampled rows in row order, float32 [V] each), on the device, no sync."""
        n, variant = self._load(rows, specs, slots, scored, kv_caches)
        r = len(rows)
        sampled = [i for i, spec in enumerate(specs) if not spec.greedy] \
            if keep_q and variant is not None else []  # fmt: skip
        drafts, qs = [], []
        for _ in range(steps):
            self.graphs[n, variant].replay()
            drafts.append(self.state[n][0, :r].clone())
            if sampled:
                # a copy per row: the graph rewrites its buffer, and each q waits alone for its
                # request's verification (a shared [S, V] copy would live until the last one)
                probs = self.probs[n, variant]
                qs.append([probs[i].clone() for i in sampled])
        self.steps += steps
        return drafts, qs

    def replay_steps(self, n: int, rows: int, steps: int) -> list[torch.Tensor]:
        """``steps`` greedy steps from the state on the device (``chain_ready``) -> each step's
        tokens of the first ``rows`` device rows, int64 [rows] on the device, no sync."""
        out = []
        for _ in range(steps):
            self.graphs[n, None].replay()
            out.append(self.state[n][0, :rows].clone())
        self.steps += steps
        return out

    def chain_ready(self, n: int, kv_caches: list[torch.Tensor]) -> bool:
        """Whether greedy steps can replay from the state on the device without a capture:
        the tables did not move, the graph exists."""
        sync_tables(self.page_table, self.scores)
        return self._tables_key(kv_caches) == self._key and (n, None) in self.graphs

    def ready(self, n: int, steps: int, kv_caches: list[torch.Tensor]) -> bool:
        """Whether rounds of ``steps`` drafts can replay from the state on the device (its
        rows' sampling variant) without a capture (a capture zeroes the state): the tables did
        not move, the graphs exist."""
        sync_tables(self.page_table, self.scores)
        return self._tables_key(kv_caches) == self._key and (n, self.variant) in self.graphs \
            and self.verify is not None \
            and (n, steps + 1, self.variant) in self.verify.graphs  # fmt: skip

    def stop_rows(self, n: int, keep: list[bool]) -> None:
        """Device rows not in ``keep`` stop (no query, no page, no KV written), from the next
        replay on."""
        keep = keep + [False] * (n - len(keep))
        self.state[n][3].mul_(upload(np.asarray(keep, dtype=np.int64), self.pieces.device))
        self.row_ids = [rid if k else None for rid, k in zip(self.row_ids, keep, strict=False)]

    def verifies(self, rows: list[RowPlan], specs: list[SamplingSpec], steps: int) -> bool:
        """Whether ``run_rounds`` runs these rounds: rows starting fresh rounds
        (``verify_after`` = [x]) of at most max_steps drafts whose verification has a bucket;
        with sampled rows, room for the bucket's ``q_round``."""
        n = self.bucket(len(rows))
        return self.verify is not None and n is not None and 1 <= steps <= self.max_steps \
            and self.verify.fits(n, steps + 1) \
            and all(len(row.verify_after or ()) == 1 for row in rows) \
            and (sampling_variant(specs) is None or self._q_round_fits(n))  # fmt: skip

    def _q_round_fits(self, n: int) -> bool:
        """Whether the rounds' q store exists or fits (``device_memory.RowStore``): the
        same for every bucket n."""
        return self.rounds_q.fits()

    def _round_q(self, n: int) -> torch.Tensor:
        """Bucket n's ``q_round``, a view of the one store (made at its first need)."""
        if n not in self.q_round:
            self.q_round[n] = self.rounds_q.view(n)
        return self.q_round[n]

    def run_rounds(self, rows: list[RowPlan], specs: list[SamplingSpec], slots: list[int],
                   scored: list[bool], steps: int, rounds: int,
                   kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:  # fmt: skip
        """``rounds`` greedy rounds of ``rows`` (``verifies``) back to back, each ``steps``
        draft steps and their verification, each round starting where the last one's
        verification left its rows -> per round int64 [R * steps + R * (steps + 1)]: the
        drafts (row-major [R, steps]), then the target's argmax ([R, steps + 1]); on the
        device, no sync."""
        n, _ = self._load(rows, specs, slots, scored, kv_caches, q=steps + 1)
        self.row_ids = [row.req_id for row in rows]
        return self.replay_rounds(n, steps, rounds)

    def replay_rounds(self, n: int, steps: int, rounds: int) -> list[torch.Tensor]:
        """``run_rounds`` from the state on the device (its rows in ``row_ids``' places;
        ``ready``); a sampled round keeps each draft step's q for its verification."""
        r, state, chain, variant = len(self.row_ids), self.state[n], self.chain[n], self.variant
        out = []
        for _ in range(rounds):
            self.start[n].copy_(state[:2])
            for s in range(steps):
                self.graphs[n, variant].replay()
                chain[s].copy_(state[0])
                if variant is not None and not self.coupled:
                    self.q_round[n][s].copy_(self.probs[n, variant])
            argmax = self.verify.replay(n, steps + 1, variant)
            # copied now: the next replay may reuse the graph pool's memory
            out.append(torch.cat([chain[:steps, :r].T.flatten(), argmax[:r].flatten()]))
        self.steps += steps * rounds
        return out


def sampling_variant(specs: list[SamplingSpec]):
    """The graph variant of rows with these sampling settings (``VARIANTS``)."""
    return None if all(spec.greedy for spec in specs) else sampler.need_flags(specs)


def table_widths(max_model_len: int, page_size: int) -> int:
    """Pages of the longest request: the width the page and score tables start at, so that
    the draft-step graphs never see them move."""
    return math.ceil(max_model_len / page_size)
