"""The shard worker: owns a model shard and its paged KV shard, runs one StepPlan per step.

One forward holds every row of the step (DESIGN.md §1.4): prefill chunks and verify rows over
all their pages, draft rows over their sparse pages; the linear layers run once over all
tokens (``step_batch.py`` flattens the rows and plans attention). On a GPU a decode step
replays one CUDA graph (``step_graphs.py``), other steps the piecewise graphs of the dense parts
(``cuda_graphs.py``); every graph and kernel variant is made by ``warmup`` before the first
real step. Per-request state kept here: a slot, the request's row of the device-resident page
table (``page_table.py``) and of the refresh-layer page-score table, and the draft
distributions q of pending drafts (sampling only).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from aspire_ray.attention import get_backend
from aspire_ray.config import EngineConfig
from aspire_ray.kernels.host import offsets, upload
from aspire_ray.model.decoder import set_fused_epilogues, set_fused_mlp, set_triton_projections
from aspire_ray.plan import (
    RowKind,
    RowPlan,
    RowResult,
    SamplingSpec,
    ShardInfo,
    StepOutput,
    StepPlan,
    StepTimings,
    Stream,
)
from aspire_ray.tp import TPGroup, single_rank
from aspire_ray.tp.layers import set_batch_invariant

from . import gc_waits, kv_budget, rejection_sampler, sampler
from .async_graphs import AsyncStepGraphs
from .async_runs import run_async
from .cuda_graphs import PiecewiseGraphs, graph_tokens
from .decode_chains import StartedChain, graph_decode_chain, runs_on_graphs
from .device_memory import SPARE_BYTES
from .draft_graphs import DraftStepGraphs, table_widths
from .draft_pages import PageScoreTable
from .graph_clock import CLOCK
from .model_loading import DTYPES, build_model
from .page_policies import FullPages, make_selector
from .page_table import PageTable
from .round_runs import StartedRound, graph_rounds
from .sampled_rows import chain_of, host_choices
from .step_batch import StepBatch
from .step_graphs import StepGraphs
from .step_resources import StepResources

logger = logging.getLogger(__name__)


@dataclass
class WorkerRequest:
    sampling: SamplingSpec
    slot: int  # this request's row of the page table (and of the score table)
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q of pending drafts, [V]
    table: PageScoreTable | None = None  # the worker's score table (scored policies only)
    scored_pages: int = 0  # pages with refresh-layer scores in that row; 0: never scored

    @property
    def scores(self) -> torch.Tensor | None:
        """float32 [scored_pages] refresh-layer page scores, or None before the first scoring."""
        if self.table is None or not self.scored_pages:
            return None
        return self.table.row(self.slot, self.scored_pages)


class Worker:
    def __init__(self, cfg: EngineConfig, tp: TPGroup | None = None,
                 device: str | None = None) -> None:
        self.cfg = cfg
        self.tp = tp or single_rank()
        self.device = torch.device(device or cfg.device)
        self.model = build_model(cfg, self.tp, self.device)
        if cfg.deterministic:
            set_batch_invariant(self.model)
        set_fused_epilogues(self.model, cfg.fused_epilogues)
        set_fused_mlp(self.model, cfg.fused_mlp and not cfg.deterministic)
        set_triton_projections(self.model, () if cfg.deterministic else cfg.triton_projections)
        self.arch = self.model.arch
        self.page_size = cfg.cache.page_size
        self.backend = get_backend(cfg.attention_backend, self.device, cfg.attention_options,
                                   cfg.deterministic)  # fmt: skip
        self.selector = make_selector(cfg.spec)
        self.refresh_layer = self._refresh_layer()
        # measured once, before the KV pool takes the device's memory (describe() reports it)
        self.memory_bandwidth = _memory_bandwidth(self.device)
        self.requests: dict[str, WorkerRequest] = {}
        # sized for max_num_seqs requests of the longest context: they never grow in use (the
        # draft-step graphs read them at fixed addresses)
        width = table_widths(cfg.scheduler.max_model_len or self.arch.max_position_embeddings,
                             self.page_size)  # fmt: skip
        slots = cfg.scheduler.max_num_seqs
        self.page_table = PageTable(self.device, width, slots)
        self.scores = PageScoreTable(self.device, width, slots) \
            if self.selector is not None and self.selector.uses_scores else None  # fmt: skip
        # all that a step's planning (StepBatch) reads of this shard: these same objects
        self.step_resources = StepResources(
            self.device, self.page_size, self.page_table, self.scores, self.selector,
            self.backend, self.tp, self.refresh_layer, cfg.spec.refresh_while_drafting)
        self.graphs = self._graphs()
        # bytes of the largest steps' transient memory, measured before the KV pool exists
        # (kv_budget.py): the pool leaves them free, and so do the graphs' q stores
        self.step_workspace = self._step_workspace()
        self.step_graphs = self._step_graphs()
        self.draft_graphs = self._draft_graphs()
        self.async_graphs = self._async_graphs()
        self.kv_caches = self._allocate_kv()
        if self.device.type == "cuda":
            self.warmup()

    # ---- setup -------------------------------------------------------------------------------
    def _graphs(self) -> PiecewiseGraphs | None:
        """CUDA graphs on a GPU with the Triton backend (its KV store skips the padding slots).
        At tp > 1 (``tp_cuda_graphs``) the collectives are captured inside: every rank makes
        the same choices from the same plans, so every rank captures and replays the same
        graphs in the same order, as NCCL requires of captured collectives."""
        if not (self.cfg.cuda_graphs and self.device.type == "cuda"
                and self.backend.name == "triton"):  # fmt: skip
            return None
        if self.tp.size > 1 and not self.cfg.tp_cuda_graphs:
            return None
        sched = self.cfg.scheduler
        max_tokens = graph_tokens(sched.max_num_batched_tokens, sched.max_num_seqs,
                                  min(self.max_q, self.query_tile or self.max_q))  # fmt: skip
        return PiecewiseGraphs(self.model, self.backend, max_tokens, self.device,
                               per_octave=self.cfg.graph_buckets_per_octave)  # fmt: skip

    @property
    def query_tile(self) -> int | None:
        """Query tokens of a row that share one KV read in this backend's attention (None:
        one read whatever the count; ``AttentionBackend.query_tile_tokens``)."""
        attn = self.model.layers[0].self_attn
        return self.backend.query_tile_tokens(attn.q_heads // attn.kv_heads)

    @property
    def max_q(self) -> int:
        """Most queries of a decode row: a verification of the most drafts a request may hold
        (``SpecConfig.max_drafts``), plus one."""
        return self.cfg.spec.max_drafts + 1

    @property
    def draft_stream(self) -> Stream:
        """The random stream a sampled draft is drawn on: its own (rejection sampling), or the
        target's (``SpecConfig.coupled_sampling``: the draft races on the noise the target's
        draw at that position will race on)."""
        return Stream.TARGET if self.cfg.spec.coupled_sampling else Stream.DRAFT

    def _step_graphs(self) -> StepGraphs | None:
        """Whole-step graphs of decode steps beside the piecewise ones; a page-scoring policy's
        refresh layer stays eager between two graphs."""
        if self.graphs is None:
            return None
        scoring = self.selector is not None and self.selector.uses_scores
        max_tokens = self.cfg.scheduler.max_num_seqs * self.max_q
        return StepGraphs(self.graphs, self.refresh_layer if scoring else None, self.max_q,
                          max_tokens, self.backend.config)  # fmt: skip

    def _draft_graphs(self) -> DraftStepGraphs | None:
        """Self-planning graphs of chain steps: draft chains (synchronized modes with chains)
        or, in ``ar``, decode chains (every page, the target's random stream)."""
        spec = self.cfg.spec
        if self.step_graphs is None or not self.cfg.draft_graphs:
            return None
        rows = self.cfg.scheduler.max_num_seqs
        if not spec.speculative:
            return None if spec.ar_chain == 1 else DraftStepGraphs(
                self.step_graphs, FullPages(spec), self.refresh_layer, False, self.page_table,
                None, rows, stream=Stream.TARGET,
                fused_rows=self.cfg.fused_row_planning, kind="decode",
                spare=self.store_spare)  # fmt: skip
        if not (spec.synchronized and spec.draft_chains):
            return None
        refresh = spec.refresh_while_drafting and self.selector.uses_scores
        # a round's verification replays a graph too (greedy rounds: their chains carry it);
        # a chain is at most the fixed gamma long: so many planes of the sampled rounds' q
        max_steps = spec.round_drafts if spec.chain_verify and self.cfg.verify_graphs else 0
        return DraftStepGraphs(self.step_graphs, self.selector, self.refresh_layer, refresh,
                               self.page_table, self.scores, rows, stream=self.draft_stream,
                               max_steps=max_steps, fused_rows=self.cfg.fused_row_planning,
                               spare=self.store_spare)  # fmt: skip

    def _async_graphs(self) -> AsyncStepGraphs | None:
        """Self-planning graphs of asynchronous runs (``aspire``, ``aspire_fsm``): a page
        policy that reads scores rescores at the refresh layer (every row while refreshing,
        verify rows only without, ``SpecConfig.draft_refresh``); one that reads none never
        refreshes."""
        spec = self.cfg.spec
        if self.step_graphs is None or not self.cfg.draft_graphs or not spec.speculative \
                or spec.synchronized or spec.async_steps == 1 \
                or (spec.refresh_while_drafting and not self.selector.uses_scores):  # fmt: skip
            return None
        return AsyncStepGraphs(self.step_graphs, self.selector, self.refresh_layer,
                               self.page_table, self.scores, self.cfg.scheduler.max_num_seqs,
                               spec.max_drafts, self.cfg.fused_row_planning,
                               spare=self.store_spare, coupled=spec.coupled_sampling,
                               refresh=spec.refresh_while_drafting,
                               lean=self.cfg.async_lean_steps)  # fmt: skip

    def _refresh_layer(self) -> int:
        n = self.arch.num_layers
        layer = self.cfg.spec.refresh_layer
        layer = n - 2 if layer is None else layer
        if not 0 <= layer < n:
            raise ValueError(f"refresh_layer must be in [0, {n - 1}], got {layer}")
        return max(layer, 0)

    def page_bytes(self) -> int:
        attn = self.model.layers[0].self_attn
        elem = torch.tensor([], dtype=DTYPES[self.cfg.dtype]).element_size()
        return self.arch.num_layers * 2 * self.page_size * attn.kv_heads * attn.head_dim * elem

    def _step_workspace(self) -> int:
        """The largest steps' peak transient bytes on a GPU (``kv_budget.step_workspace``:
        an eager step and, with graphs, a captured one); 0 on the CPU."""
        if self.device.type != "cuda":
            return 0
        buckets = self.graphs.buckets if self.graphs is not None else None
        shapes = kv_budget.step_shapes(self.cfg.scheduler, self.max_q, buckets)
        return kv_budget.step_workspace(self.model, shapes, kv_budget.CudaMemory(self.device))

    @property
    def store_spare(self) -> int:
        """Bytes a graph store made after the KV pool leaves free (``device_memory.RowStore``):
        the step workspace, 1 GiB at least."""
        return max(SPARE_BYTES, self.step_workspace)

    def _allocate_kv(self) -> list[torch.Tensor]:
        free = kv_budget.CudaMemory(self.device).free() if self.device.type == "cuda" else None
        num_pages = kv_budget.pool_pages(self.cfg.cache, self.page_bytes(), free,
                                         self.step_workspace)  # fmt: skip
        attn = self.model.layers[0].self_attn
        shape = (num_pages, 2, self.page_size, attn.kv_heads, attn.head_dim)
        dtype = DTYPES[self.cfg.dtype]
        return [torch.zeros(shape, dtype=dtype, device=self.device)
                for _ in range(self.arch.num_layers)]

    @property
    def num_pages(self) -> int:
        return self.kv_caches[0].shape[0]

    def graph_clock(self, start: bool) -> dict | None:
        """Benchmarks: start timing every graph replay on the GPU (start=True; None), or stop
        and return the replays and host marks on the GPU's clock (``GraphClock.collect``)."""
        if start:
            CLOCK.start()
            return None
        return CLOCK.collect()

    def graph_counters(self) -> dict[str, int]:
        """Counts so far (tests, benchmarks): forwards replayed whole as one graph, by graph
        family ("step", "chain", "verify", "async"), and the plans whose successor's first
        steps started on the device before the host had their tokens ("*_started": async
        runs, greedy rounds, decode chains) and of them those the next plan continued
        ("*_continued"; the others were dropped and replayed: no overlap for that plan;
        "runs_dropped_WHY" by the reason, ``async_runs.Started.mismatch``). Empty without
        graphs."""
        out = {}
        d, a = self.draft_graphs, self.async_graphs
        families = {"step": self.step_graphs, "chain": d, "verify": d and d.verify, "async": a}
        out.update({name: g.steps for name, g in families.items() if g is not None})
        if d is not None:
            out.update(rounds_started=d.rounds_started, rounds_continued=d.rounds_continued,
                       chains_started=d.chains_started, chains_continued=d.chains_continued)
        if a is not None:
            out.update(runs_started=a.runs_started, runs_continued=a.runs_continued,
                       **{f"runs_dropped_{why}": k for why, k in sorted(a.runs_dropped.items())})
        return out

    def describe(self) -> ShardInfo:
        """What the driver needs to know about this shard."""
        return ShardInfo(
            num_pages=self.num_pages,
            num_layers=self.arch.num_layers,
            vocab_size=self.arch.vocab_size,
            max_position_embeddings=self.arch.max_position_embeddings,
            eos_token_ids=tuple(self.arch.eos_token_ids),
            refresh_layer=self.refresh_layer,
            device_name=torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda" else "cpu",
            kv_bytes_per_token=self.page_bytes() // self.page_size,
            weight_bytes=sum(p.numel() * p.element_size()
                             for name, p in self.model.named_parameters()
                             if "embed_tokens" not in name),
            memory_bandwidth=self.memory_bandwidth,
            tp_size=self.tp.size,
            query_tile_tokens=self.query_tile,
        )

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        # the garbage collections due while it runs wait for its waits on the device
        with gc_waits.deferred(self.cfg.gc_at_waits):
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        for rid in plan.dropped_req_ids:
            self._drop(rid)
        for rid, spec in plan.new_requests.items():
            self._drop(rid)
            self.requests[rid] = WorkerRequest(spec, self.page_table.acquire(), table=self.scores)
        for row in plan.rows:
            self.page_table.update(self.requests[row.req_id].slot, row.pages_keep, row.pages_new)
        if self.async_graphs is not None and (not plan.rows or plan.rows[0].async_gamma is None):
            self.async_graphs.drop_started("plan")  # a run started early that this plan is not
        started = None  # a round or decode chain started early: only its own kind continues it
        if self.draft_graphs is not None:
            started, self.draft_graphs.started = self.draft_graphs.started, None
        if not plan.rows:
            return StepOutput(plan.step_id, [], _synced_once(t0, wait=0.0))
        if plan.rows[0].async_gamma is not None:
            results, wait, refresh = run_async(self, plan.rows)
            return StepOutput(plan.step_id, results, _synced_once(t0, wait, refresh))
        steps = max(row.num_steps for row in plan.rows)
        if steps > 1 or plan.rows[0].verify_after is not None:
            return self._execute_chain(plan.step_id, plan.rows, steps, t0, started)
        hidden, batch, t1 = self._forward(plan.rows)
        self._sync()
        t2 = time.perf_counter()
        results = self._sample(plan.rows, hidden, batch.logit_offsets)
        self._sync()
        t3 = time.perf_counter()
        timings = StepTimings(prepare=t1 - t0, forward=t2 - t1, sample=t3 - t2,
                              refresh=batch.attention.refresh_seconds, total=t3 - t0)
        return StepOutput(plan.step_id, results, timings)

    def _forward(self, rows: list[RowPlan], device_tokens=None, shift: int = 0):
        """Plan the step and enqueue its forward (no device sync) -> (the final hidden states
        at its N logit rows [N, hidden], the StepBatch, the time planning ended); the float32
        logits are made from them a run of rows at a time (``logit_runs``). device_tokens:
        (index, ids), int64 tensors on the device, input tokens the host does not know yet (a
        draft chain: tokens[index] = ids); shift: added to the rows' start_pos (step ``shift``
        of a draft chain)."""
        num_tokens = sum(row.num_tokens for row in rows)
        bucket = self.graphs.bucket(num_tokens) if self.graphs is not None else None
        # captures come first: they overwrite the bucket's inputs
        decode = all(row.kind != RowKind.PREFILL and row.num_tokens <= self.max_q
                     for row in rows)  # fmt: skip
        whole = bucket is not None and self.step_graphs is not None and decode \
            and self.step_graphs.ensure(bucket, self.kv_caches)  # fmt: skip
        graph_inputs = self.graphs.inputs_for(bucket, self.kv_caches) if bucket else None
        reqs = [self.requests[row.req_id] for row in rows]
        batch = StepBatch(self.step_resources, rows, [req.slot for req in reqs],
                          [req.scored_pages > 0 for req in reqs], graph_inputs=graph_inputs,
                          device_tokens=device_tokens, shift=shift)  # fmt: skip
        for r, pages in batch.scored_now.items():  # their scores once the refresh layer ran
            reqs[r].scored_pages = pages
        t1 = time.perf_counter()
        if whole and self.step_graphs.load(bucket, batch.attention):
            hidden = self.step_graphs.run(bucket, num_tokens, batch.attention, self.kv_caches)
        elif bucket:
            hidden = self.graphs.run(bucket, num_tokens, batch.attention, self.kv_caches)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.attention,
                                self.kv_caches)  # fmt: skip
        return hidden[batch.logit_index], batch, t1

    def logit_runs(self, hidden: torch.Tensor, offsets: list[int]):
        """A step's float32 logits in runs of whole rows (``sampler.row_runs``): yields (a, b,
        the run's offsets from its first logit row, its logits [offsets[b] - offsets[a], V])
        from hidden [N, hidden] at the step's logit rows (offsets [n + 1]). A large step's
        [N, V] never exists whole (10 GB at 16,384 rows x Qwen2.5's 152k vocabulary; a run
        is 1.2 GB): each run's logits are made as it is sampled, and dropped before the next
        (the caller deletes its reference). Each rank of a tensor-parallel group runs the
        same runs (the LM head gathers the vocabulary)."""
        for a, b, run in sampler.row_runs(offsets, sampler.HOST_SAMPLE_ROWS):
            yield a, b, run, self.model.compute_logits(hidden[offsets[a] : offsets[b]])

    def _execute_chain(self, step_id: int, rows: list[RowPlan], steps: int, t0: float,
                       started: StartedRound | StartedChain | None = None,
                       ) -> StepOutput:  # fmt: skip
        """A draft chain: ``steps`` draft steps of the same rows back to back, then, if the
        rows say so (``verify_after``), their verification (sampled rows: by their choices,
        ``sampled_rows``). Step s drafts at
        position start_pos + s from step s - 1's drafts, which stay on the device, as do the
        verify rows' draft inputs; sampled rows draw on the device too and keep each draft's
        q. Or a decode chain (``ar``: verify rows without drafts): ``steps`` decode steps, each
        step's tokens the next one's inputs. The host syncs once, at the end. Rows of
        ``num_rounds`` R > 1: R rounds back to back, each starting after the tokens the last
        one committed (one sync per round, no engine round trip between them). started: the
        round or decode chain the last plan started early, if any."""
        decode = rows[0].kind == RowKind.VERIFY
        verify = rows[0].verify_after is not None
        for row in rows:
            if decode:
                ok = row.kind == RowKind.VERIFY and row.num_drafts == 0
            else:
                ok = row.kind == RowKind.DRAFT and (row.verify_after is not None) == verify
            if not ok or row.num_steps != steps:
                raise ValueError(f"a chain holds draft rows of {steps} steps only (all "
                                 f"verifying after or none) or verify rows without "
                                 f"drafts of {steps} steps, got {row.kind.name} row "
                                 f"{row.req_id!r} of {row.num_steps}")
        rounds = rows[0].num_rounds
        if any(row.num_rounds != rounds for row in rows) or (rounds > 1 and not verify):
            raise ValueError("a plan's rounds hold verifying chain rows of one round count")
        graphs, specs = self.draft_graphs, [self.requests[row.req_id].sampling for row in rows]
        if verify and graphs is not None and graphs.verifies(rows, specs, steps):
            results, wait = graph_rounds(self, rows, specs, steps, rounds, started)
            return StepOutput(step_id, results, _synced_once(t0, wait))
        if decode and runs_on_graphs(graphs, rows, specs):
            results, wait = graph_decode_chain(self, rows, steps, started)
            return StepOutput(step_id, results, _synced_once(t0, wait))
        results, refresh, wait = self._chain_round(rows, steps, verify)
        last = results
        for _ in range(rounds - 1):  # the next round starts after each row's committed tokens
            rows = [row.next_round(res.verified.tokens) for row, res in zip(rows, last,
                                                                            strict=True)]
            last, more_refresh, more_wait = self._chain_round(rows, steps, verify)
            refresh, wait = refresh + more_refresh, wait + more_wait
            for first, res in zip(results, last, strict=True):
                first.rounds.append(res)
        return StepOutput(step_id, results, _synced_once(t0, wait, refresh))

    def _chain_round(self, rows: list[RowPlan], steps: int,
                     verify: bool) -> tuple[list[RowResult], float, float]:  # fmt: skip
        """One chain (and its verification) -> (each row's result, the refresh layer's
        seconds, the seconds the host waited for the device)."""
        drafts, refresh = self._draft_graph_chain(rows, steps), 0.0
        if drafts is None:  # one planned forward per step
            first = torch.arange(len(rows), device=self.device)  # a draft row's input token
            tokens, drafts = None, []
            for s in range(steps):
                hidden, batch, _ = self._forward(
                    rows, None if tokens is None else (first, tokens), shift=s)
                # one logit row per row: at most max_num_seqs rows, whole
                tokens = self._chain_tokens(rows, self.model.compute_logits(hidden), s)  # [R]
                drafts.append(tokens)
                refresh += batch.attention.refresh_seconds
        out = torch.stack(drafts, dim=1).flatten()  # [R * steps], row-major
        if verify:  # inputs [x_n, d_1..d_d] known on the host, the chain's drafts after them
            known = np.array([len(row.verify_after) for row in rows], dtype=np.int64)
            at = np.repeat(offsets(known + steps)[:-1] + known, steps) + \
                np.tile(np.arange(steps), len(rows))  # fmt: skip
            vrows = [row.verify_row([0] * steps) for row in rows]
            hidden, batch, _ = self._forward(vrows, (upload(at, self.device), out))
            choices = self._round_choices(rows, vrows, out.view(len(rows), steps), hidden,
                                          batch.logit_offsets)  # fmt: skip
            out = torch.cat([out, choices])
            refresh += batch.attention.refresh_seconds
        t1 = time.perf_counter()
        flat = out.tolist()  # the chain's one device sync
        wait = time.perf_counter() - t1
        results, n = [], len(rows) * steps
        for r, row in enumerate(rows):
            chain = flat[r * steps : (r + 1) * steps]
            res = RowResult(row.req_id, row.kind, chain)
            if verify:
                lo, hi = batch.logit_offsets[r], batch.logit_offsets[r + 1]
                accepted, committed = rejection_sampler.verify_greedy(
                    flat[n + lo : n + hi], row.verify_after[1:] + chain)
                res.verified = RowResult(row.req_id, RowKind.VERIFY, committed, accepted)
            results.append(res)
        return results, refresh, wait

    def _round_choices(self, rows: list[RowPlan], vrows: list[RowPlan], drafts: torch.Tensor,
                       hidden: torch.Tensor, offsets: list[int]) -> torch.Tensor:  # fmt: skip
        """The choices of a round's verify rows (hidden [N, hidden] at their logit rows,
        ``logit_runs``): the argmax, and where sampled requests are among them
        ``sampled_rows.host_choices``: drafts int64 [R, steps] the chain's, after each row's
        drafts held before it; the q of all of them in ``draft_probs``, which the verification
        empties."""
        reqs = [self.requests[row.req_id] for row in rows]
        if all(req.sampling.greedy for req in reqs):
            parts = []
            for *_, logits in self.logit_runs(hidden, offsets):
                parts.append(logits.argmax(dim=-1))
                del logits  # before the next run's
            return torch.cat(parts)
        held = [row.num_drafts for row in vrows]
        # the drafts held before the chain (host), then the chain's (device) after them
        chain = chain_of([row.verify_after[1:] for row in rows], self.device)
        known = np.array([len(row.verify_after) - 1 for row in rows], dtype=np.int64)
        at = upload(known[None, :] + np.arange(drafts.shape[1])[:, None], self.device)
        chain = torch.cat([chain, chain.new_zeros(drafts.shape[1], len(rows))]).scatter_(
            0, at, drafts.T.contiguous())  # [D, R]
        parts = []
        for a, b, run, logits in self.logit_runs(hidden, offsets):
            choices, _ = host_choices(
                logits, logits.argmax(dim=-1), run, [True] * (b - a), held[a:b],
                [row.start_pos for row in vrows[a:b]], chain[:, a:b],
                [req.sampling for req in reqs[a:b]],
                [req.draft_probs[:h] for req, h in zip(reqs[a:b], held[a:b], strict=True)],
                coupled=self.cfg.spec.coupled_sampling)  # fmt: skip
            parts.append(choices)
            del logits
        for req in reqs:
            req.draft_probs.clear()
        return torch.cat(parts)

    def _chain_tokens(self, rows: list[RowPlan], logits: torch.Tensor, shift: int) -> torch.Tensor:
        """Step ``shift`` of a chain: each row's token (logits [R, V], one per row) on the
        device: greedy rows' argmax, sampled rows' draw at position context_len + shift (a
        draft row's as ``_draw_single`` draws it, its q joining the request's pending drafts;
        a decode row's as the verification of no draft draws it)."""
        tokens = logits.argmax(dim=-1)
        offsets = list(range(len(rows) + 1))
        probs = self._probs(rows, logits, offsets)
        if probs is None:
            return tokens
        drafting = rows[0].kind == RowKind.DRAFT
        which = [r for r, row in enumerate(rows)
                 if not self.requests[row.req_id].sampling.greedy]  # fmt: skip
        dev = probs.device
        at = sampler.i64(which, dev)
        q = probs[at]  # [k, V], the sampled rows
        seeds = sampler.i64([self.requests[rows[r].req_id].sampling.seed for r in which], dev)
        positions = sampler.i64([rows[r].context_len + shift for r in which], dev)
        tokens = tokens.index_copy(0, at, sampler.sample_from_probs(
            q, seeds, positions, self.draft_stream if drafting else Stream.TARGET))  # fmt: skip
        keep = drafting and not self.cfg.spec.coupled_sampling  # coupled: no q is read again
        for r, q_row in zip(which, q.unbind(0) if keep else [], strict=False):
            # its own copy: a view would keep all k rows alive until its verification
            self.requests[rows[r].req_id].draft_probs.append(q_row.clone())
        return tokens

    def _draft_graph_chain(self, rows: list[RowPlan], steps: int) -> list[torch.Tensor] | None:
        """The chain's draft steps replayed by the draft-step graphs -> each step's drafts
        (int64 [R] on the device), or None where they do not run (no graphs; too many rows)."""
        graphs = self.draft_graphs
        if graphs is None or graphs.bucket(len(rows)) is None:
            return None
        reqs = [self.requests[row.req_id] for row in rows]
        slots = [req.slot for req in reqs]
        final = [-(-(row.start_pos + steps) // self.page_size) for row in rows]
        for row, slot, pages in zip(rows, slots, final, strict=True):
            if pages > self.page_table.sizes[slot]:
                raise RuntimeError(f"request {row.req_id}: {self.page_table.sizes[slot]} pages "
                                   f"cannot hold {row.start_pos + steps} tokens")
        drafts, qs = graphs.run(rows, [req.sampling for req in reqs], slots,
                                [req.scored_pages > 0 for req in reqs], steps, self.kv_caches,
                                keep_q=rows[0].kind == RowKind.DRAFT
                                and not self.cfg.spec.coupled_sampling)  # fmt: skip
        if graphs.refresh:  # every step scored every row
            for req, pages in zip(reqs, final, strict=True):
                req.scored_pages = pages
        sampled = [req for req in reqs if not req.sampling.greedy]
        for q in qs:  # each step's q of the sampled rows, in row order, each its own copy
            for req, q_row in zip(sampled, q, strict=True):
                req.draft_probs.append(q_row)
        return drafts

    def _drop(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None:
            self.page_table.release(req.slot)

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Capture the CUDA graphs and compile every kernel variant before the first real step.

        Triton compiles each constexpr variant on first use (~1 s): the attention query tile of
        each verify length d + 1 (d = 0..d_max), with and without the refresh layer's
        log-sum-exp, split-KV merges, page scoring. Synthetic steps run them all through
        ``execute``: two prefills long enough for split-KV rows, then per d a verify row beside
        a draft row; the requests are dropped after. Their KV lands in pages no request owns
        yet (this runs in the constructor).

        A capture that runs out of memory fails the start-up (RuntimeError naming the settings
        to lower), as vLLM's does: the pool left the steps' measured workspace free
        (``kv_budget.py``), and running every step eagerly instead cost `aspire` a third of its
        speed, behind a warning. A sampled variant whose q store does not fit is left out,
        with a warning (its requests' steps planned on the host); other capture failures still
        leave the worker eager, with a warning.
        """
        spec, ps = self.cfg.spec, self.page_size
        if self.graphs is not None:
            gc.collect()  # earlier engines' graphs go now, not during a capture
            if self.tp.size > 1:  # NCCL sets up its communicator on first use: not in a capture
                self.tp.all_reduce(torch.zeros(1, device=self.device))
                torch.cuda.synchronize(self.device)
            try:
                self.graphs.capture_all(self.kv_caches)
                self.step_graphs.capture_all(self.kv_caches)
                sampled = self.cfg.sampled_graphs_at_start
                if self.draft_graphs is not None:
                    self.draft_graphs.capture_all(self.kv_caches, verify_steps=spec.gamma,
                                                  sampled=sampled)  # fmt: skip
                if self.async_graphs is not None:
                    self.async_graphs.capture_all(self.cfg.scheduler.max_num_seqs,
                                                  self.kv_caches, sampled)  # fmt: skip
                if sampled:
                    self._warn_unmade_stores()
            except torch.OutOfMemoryError as e:
                # the pool is sized to leave the steps' workspace free (kv_budget.py): a capture
                # that still runs out is no reason to run every step eagerly (a third slower)
                raise RuntimeError(self._capture_oom_message()) from e
            except Exception as e:  # noqa: BLE001  keep serving, eagerly, and say why
                if self.tp.size > 1:  # the other ranks captured: running eagerly here would
                    raise  # pair this rank's collectives with their graphs' ones
                logger.warning("CUDA graph capture failed, running eagerly: %s", e, exc_info=True)
                self.graphs = self.step_graphs = self.draft_graphs = self.async_graphs = None
        max_d = self.max_q - 1
        # 65 pages: the attention splits such rows (chunks of >= 32 pages) and merges them
        ctx = min(64 * ps + 1, (self.num_pages // 2) * ps - max_d - 1)
        if ctx < 1:
            return
        need = -(-(ctx + max_d + 1) // ps)
        ids = [i % self.arch.vocab_size for i in range(max(ctx, max_d + 1))]
        greedy = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0)
        names = ("__warmup_a", "__warmup_b")
        rows = [RowPlan(rid, RowKind.PREFILL, ids[:ctx], 0, 0,
                        list(range(i * need, (i + 1) * need)))
                for i, rid in enumerate(names)]  # fmt: skip
        self.execute(StepPlan(-1, rows, new_requests={rid: greedy for rid in names}))
        for d in range(max_d + 1):
            rows = [RowPlan(names[0], RowKind.VERIFY, ids[: d + 1], ctx, need, [], num_drafts=d)]
            if spec.speculative:
                rows.append(RowPlan(names[1], RowKind.DRAFT, ids[:1], ctx, need, []))
            self.execute(StepPlan(-1, rows))
        self.execute(StepPlan(-1, [], dropped_req_ids=list(names)))

    def _capture_oom_message(self) -> str:
        c, sched = self.cfg.cache, self.cfg.scheduler
        pool = self.num_pages * self.page_bytes() / 2**30
        return (f"CUDA graph capture ran out of memory: the KV pool holds {self.num_pages} "
                f"pages ({pool:.2f} GiB) and left {self.step_workspace / 2**30:.2f} GiB for the "
                f"steps' workspace. Lower gpu_memory_utilization ({c.gpu_memory_utilization}) "
                f"or the pool's num_pages / kv_cache_memory_bytes, max_num_seqs "
                f"({sched.max_num_seqs}) or max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}); or set cuda_graphs=False to run every "
                f"step eagerly")

    def _warn_unmade_stores(self) -> None:
        """Say so where a sampling variant was left uncaptured at start-up because its store
        of the drafts' q did not fit beside the pool (``device_memory.RowStore``): sampled
        requests' steps of that family are then planned on the host."""
        stores = []
        if self.async_graphs is not None:
            stores.append(("asynchronous runs", self.async_graphs.rows_q))
        if self.draft_graphs is not None and self.draft_graphs.verify is not None:
            stores.append(("round verifications", self.draft_graphs.rounds_q))
        for family, store in stores:
            if not store.fits():
                logger.warning(
                    "the q store of sampled %s (%.2f GiB) does not fit beside the KV pool "
                    "and %.2f GiB of step workspace: their sampled variants are not captured "
                    "and sampled requests' steps are planned on the host (slower); lower "
                    "max_num_seqs or gpu_memory_utilization to make room", family,
                    store.nbytes / 2**30, store.spare / 2**30)  # fmt: skip

    def _sync(self) -> None:
        if self.device.type == "cuda":
            gc_waits.collect()  # while the device works (inside ``execute``'s deferral)
            torch.cuda.synchronize(self.device)

    # ---- sampling and verification -----------------------------------------------------------
    def _sample(self, rows: list[RowPlan], hidden: torch.Tensor,
                offsets: list[int]) -> list[RowResult]:
        """Each row's result from the step's hidden states at its logit rows [N, hidden]
        (offsets [n + 1]: each row's logit rows), in runs of rows of at most
        ``sampler.HOST_SAMPLE_ROWS`` logit rows (``logit_runs``) so that a large step's
        logits, sampling distributions and verified q never exist all at once (a draw
        depends only on its row: the same tokens; a run syncs once)."""
        results = []
        for a, b, run, logits in self.logit_runs(hidden, offsets):
            results += self._sample_run(rows[a:b], logits, run)
            del logits  # before the next run's
        return results

    def _sample_run(self, rows: list[RowPlan], logits: torch.Tensor,
                    offsets: list[int]) -> list[RowResult]:  # fmt: skip
        probs = self._probs(rows, logits, offsets)
        # one device sync for every greedy choice; none in an all-sampled step
        any_greedy = any(self.requests[row.req_id].sampling.greedy for row in rows)
        argmax = logits.argmax(dim=-1).tolist() if any_greedy else []
        drawn = self._draw_single(rows, probs, offsets) if probs is not None else {}
        verified = self._verify_sampled(rows, probs, offsets) if probs is not None else {}
        kept = self._sampled_draft_probs(rows, probs, offsets) \
            if probs is not None and not self.cfg.spec.coupled_sampling else {}  # fmt: skip
        results = []
        for r, row in enumerate(rows):
            req = self.requests[row.req_id]
            spec = req.sampling
            lo, hi = offsets[r], offsets[r + 1]
            if row.kind == RowKind.PREFILL and not row.sample:
                results.append(RowResult(row.req_id, row.kind, []))
                continue
            if row.kind == RowKind.VERIFY:
                drafts = row.token_ids[1:]
                if spec.greedy:
                    n_acc, tokens = rejection_sampler.verify_greedy(argmax[lo:hi], drafts)
                else:
                    n_acc, tokens = verified[r]
                req.draft_probs.clear()
                results.append(RowResult(row.req_id, row.kind, tokens, n_acc))
                continue
            # PREFILL (sample) and DRAFT: one token at position context_len
            if spec.greedy:
                token = argmax[lo]
            else:
                token = drawn[r]
                if row.kind == RowKind.DRAFT and r in kept:
                    req.draft_probs.append(kept[r])
            results.append(RowResult(row.req_id, row.kind, [token]))
        return results

    def _sampled_draft_probs(self, rows: list[RowPlan], probs: torch.Tensor,
                             offsets: list[int]) -> dict[int, torch.Tensor]:
        """Each sampled draft row's q (row -> float32 [V]), a copy of its own row only: q waits
        up to d_max steps for its verification, and a view of the step's [N, V] probabilities
        (or of a [k, V] gather of the draft rows) would keep all those rows alive as long
        (~1 GB per step at V = 152k, N = 2k)."""
        return {r: probs[offsets[r]].clone() for r, row in enumerate(rows)
                if row.kind == RowKind.DRAFT and not self.requests[row.req_id].sampling.greedy}

    def _verify_sampled(self, rows: list[RowPlan], probs: torch.Tensor,
                        offsets: list[int]) -> dict[int, tuple[int, list[int]]]:  # fmt: skip
        """(accepted, tokens) of every non-greedy verify row (row -> result), verified in one
        batch: per-row verification costs two device syncs per row."""
        which, batch, q = [], [], []
        for r, row in enumerate(rows):
            req = self.requests[row.req_id]
            if row.kind != RowKind.VERIFY or req.sampling.greedy:
                continue
            drafts = row.token_ids[1:]
            which.append(r)
            batch.append(rejection_sampler.SampledVerify(offsets[r], drafts, req.sampling.seed,
                                                         row.start_pos + 1))
            q += req.draft_probs[: len(drafts)]
        if not which:
            return {}
        if self.cfg.spec.coupled_sampling:
            return dict(zip(which, rejection_sampler.verify_coupled_batch(probs, batch),
                            strict=True))  # fmt: skip
        draft_probs = torch.stack(q) if q else None
        results = rejection_sampler.verify_sampled_batch(probs, batch, draft_probs)
        return dict(zip(which, results, strict=True))

    def _draw_single(self, rows: list[RowPlan], probs: torch.Tensor,
                     offsets: list[int]) -> dict[int, int]:  # fmt: skip
        """The token of every non-greedy draft row and sampling prefill row (row -> token), one
        batched draw per random stream instead of a draw (and a device sync) per row; the draw
        of a row depends only on its own (seed, position, stream)."""
        groups: dict[Stream, list[int]] = {self.draft_stream: [], Stream.TARGET: []}
        for r, row in enumerate(rows):
            if self.requests[row.req_id].sampling.greedy or row.kind == RowKind.VERIFY \
                    or (row.kind == RowKind.PREFILL and not row.sample):  # fmt: skip
                continue
            groups[self.draft_stream if row.kind == RowKind.DRAFT else Stream.TARGET].append(r)
        drawn: dict[int, int] = {}
        for stream, rs in groups.items():
            if not rs:
                continue
            dev = probs.device
            seeds = sampler.i64([self.requests[rows[r].req_id].sampling.seed for r in rs], dev)
            positions = sampler.i64([rows[r].context_len for r in rs], dev)
            picked = probs[sampler.i64([offsets[r] for r in rs], dev)]
            tokens = sampler.sample_from_probs(picked, seeds, positions, stream).tolist()
            drawn.update(zip(rs, tokens, strict=True))
        return drawn

    def _probs(self, rows: list[RowPlan], logits: torch.Tensor,
               offsets: list[int]) -> torch.Tensor | None:
        """Sampling distributions for every logit row of non-greedy requests (others: unused)."""
        specs = []
        for r, row in enumerate(rows):
            specs += [self.requests[row.req_id].sampling] * (offsets[r + 1] - offsets[r])
        if all(s.greedy for s in specs):
            return None
        dev = logits.device
        temp = sampler.f32([s.temperature if not s.greedy else 1.0 for s in specs], dev)
        top_k = sampler.i64([s.top_k for s in specs], dev)
        top_p = sampler.f32([s.top_p for s in specs], dev)
        return sampler.probs_from_logits(logits, temp, top_k, top_p, *sampler.need_flags(specs))


def _synced_once(t0: float, wait: float, refresh: float = 0.0) -> StepTimings:
    """Timings of a step begun at t0 (perf_counter) that syncs with the device once, at its
    end, after waiting ``wait`` seconds: the wait is the forward the host sees, the rest of
    its time preparing (the device ran while the host planned the next forwards)."""
    total = time.perf_counter() - t0
    return StepTimings(prepare=total - wait, forward=wait, refresh=refresh, total=total)


def _memory_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float | None:
    """Device memory bandwidth in bytes/s: the best of a few device-to-device copies of nbytes
    (bytes read + bytes written over the time); None on CPU or without memory to spare."""
    if device.type != "cuda":
        return None
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except torch.cuda.OutOfMemoryError:
        return None
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / best if best > 0 else None
