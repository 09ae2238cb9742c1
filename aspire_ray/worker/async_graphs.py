"""An asynchronous run's steps as CUDA graphs that plan themselves on the device (issue 14
items 1-3 for ``aspire``; ``async_runs.py`` says what a run is).

A step of a run mixes draft rows (one query, sparse page lists) and verify rows (d + 1 queries
[x_n, d_1..d_d], every page) in one forward. Everything it needs follows from a few numbers
per row kept on the device, so one graph per (row bucket n, token bucket t) runs the whole
step, its planning included:

    state    per row: page-table slot, flags, draft length g, drafts held d, x_n and its
             position p; the pending drafts (chain [max_drafts, n])
    plan     a row verifies when d >= g: its queries (1 or d + 1) and their tokens, positions
             and KV slots; page lists (draft rows: the policy's sparse list with its top-k
             middle chosen from the score table; verify rows: every page) and the attention
             work of rows of ragged queries (``FixedPlan.load_rows``; every verify row in one
             launch of the widest query tile, draft rows in another); the tokens and lists
             are ``step_rows.plan_rows``, one launch on a GPU
    l_r      with a scored policy refreshing while drafting: every row attends to all its
             pages and rescores them (draft rows from their query, verify rows from their
             first and last); draft rows' middles are re-chosen from the new scores for the
             layers after l_r. Without the refresh (``SpecConfig.draft_refresh`` False, as
             specattn) l_r reads the step's own lists and only verify rows rescore: their
             full lists' log-sum-exp is the one scoring needs
    accept   draft rows: the argmax joins their drafts; verify rows: a = the longest prefix
             of drafts equal to the argmax, then x_n = argmax[a] at p + a + 1, no drafts held
             (``step_rows.accept_rows``, one launch on a GPU)
    sampled  rows of sampled requests (a graph variant per (need_k, need_p), captured at
             start-up, ``capture_all``, or at first use): the argmax becomes each query's
             choice (``sampled_rows``): draft rows' draws, whose q is kept on the device
             (q_store), and speculative rejection sampling's accepted drafts and last draw
             for verify rows, so that the same acceptance moves them on

The host knows each step's queries before the run (``RowPlan.async_kinds``), so it picks each
step's token bucket, uploads the rows' numbers once and replays one graph per step; each
step's argmax is copied out for the host's bookkeeping, and the run syncs once.

Padding rows (flags 0) hold no query and no page; tokens past a step's last query are the
token bucket's padding (no KV written, no work item).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np
import torch

from aspire_ray.kernels.host import upload
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.plan import RowPlan

from .cuda_graphs import row_buckets
from .device_memory import SPARE_BYTES, RowStore
from .draft_graphs import SAMPLED_VARIANTS, sampling_variant
from .draft_pages import PageScoreTable, choose_top_pages, rescore_first_last, sync_tables
from .graph_clock import CLOCK
from .page_policies import PageSelector
from .page_table import PageTable, list_capacity
from .sampled_rows import sampled_choices
from .step_graphs import StepGraphs
from .step_rows import accept_rows, plan_rows, policy_layout

if TYPE_CHECKING:
    from aspire_ray.kernels.paged_attention import FixedPlan
    from aspire_ray.plan import SamplingSpec

_LIVE, _SCORED, _SAMPLED = 1, 2, 4  # row flag bits: a real row; has page scores; samples


class AsyncStepGraphs:
    def __init__(self, step_graphs: StepGraphs, selector: PageSelector, refresh_layer: int,
                 page_table: PageTable, scores: PageScoreTable | None, max_rows: int,
                 max_drafts: int, fused_rows: bool = True,
                 spare: int = SPARE_BYTES, coupled: bool = False,
                 refresh: bool = True, lean: bool = True) -> None:  # fmt: skip
        """selector: the draft page policy; with one that reads scores (scores given) every
        row rescores its pages at the refresh layer (refresh while drafting); max_drafts:
        the most drafts a row holds (a verify row has one query more); fused_rows: rows
        planned and accepted in one launch each (``step_rows``); spare: bytes its q store
        leaves free (``device_memory.RowStore``); coupled: sampled rows draft and verify on
        one noise (``SpecConfig.coupled_sampling``), no q kept; refresh: with scores, draft
        rows rescore at the refresh layer too (``SpecConfig.refresh_while_drafting``), else
        verify rows only; lean: the steps that hold no verify row replay a graph of their own
        (``EngineConfig.async_lean_steps``, ``lean_step``): one query tile's attention launch a
        layer, not one more for verify rows' wide tile (an empty launch of ~1,000 programs
        there), and without the refresh no rescoring."""
        self.fused_rows, self.coupled = fused_rows, coupled
        self.step_graphs, self.pieces = step_graphs, step_graphs.pieces
        self.model = self.pieces.model
        self.selector, self.refresh_layer = selector, refresh_layer
        self.scoring = scores is not None  # verify rows rescore their pages at l_r
        self.refresh = self.scoring and refresh  # ... and draft rows too, over every page
        # a step of draft rows only needs no wide query tile, and without the refresh it
        # rescores nothing: its lean graph leaves both out (the same tokens and scores, fewer
        # launches)
        self.lean = lean
        self.skips_rescoring = self.scoring and not self.refresh  # ... in a lean step
        self.page_table, self.scores = page_table, scores
        self.max_drafts, self.max_q = max_drafts, max_drafts + 1
        self.row_buckets = row_buckets(self.pieces.buckets, max_rows)
        # n -> int64 [6, n]: slot, flags, draft length, drafts held, x_n, its position
        self.state: dict[int, torch.Tensor] = {}
        self.chain: dict[int, torch.Tensor] = {}  # n -> int64 [max_drafts, n]: pending drafts
        # sampled rows (``sampled_rows``): n -> int64 [2, n] seed, top_k; float32 [2, n]
        # temperature, top_p; float32 [max_drafts, n, V] the q of each pending draft, and the
        # store as a run left it (``snapshot_q``: the next run's first steps may rewrite it
        # before the host knows which drafts the rows hold). Every bucket's store and snapshot
        # view one pair (``rows_q``), made at the first sampled capture: 1.2 GB for 64 rows of
        # Qwen2.5's vocabulary; coupled sampling keeps no q (a placeholder of one value a row)
        self.sstate: dict[int, torch.Tensor] = {}
        self.fstate: dict[int, torch.Tensor] = {}
        planes, vocab = (1, 1) if coupled else (max_drafts, self.model.arch.vocab_size)
        self.rows_q = RowStore(planes, self.row_buckets[-1] if self.row_buckets else 1, vocab,
                               self.pieces.device, self.model.tp, copies=2,
                               spare=spare)  # fmt: skip
        self.q_store: dict[int, torch.Tensor] = {}  # n -> rows_q's store, [:, :n]
        self.q_snap: dict[int, torch.Tensor] = {}  # n -> its snapshot, [:, :n]
        # the rows on the device: their sampling variant (None: greedy) and row bucket
        self.variant, self.loaded = None, 0
        self.graphs: dict[tuple, object] = {}  # (n, t, variant, lean) -> graph
        self.argmax: dict[tuple, torch.Tensor] = {}  # (n, t, variant, lean) -> int64 [t]
        # the device rows' draft lengths and whether they are live, as the host set them, and
        # whether a live row has draft length 0 (it verifies with one query, which the layout
        # does not tell from a draft row's: ``lean_step``), kept as they change, not per step
        self.gammas: list[int] = []
        self.live: list[bool] = []
        self.plain_rows = False
        self.plans: dict[tuple[int, int, bool, bool], FixedPlan] = {}  # (n, t, full, lean)
        self._key = None
        self._pool_pages = 0
        self._layouts: torch.Tensor | None = None  # int32 [3, W + 1]: policy_layout
        self.steps = 0  # steps replayed
        self.lean_steps = 0  # of them, lean ones (no verify row: one query tile)
        # the request of each row of the state on the device (None: padding, or a row that
        # stopped): rows of a run continued on the device keep their places
        self.row_ids: list[str | None] = []
        self.started = None  # the next run's first steps, if started (async_runs.Started)
        self.runs_started = self.runs_continued = 0  # runs begun early; of them, continued
        # the others, by why they were dropped (async_runs.Started.mismatch; "graphs": a table
        # moved or a step's graph is missing; "host": the plan's run is planned on the host;
        # "plan": the next plan is no asynchronous run)
        self.runs_dropped: collections.Counter[str] = collections.Counter()

    def drop_started(self, why: str) -> None:
        """Forget the run started early (if any), counted in ``runs_dropped`` under ``why``."""
        if self.started is not None:
            self.runs_dropped[why] += 1
            self.started = None

    def fits(self, rows: int, layout: list[list[int]], sampled: bool = False) -> bool:
        """Whether a run of ``rows`` rows with these queries per step (``layout[s][r]``) has
        graphs: a row bucket, and a token bucket for every step; with sampled rows, room for
        the bucket's q store (``q_store_fits``)."""
        n = next((b for b in self.row_buckets if b >= rows), None)
        return n is not None and all(self.pieces.bucket(sum(q)) is not None for q in layout) \
            and max(max(q) for q in layout) <= self.max_q \
            and (not sampled or self.q_store_fits())  # fmt: skip

    def q_store_fits(self) -> bool:
        """Whether the q store exists or fits in the device's free memory on every shard
        (``device_memory.room_for``). It is made at the first sampled capture (at start-up,
        or a run's), after the KV pool took its share: 1.2 GB at 64 rows of Qwen2.5's
        vocabulary, 10 GB at 512. A run it does not fit is planned on the host (slower; a
        step's q then live for that step only), never an out-of-memory error."""
        return self.rows_q.fits()

    # ---- capture -------------------------------------------------------------------------------
    def _tables_key(self, kv_caches: list[torch.Tensor]) -> tuple:
        scores = self.scores.scores if self.scores is not None else None
        return (kv_caches[0].data_ptr(), self.page_table.table.data_ptr(),
                tuple(self.page_table.table.shape),
                None if scores is None else (scores.data_ptr(), tuple(scores.shape)))

    def ensure(self, n: int, t: int, kv_caches: list[torch.Tensor], variant=None,
               lean: bool = False) -> None:  # fmt: skip
        """Graph (n, t) of this sampling variant (lean: its steps of draft rows only,
        ``lean_step``), captured against the current tables (recaptured if they moved)."""
        key = self._tables_key(kv_caches)
        if key != self._key:
            self.graphs.clear()
            self.argmax.clear()
            self.plans.clear()  # capacities follow the pool
            self._key, self._pool_pages = key, kv_caches[0].shape[0]
        if (n, t, variant, lean) in self.graphs:
            return
        p = self.pieces
        with torch.inference_mode():
            p.inputs_for(t, kv_caches)
            depth = max(self.max_drafts, 1)
            if n not in self.state:
                self.state[n] = torch.zeros(6, n, dtype=torch.int64, device=p.device)
                self.chain[n] = torch.zeros(depth, n, dtype=torch.int64, device=p.device)
            if variant is not None and n not in self.q_store:
                self.sstate[n] = torch.zeros(2, n, dtype=torch.int64, device=p.device)
                self.fstate[n] = torch.ones(2, n, dtype=torch.float32, device=p.device)
                self.q_store[n], self.q_snap[n] = self.rows_q.view(n, 0), self.rows_q.view(n, 1)
            self._layout(self.page_table.table.shape[1])
            fn = lambda: self._step(n, t, kv_caches, variant, lean)  # noqa: E731
            graph, out = p.capture_idle(fn, [self.state[n]], "async")
        self.graphs[n, t, variant, lean], self.argmax[n, t, variant, lean] = graph, out

    def capture_all(self, rows: int, kv_caches: list[torch.Tensor],
                    sampled: bool = False) -> None:  # fmt: skip
        """The graphs of every row bucket up to ``rows`` rows at every token bucket its runs
        may fill, largest first; with ``sampled``, every sampling variant's too where the q
        store fits. A batch shrinks as its requests finish, and a graph captured on first use
        costs its capture (~70 ms on an H100 at Qwen's shapes: docs/benchmarks.md §8.47), and
        on a process's first use of a row bucket the compiles of its kernel variants (~1 s
        each), inside a running batch's steps (§8.23: the first ``aspire`` mode of a benchmark
        run)."""
        # more rows than the largest bucket: its graphs (the steps past it run on the host)
        top = next((b for b in self.row_buckets if b >= rows), max(self.row_buckets, default=None))
        if top is None:
            return
        variants = [None] + (SAMPLED_VARIANTS if sampled else [])
        for n in reversed([b for b in self.row_buckets if b <= top]):
            # up to the token bucket of n rows of max_q queries each (64 x 9 tokens: 1,024)
            most = self.pieces.bucket(n * self.max_q) or self.pieces.buckets[-1]
            for t in reversed(self.pieces.buckets):
                # lean graphs (draft rows only): a query a row of a full bucket, n tokens in
                # the smallest token bucket holding them (n itself where n is a power of two);
                # a step with fewer live rows (some stopped) captures its own at first use
                for lean in (False, True) if self.lean else (False,):
                    if n <= t <= most and (not lean or t == self.pieces.bucket(n)):
                        for variant in variants:
                            if variant is None or self.q_store_fits():
                                self.ensure(n, t, kv_caches, variant, lean)

    def _plan(self, n: int, t: int, full: bool, lean: bool = False) -> FixedPlan:
        """The attention plan of (n, t)'s sparse or full lists: rows of 1..max_q queries in two
        launches (draft rows' tile, verify rows' widest), or in one: a lean step's rows of one
        query at most (draft rows only: ``lean_step``) in theirs, and with
        ``mixed_one_launch`` a step of more queries than rows (t > n: a row verifies drafts)
        in the widest, where every row goes. A launch a step leaves empty still runs its
        ~1,000 programs a layer (docs/benchmarks.md §8.56)."""
        if (n, t, full, lean) not in self.plans:
            from aspire_ray.kernels.paged_attention import FixedPlan  # imports triton

            attn = self.model.layers[0].self_attn
            largest = max(self.plans.values(), key=lambda p: p.plan.part_rows, default=None)
            self.plans[n, t, full, lean] = FixedPlan.for_rows(
                n, t, 1 if lean else self.max_q, self._pool_pages, attn.q_heads,
                attn.kv_heads, attn.head_dim, self.pieces.device, self.step_graphs.config,
                share=largest, wide_tiles=not lean,
                wide_only=t > n and self.step_graphs.config.mixed_one_launch)  # fmt: skip
        return self.plans[n, t, full, lean]

    # ---- the captured step ---------------------------------------------------------------------
    def _step(self, n: int, t: int, kv_caches: list[torch.Tensor], variant,
              lean: bool = False) -> torch.Tensor:  # fmt: skip
        state, chain = self.state[n], self.chain[n]
        slot, flags, gamma, held, x_id, x_pos = state
        table = self.page_table.table  # int32 [slots, W]
        ps, width = kv_caches[0].shape[2], table.shape[1]
        inputs = self.pieces.inputs[t]
        # tokens, positions and KV slots of every row's queries (a row verifies when it holds
        # its draft length of drafts), and its page lists: all in one launch on a GPU
        capacity = list_capacity(n, table, self._pool_pages)
        rp = plan_rows(dict(slot=slot, flags=flags, gamma=gamma, held=held, x_id=x_id,
                            x_pos=x_pos), chain, table, self._layout(width), ps, t, inputs,
                       capacity, capacity if self.refresh else 0,
                       fused=self.fused_rows)  # fmt: skip
        qo, last, indptr = rp["qo"], rp["last"], rp["indptr"]
        n_q, pages, end, verify, row_slot, live = rp["rows"]
        plan = self._plan(n, t, full=False, lean=lean)
        plan.load_rows(indptr, last, n_q, ps)
        meta = PagedKVMeta(qo, indptr, rp["indices"], last, ps, fixed_plan=plan)
        choice = None
        if self.selector.uses_scores:
            first = int(self.selector.cfg.keep_sink_page)
            choice = (rp["indices"], rp["choose"], first, width - first)
            meta.kv_indices = self._choose(choice, (flags & _SCORED) > 0)

        layers, lr, sg = self.model.layers, self.refresh_layer, self.step_graphs
        # without the refresh, a lean step's draft rows rescore no page
        if not self.scoring or (lean and self.skips_rescoring):
            hidden = sg.layers(t, 0, len(layers), meta, kv_caches)
        else:
            sg.layers(t, 0, lr, meta, kv_caches)
            live_rows, verify_rows = live > 0, verify > 0
            # the refresh layer: every row over all its pages, or (no refresh while drafting)
            # the step's own lists, a verify row's being all its pages already
            lists, scored = meta, live_rows & verify_rows
            if self.refresh:
                full_plan = self._plan(n, t, full=True, lean=lean)
                full_plan.load_rows(rp["full_indptr"], last, n_q, ps)
                lists = PagedKVMeta(qo, rp["full_indptr"], rp["full_indices"], last, ps,
                                    fixed_plan=full_plan)  # fmt: skip
                scored = live_rows
            scale = layers[lr].self_attn.scale
            p = self.pieces
            out, lse = p.backend.attention(p.q[:t], kv_caches[lr], lists, scale, return_lse=True)
            p.attn_out[:t].copy_(out)
            bounds = qo.long()
            first_q, last_q = bounds[:-1].clamp(max=t - 1), (bounds[1:] - 1).clamp(0, t - 1)
            rescore_first_last(p.backend, p.q[:t], lse, kv_caches[lr], scale, table,
                               self.scores, first_q, last_q, inputs[1][first_q] + 1, end,
                               scored, slot, row_slot, self._pool_pages,
                               single=~verify_rows, fused=self.fused_rows,
                               tp=p.model.tp)  # fmt: skip
            post = meta  # without the refresh no draft row's scores changed
            if self.refresh:
                post = PagedKVMeta(meta.qo_indptr, indptr, self._choose(choice, live_rows),
                                   last, ps, fixed_plan=plan)  # fmt: skip
            flags.bitwise_or_(scored.to(flags.dtype) * _SCORED)
            hidden = sg.layers(t, lr + 1, len(layers), post, kv_caches)
        if variant is None:
            argmax = self.model.greedy_tokens(hidden)  # [t]
        else:  # sampled rows' choices (the module docstring)
            logits, argmax = self.model.sampling_logits(hidden)  # [t, V], [t]
            (seed, top_k), (temperature, top_p) = self.sstate[n], self.fstate[n]
            argmax = sampled_choices(logits, argmax, qo, verify, held, x_pos,
                                     chain, (flags & _SAMPLED) > 0, seed, top_k, temperature,
                                     top_p, variant, self.q_store[n],
                                     coupled=self.coupled)  # fmt: skip
        # draft rows: the argmax joins their drafts; verify rows: the accepted prefix
        accept_rows(argmax, inputs[0, :t], qo, rp["rows"], x_id, x_pos, x_pos, chain, held,
                    fused=self.fused_rows)  # fmt: skip
        return argmax

    def _layout(self, width: int) -> torch.Tensor:
        """The policy's list layout by page count (``step_rows.policy_layout``), made before
        the first capture at this width."""
        if self._layouts is None or self._layouts.shape[1] != width + 1:
            self._layouts = policy_layout(self.selector, width, self.pieces.device)
        return self._layouts

    def _choose(self, choice, has_scores: torch.Tensor) -> torch.Tensor:
        template, rows, first, max_candidates = choice
        return choose_top_pages(template, self.page_table.table, self.scores, rows, has_scores,
                                first, max_candidates)  # fmt: skip

    # ---- one run -------------------------------------------------------------------------------
    def run(self, rows: list[RowPlan], slots: list[int], scored: list[bool],
            layout: list[list[int]], kv_caches: list[torch.Tensor],
            specs: list[SamplingSpec] | None = None,
            held_q: list[list[torch.Tensor]] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Replay a run of ``rows`` (``fits``; their pages in the page table; scored: whether
        their requests have page scores; layout[s][r]: row r's queries at step s; specs:
        their sampling (None: all greedy); held_q[r]: the q of each draft a sampled row holds,
        float32 [V]) -> each step's choices over its queries (the argmax of greedy rows),
        int64 [sum(layout[s])], on the device, no sync (``pending_q`` then reads the q of the
        sampled rows' drafts held at the end)."""
        n = next(b for b in self.row_buckets if b >= len(rows))
        variant = sampling_variant(specs) if specs is not None else None
        self._set_gammas([row.async_gamma for row in rows] + [0] * (n - len(rows)),
                         [True] * len(rows) + [False] * (n - len(rows)))  # fmt: skip
        keys = {(self.pieces.bucket(sum(q)), self.lean_step(q)) for q in layout}
        sync_tables(self.page_table, self.scores)
        for t, lean in sorted(keys, reverse=True):
            self.ensure(n, t, kv_caches, variant, lean)
        state = np.zeros((6, n), dtype=np.int64)
        chain = np.zeros((self.chain[n].shape[0], n), dtype=np.int64)
        for i, row in enumerate(rows):
            known = row.verify_after
            state[:, i] = [slots[i], _LIVE | (_SCORED if scored[i] else 0), row.async_gamma,
                           len(known) - 1, known[0], row.start_pos - (len(known) - 1)]
            chain[: len(known) - 1, i] = known[1:]
        if variant is not None:
            self._load_sampling(n, state, specs, held_q)
        upload(state, self.pieces.device, self.state[n])
        upload(chain, self.pieces.device, self.chain[n])
        self.row_ids = [row.req_id for row in rows] + [None] * (n - len(rows))
        self.variant, self.loaded = variant, n
        return self.replay(n, layout)

    def _load_sampling(self, n: int, state: np.ndarray, specs: list[SamplingSpec],
                       held_q: list[list[torch.Tensor]]) -> None:  # fmt: skip
        """The sampled rows' flags, settings and held drafts' q, for a run of a sampled
        variant (state: the run's int64 [6, n] before its upload)."""
        r = len(specs)
        sampled = np.array([not spec.greedy for spec in specs])
        state[1, :r] |= np.where(sampled, _SAMPLED, 0)
        sstate = np.zeros((2, n), dtype=np.int64)
        sstate[:, :r] = [[spec.seed for spec in specs], [spec.top_k for spec in specs]]
        fstate = np.ones((2, n), dtype=np.float32)
        fstate[:, :r] = [[1.0 if spec.greedy else spec.temperature for spec in specs],
                         [spec.top_p for spec in specs]]  # fmt: skip
        upload(sstate, self.pieces.device, self.sstate[n])
        upload(fstate, self.pieces.device, self.fstate[n])
        for i, qs in enumerate(held_q):
            if qs and sampled[i]:
                self.q_store[n][: len(qs), i].copy_(torch.stack(qs))

    def snapshot_q(self, depth: int) -> None:
        """Keep the sampled rows' q of their first ``depth`` held drafts as the steps replayed
        so far leave them (``pending_q`` reads them), before any later step is replayed."""
        n = self.loaded
        self.q_snap[n][:depth].copy_(self.q_store[n][:depth])

    def pending_q(self, row: int, held: int) -> list[torch.Tensor]:
        """The q of the drafts device row ``row`` held at the last ``snapshot_q`` (``held`` of
        them, at most its depth), float32 [V] each: views of one copy of the row's (one
        launch a row, not a draft; the row's drafts wait together for its verification)."""
        snap = self.q_snap[self.loaded]
        return list(snap[:held, row].clone().unbind(0)) if held > 0 else []

    # ---- a run continued on the device ---------------------------------------------------------
    def ready(self, n: int, layout: list[list[int]], kv_caches: list[torch.Tensor],
              gammas: list[int], keep: list[bool] | None = None) -> bool:  # fmt: skip
        """Whether the state on the device (``n`` rows) can run steps of this layout, with
        the rows set so (``set_rows``' arguments), without a capture (a capture zeroes the
        state): the tables did not move, every step's graph exists (a lean one for a step of
        draft rows only: ``lean_step``)."""
        sync_tables(self.page_table, self.scores)
        if self._tables_key(kv_caches) != self._key or n not in self.state:
            return False
        plain = _plain_rows(gammas, self._live_after(keep))
        for q in layout:
            t = self.pieces.bucket(sum(q))
            if t is None or max(q) > self.max_q \
                    or (n, t, self.variant, self.lean_step(q, plain)) not in self.graphs:
                return False
        return True

    def set_rows(self, n: int, gammas: list[int], keep: list[bool] | None = None) -> None:
        """The device rows' draft lengths from now on; rows not in ``keep`` stop (no query,
        no page, no KV written). Stream-ordered: steps replayed before are unaffected."""
        dev = self.pieces.device
        upload(np.asarray(gammas, dtype=np.int64), dev, self.state[n][2])
        if keep is not None:
            self.state[n][1].mul_(upload(np.asarray(keep, dtype=np.int64), dev))
            self.row_ids = [rid if k else None for rid, k in zip(self.row_ids, keep, strict=True)]
        self._set_gammas(list(gammas), self._live_after(keep))

    def _live_after(self, keep: list[bool] | None) -> list[bool]:
        if keep is None:
            return self.live
        return [x and k for x, k in zip(self.live, keep, strict=True)]

    def _set_gammas(self, gammas: list[int], live: list[bool]) -> None:
        self.gammas, self.live = gammas, live
        self.plain_rows = _plain_rows(gammas, live)

    def replay(self, n: int, layout: list[list[int]]) -> list[torch.Tensor]:
        """Steps from the state on the device (``ready``; layout[s][r]: device row r's queries
        at step s, 0 for a stopped row) -> each step's argmax over its queries, int64
        [sum(layout[s])], on the device, no sync."""
        outs = []
        for q in layout:
            key = (n, self.pieces.bucket(sum(q)), self.variant, self.lean_step(q))
            graph = self.graphs[key]
            if CLOCK.enabled:  # its step kind for the clock: draft rows only, or verify rows
                # in it (they read their whole KV: the two costs differ ~2.5x at 32k), and how
                # many of the live rows verify (a step of a few costs less than a full one)
                graph.kind = "async_verify" if max(q, default=0) > 1 else "async"
                graph.shape = (sum(k > 1 for k in q), sum(k > 0 for k in q), sum(q))
            graph.replay()
            outs.append(self.argmax[key][: sum(q)].clone())
            self.lean_steps += key[3]
        self.steps += len(layout)
        return outs

    def lean_step(self, queries: list[int], plain: bool | None = None) -> bool:
        """Whether a step of these queries per device row holds no verify row, so that its
        lean graph runs it: every row one query at most, and no live row of draft length 0
        (whose every step is a verification of one query) where the lean graph rescores no
        row; plain: whether one is live, the rows' as set if None)."""
        plain = self.plain_rows if plain is None else plain
        # a lean step with the refresh rescores every row as a full one does: a verification
        # of one query is a row like any other there
        return self.lean and max(queries, default=0) <= 1 and not (plain and self.skips_rescoring)


def _plain_rows(gammas: list[int], live: list[bool]) -> bool:
    """Whether a live row has draft length 0."""
    return any(g == 0 and x for g, x in zip(gammas, live, strict=True))
