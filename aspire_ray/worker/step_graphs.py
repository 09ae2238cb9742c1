"""Whole-step CUDA graphs of decode steps: attention captured with the dense layers.

The piecewise graphs (``cuda_graphs.py``) leave every layer's attention eager, because its page
lists and work split change every step; for a small model that host work (~0.1 ms per layer)
is most of a decode step, and all of a draft step. A decode step (draft and verify rows only,
at most ``max_q`` queries per row) is replayed here from one graph instead:

- the attention reads fixed metadata buffers (``qo_indptr``, ``kv_indptr``, ``kv_indices``,
  ``kv_last_page_len``) and a ``FixedPlan`` (fixed grids; work lists and item counts on the
  device), into which each step copies its own before the replay;
- with a page-scoring policy the refresh layer l_r stays eager between two graphs (its scoring
  and the re-chosen pages are planned on the host): graph A runs embed -> layers < l_r ->
  layer l_r's q/k/v; the eager layer l_r attends (scoring pages, re-choosing the draft rows'
  pages); its new kv_indices are copied into the buffer; graph B runs the rest.

Steps that do not fit (prefill rows, more work items than a plan holds) use the piecewise
graphs. Buffers shared with the piecewise graphs (inputs, residual, q, attention output) are
safe because replays run one after another on one stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aspire_ray.kernels.attention_config import AttentionConfig
from aspire_ray.kernels.metadata import PagedKVMeta

from .cuda_graphs import PiecewiseGraphs
from .step_attention import StepAttention

if TYPE_CHECKING:  # the Triton module is imported where a plan is built (CUDA only)
    from aspire_ray.kernels.paged_attention import FixedPlan


class StepGraphs:
    def __init__(self, pieces: PiecewiseGraphs, split_layer: int | None, max_q: int,
                 max_tokens: int, config: AttentionConfig) -> None:  # fmt: skip
        """split_layer: the eager refresh layer (None: one graph); max_q: most queries of a
        row; max_tokens: largest decode step to capture."""
        self.pieces = pieces
        self.model = pieces.model
        self.split = split_layer
        self.max_q = max_q
        self.config = config
        self.buckets = [n for n in pieces.buckets if n <= max(max_tokens, 1)]
        attn = self.model.layers[0].self_attn
        self.heads = (attn.q_heads, attn.kv_heads, attn.head_dim)
        self.plans: dict[int, FixedPlan] = {}
        self.metas: dict[int, PagedKVMeta] = {}
        self.graphs: dict[int, list] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self._kv_ptr: int | None = None
        self._indices: torch.Tensor | None = None
        self.steps = 0  # steps replayed whole

    # ---- capture -------------------------------------------------------------------------------
    def ensure(self, n: int, kv_caches: list[torch.Tensor]) -> bool:
        """Make bucket n's graphs ready (before the step writes its inputs: a capture clears
        them); False if n has none."""
        if n not in self.buckets:
            return False
        if self._kv_ptr != kv_caches[0].data_ptr():  # a new KV pool (resize): recapture
            self.graphs.clear()
            self.hidden.clear()
            self._kv_ptr = kv_caches[0].data_ptr()
            # rows never share pages: a step lists at most every page once
            self._indices = torch.zeros(kv_caches[0].shape[0], dtype=torch.int32,
                                        device=self.pieces.device)  # fmt: skip
        if n not in self.graphs:
            self._capture(n, kv_caches)
        return True

    def capture_all(self, kv_caches: list[torch.Tensor]) -> None:
        for n in reversed(self.buckets):
            self.ensure(n, kv_caches)

    def _fixed(self, n: int, page_size: int) -> tuple[FixedPlan, PagedKVMeta]:
        if n not in self.plans:
            from aspire_ray.kernels.paged_attention import FixedPlan  # imports triton

            hq, hkv, d = self.heads
            largest = self.plans.get(max(self.plans, default=0))
            self.plans[n] = FixedPlan.for_tokens(n, self.max_q, hq, hkv, d, self.pieces.device,
                                                 self.config, share=largest)  # fmt: skip
        z = lambda k: torch.zeros(k, dtype=torch.int32, device=self.pieces.device)  # noqa: E731
        meta = PagedKVMeta(z(n + 1), z(n + 1), self._indices, z(n), page_size,
                           fixed_plan=self.plans[n])  # fmt: skip
        return self.plans[n], meta

    def layers(self, n: int, lo: int, hi: int, meta: PagedKVMeta,
                kv_caches: list[torch.Tensor]) -> torch.Tensor | None:  # fmt: skip
        """Layers [lo, hi) with their attention over bucket n's buffers
        (``DecoderModel.span``); then the final norm (hi = L, returned) or layer hi's q (into
        the shared q buffer) and KV store."""
        p, layers, backend = self.pieces, self.model.layers, self.pieces.backend
        ids, positions, slots = p.inputs[n][:, :n]

        def attend(i, q, k, v):  # k, v: stored by RoPE's launch (kv_of)
            return backend.attention(q, kv_caches[i], meta, layers[i].self_attn.scale)

        return self.model.span(lo, hi, ids, positions, p.residual[:n], attend, p.attn_out[:n],
                               p.q[:n], lambda i: (kv_caches[i], slots))  # fmt: skip

    def _capture(self, n: int, kv_caches: list[torch.Tensor]) -> None:
        p = self.pieces
        plan, meta = self._fixed(n, page_size=kv_caches[0].shape[2])
        num_layers = len(self.model.layers)
        spans = [(0, num_layers)] if self.split is None else \
            [(0, self.split), (self.split + 1, num_layers)]  # fmt: skip
        fns = [lambda lo=lo, hi=hi: self.layers(n, lo, hi, meta, kv_caches) for lo, hi in spans]
        with torch.inference_mode():
            p.inputs_for(n, kv_caches)
            p.inputs[n][2].fill_(-1)  # the warm-up run and the capture write no KV
            plan.clear()  # no work items: the warm-up run only compiles
            p.run_captures(fns)  # eager once (compiles), then captured
            graphs, out = p.run_captures(fns, capture=True)
        for graph in graphs:
            graph.kind = "step"
        self.graphs[n], self.hidden[n], self.metas[n] = graphs, out, meta

    # ---- one step ------------------------------------------------------------------------------
    def load(self, n: int, attention: StepAttention) -> bool:
        """Copy the step's metadata into bucket n's buffers; False if the step does not fit."""
        src, meta = attention.meta_pre, self.metas.get(n)
        rows, nnz = src.num_rows, src.kv_indices.shape[0]
        if meta is None or rows > n or nnz > meta.kv_indices.shape[0]:
            return False
        if not meta.fixed_plan.load(src):
            return False
        meta.qo_indptr[: rows + 1].copy_(src.qo_indptr)
        meta.kv_indptr[: rows + 1].copy_(src.kv_indptr)
        meta.kv_last_page_len[:rows].copy_(src.kv_last_page_len)
        meta.kv_indices[:nnz].copy_(src.kv_indices)
        return True

    def run(self, n: int, num_tokens: int, attention: StepAttention,
            kv_caches: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """Replay bucket n (inputs and ``load`` done) -> hidden [num_tokens, H]."""
        graphs, t, p = self.graphs[n], num_tokens, self.pieces
        self.steps += 1
        graphs[0].replay()
        if self.split is not None:
            layer = self.model.layers[self.split].self_attn
            out = attention.attend_stored(self.split, p.q[:t], kv_caches[self.split], layer.scale)
            p.attn_out[:t].copy_(out)
            post = attention.meta_post.kv_indices
            if post is not attention.meta_pre.kv_indices:  # draft pages re-chosen after scoring
                self.metas[n].kv_indices[: post.shape[0]].copy_(post)
            graphs[1].replay()
        return self.hidden[n][:t]
