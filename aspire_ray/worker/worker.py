"""The shard worker: owns a model shard and its paged KV shard, runs one StepPlan per step.

One forward holds every row of the step (DESIGN.md §1.4): prefill chunks and verify rows over
all their pages, draft rows over their sparse pages; the linear layers run once over all
tokens. Per-request state kept here: block table, refresh-layer page scores, and the draft
distributions q of pending drafts (sampling only).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from aspire_ray.attention import get_backend
from aspire_ray.config import EngineConfig
from aspire_ray.kernels import PagedKVMeta
from aspire_ray.plan import RowKind, RowPlan, RowResult, SamplingSpec, StepOutput, StepPlan, Stream
from aspire_ray.tp import TPGroup, single_rank

from . import rejection_sampler, sampler
from .model_loading import DTYPES, build_model
from .page_selector import make_selector
from .step_attention import ScoringQueries, StepAttention


@dataclass
class WorkerRequest:
    sampling: SamplingSpec
    block_table: list[int] = field(default_factory=list)
    scores: torch.Tensor | None = None  # float32 [P_scored] refresh-layer page scores
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q of pending drafts, [V]


class Worker:
    def __init__(self, cfg: EngineConfig, tp: TPGroup | None = None,
                 device: str | None = None) -> None:
        self.cfg = cfg
        self.tp = tp or single_rank()
        self.device = torch.device(device or cfg.device)
        self.model = build_model(cfg, self.tp, self.device)
        self.arch = self.model.arch
        self.page_size = cfg.cache.page_size
        self.backend = get_backend(cfg.attention_backend, self.device)
        self.selector = make_selector(cfg.spec)
        self.refresh_layer = self._refresh_layer()
        self.kv_caches = self._allocate_kv()
        self.requests: dict[str, WorkerRequest] = {}

    # ---- setup -------------------------------------------------------------------------------
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

    def _allocate_kv(self) -> list[torch.Tensor]:
        c = self.cfg.cache
        if c.num_pages is not None:
            num_pages = c.num_pages
        elif c.kv_cache_memory_bytes is not None:
            num_pages = c.kv_cache_memory_bytes // self.page_bytes()
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            num_pages = int(free * c.gpu_memory_utilization) // self.page_bytes()
        else:
            num_pages = (1 << 30) // self.page_bytes()
        if num_pages < 2:
            raise ValueError(f"KV cache budget holds only {num_pages} pages; raise it")
        attn = self.model.layers[0].self_attn
        shape = (num_pages, 2, self.page_size, attn.kv_heads, attn.head_dim)
        dtype = DTYPES[self.cfg.dtype]
        return [torch.zeros(shape, dtype=dtype, device=self.device)
                for _ in range(self.arch.num_layers)]

    @property
    def num_pages(self) -> int:
        return self.kv_caches[0].shape[0]

    def describe(self) -> dict:
        """What the driver needs to know about this shard."""
        return {
            "num_pages": self.num_pages,
            "num_layers": self.arch.num_layers,
            "vocab_size": self.arch.vocab_size,
            "max_position_embeddings": self.arch.max_position_embeddings,
            "eos_token_ids": list(self.arch.eos_token_ids),
            "refresh_layer": self.refresh_layer,
            "device_name": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda" else "cpu",
        }

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        for rid in plan.dropped_req_ids:
            self.requests.pop(rid, None)
        for rid, spec in plan.new_requests.items():
            self.requests[rid] = WorkerRequest(spec)
        for row in plan.rows:
            bt = self.requests[row.req_id].block_table
            del bt[row.pages_keep :]
            bt.extend(row.pages_new)
        batch = _Batch(self, plan.rows)
        t1 = time.perf_counter()
        hidden = self.model(batch.input_ids, batch.positions, batch.attention, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logit_index])
        self._sync()
        t2 = time.perf_counter()
        results = self._sample(plan.rows, logits, batch.logit_offsets)
        self._sync()
        t3 = time.perf_counter()
        timings = {"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2, "total": t3 - t0,
                   "refresh": batch.attention.refresh_seconds}
        return StepOutput(plan.step_id, results, timings)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- sampling and verification -----------------------------------------------------------
    def _sample(self, rows: list[RowPlan], logits: torch.Tensor,
                offsets: list[int]) -> list[RowResult]:
        probs = self._probs(rows, logits, offsets)
        argmax = logits.argmax(dim=-1).tolist()  # one device sync for every greedy choice
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
                    q = torch.stack(req.draft_probs[: len(drafts)]) if drafts else probs[lo:lo]
                    n_acc, tokens = rejection_sampler.verify_sampled(
                        probs[lo:hi], q, drafts, spec.seed, row.start_pos + 1)
                req.draft_probs.clear()
                results.append(RowResult(row.req_id, row.kind, tokens, n_acc))
                continue
            # PREFILL (sample) and DRAFT: one token at position context_len
            if spec.greedy:
                token = argmax[lo]
            else:
                stream = Stream.DRAFT if row.kind == RowKind.DRAFT else Stream.TARGET
                token = int(sampler.sample_from_probs(
                    probs[lo : lo + 1], _i64([spec.seed], logits.device),
                    _i64([row.context_len], logits.device), stream)[0])
                if row.kind == RowKind.DRAFT:
                    req.draft_probs.append(probs[lo])
            results.append(RowResult(row.req_id, row.kind, [token]))
        return results

    def _probs(self, rows: list[RowPlan], logits: torch.Tensor,
               offsets: list[int]) -> torch.Tensor | None:
        """Sampling distributions for every logit row of non-greedy requests (others: unused)."""
        specs = []
        for r, row in enumerate(rows):
            specs += [self.requests[row.req_id].sampling] * (offsets[r + 1] - offsets[r])
        if all(s.greedy for s in specs):
            return None
        dev = logits.device
        temp = torch.tensor([s.temperature if not s.greedy else 1.0 for s in specs],
                            dtype=torch.float32, device=dev)
        top_k = _i64([s.top_k for s in specs], dev)
        top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=dev)
        return sampler.probs_from_logits(logits, temp, top_k, top_p)


def _i64(xs: list[int], device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=device)


class _Batch:
    """Flattened inputs and the attention plan of one step (built once, used by every layer)."""

    def __init__(self, worker: Worker, rows: list[RowPlan]) -> None:
        self.worker = worker
        self.rows = rows
        ps = worker.page_size
        dev = worker.device
        ids, pos, slots, logit_index, offsets = [], [], [], [], [0]
        q_lens, full_pages, kv_lens = [], [], []
        token_start = 0
        for row in rows:
            bt = worker.requests[row.req_id].block_table
            n, ctx = row.num_tokens, row.context_len
            if math.ceil(ctx / ps) > len(bt):
                raise RuntimeError(f"request {row.req_id}: {len(bt)} pages cannot hold {ctx} tokens")
            ids += row.token_ids
            for p in range(row.start_pos, ctx):
                pos.append(p)
                slots.append(bt[p // ps] * ps + p % ps)
            if row.kind == RowKind.VERIFY:
                logit_index += range(token_start, token_start + n)
            elif row.kind == RowKind.DRAFT or row.sample:
                logit_index.append(token_start + n - 1)
            offsets.append(len(logit_index))
            q_lens.append(n)
            full_pages.append(bt[: math.ceil(ctx / ps)])
            kv_lens.append(ctx)
            token_start += n
        self.input_ids = _i64(ids, dev)
        self.positions = _i64(pos, dev)
        self.logit_index = _i64(logit_index, dev)
        self.logit_offsets = offsets
        self.q_lens, self.full_pages, self.kv_lens = q_lens, full_pages, kv_lens
        slot_mapping = _i64(slots, dev)

        spec = worker.cfg.spec
        selector = worker.selector
        self.draft_rows = [r for r, row in enumerate(rows) if row.kind == RowKind.DRAFT]
        meta_full = PagedKVMeta.build(q_lens, full_pages, kv_lens, ps, dev)
        if not self.draft_rows and (selector is None or not selector.uses_scores):
            self.attention = StepAttention(worker.backend, worker.tp, slot_mapping, meta_full,
                                           worker.refresh_layer)
            return
        meta_pre = self._meta_with_sparse_drafts() if self.draft_rows else meta_full
        scoring = self._scoring_queries(spec.refresh_while_drafting) if selector.uses_scores \
            else None
        refresh_full = spec.refresh_while_drafting or not self.draft_rows
        self.attention = StepAttention(
            worker.backend, worker.tp, slot_mapping, meta_pre, worker.refresh_layer,
            meta_refresh=meta_full if refresh_full else meta_pre,
            scoring=scoring, on_scores=self._apply_scores,
        )

    def _sparse_pages(self, r: int) -> tuple[list[int], int]:
        """Row r's sparse page ids (recent last) and their visible token count."""
        row = self.rows[r]
        req = self.worker.requests[row.req_id]
        ps = self.worker.page_size
        n_pages = len(self.full_pages[r])
        chosen = self.worker.selector.select(req.scores, n_pages)
        last_len = row.context_len - (n_pages - 1) * ps
        return [req.block_table[j] for j in chosen], (len(chosen) - 1) * ps + last_len

    def _meta_with_sparse_drafts(self) -> PagedKVMeta:
        pages, kv_lens = list(self.full_pages), list(self.kv_lens)
        for r in self.draft_rows:
            pages[r], kv_lens[r] = self._sparse_pages(r)
        return PagedKVMeta.build(self.q_lens, pages, kv_lens, self.worker.page_size,
                                 self.worker.device)

    def _scoring_queries(self, score_drafts: bool) -> ScoringQueries | None:
        """Which queries score pages at the refresh layer (DESIGN.md §1.2).

        Draft rows (when refreshing while drafting): their one query. Verify rows: first and
        last query (averaged later). Prefill rows that sample: the last prompt token.
        """
        ps = self.worker.page_size
        idx, pages, kv_lens, owners = [], [], [], []
        start = 0
        for r, row in enumerate(self.rows):
            n, ctx = row.num_tokens, row.context_len
            queries: list[int] = []
            if row.kind == RowKind.DRAFT and score_drafts:
                queries = [n - 1]
            elif row.kind == RowKind.VERIFY:
                queries = [0, n - 1] if n > 1 else [0]
            elif row.kind == RowKind.PREFILL and row.sample:
                queries = [n - 1]
            for i in queries:
                visible = ctx - n + 1 + i
                idx.append(start + i)
                pages.append(self.full_pages[r][: math.ceil(visible / ps)])
                kv_lens.append(visible)
                owners.append(r)
            start += n
        if not idx:
            return None
        self.score_owners = owners
        meta = PagedKVMeta.build([1] * len(idx), pages, kv_lens, ps, self.worker.device)
        return ScoringQueries(_i64(idx, self.worker.device), meta)

    def _apply_scores(self, page_scores: torch.Tensor) -> PagedKVMeta:
        """Store each scored request's page scores; re-select draft rows' pages for later layers."""
        t0 = time.perf_counter()
        kvp = self.attention.scoring.meta.kv_indptr_host
        per_row: dict[int, list[torch.Tensor]] = {}
        for s, r in enumerate(self.score_owners):
            per_row.setdefault(r, []).append(page_scores[kvp[s] : kvp[s + 1]].float().cpu())
        for r, parts in per_row.items():
            n = max(p.shape[0] for p in parts)
            total = torch.zeros(n)
            for p in parts:
                total[: p.shape[0]] += p
            self.worker.requests[self.rows[r].req_id].scores = total / len(parts)
        meta = self._meta_with_sparse_drafts() if self.draft_rows else self.attention.meta_pre
        self.attention.refresh_seconds += time.perf_counter() - t0
        return meta
