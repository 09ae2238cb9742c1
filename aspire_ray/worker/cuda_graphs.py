"""Piecewise CUDA graphs of the decoder's dense work (vLLM's "piecewise" graphs).

Between two attention calls the forward is dense and its shapes depend only on the token
count: o_proj, residual add + norm, MLP, the next layer's norm, qkv, q/k norm, RoPE and the KV
store. Per bucket n of padded token counts (powers of two up to ``max_tokens``) those L + 1
pieces are captured once:

    piece 0:      embed -> layer 0 pre-attention (q -> the static q buffer, k/v -> KV store)
    piece i:      layer i-1 post-attention (o_proj, MLP) -> layer i pre-attention
    piece L:      layer L-1 post-attention -> final norm -> hidden (static output)

A step of T <= n tokens writes its inputs into the bucket's static [3, n] buffer (ids,
positions, KV slots; padding has slot -1, which the KV store skips), replays piece 0, and for
each layer runs attention eagerly over the T real tokens (its page lists and work split change
every step) between replays. Padded rows compute garbage that no real row reads: every dense op
is row-wise. Steps larger than the biggest bucket run the eager forward.

Invariants: replays run in capture order on one stream, so the graphs share one memory pool;
state passed between pieces lives in buffers allocated outside the pool.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch

from aspire_ray.attention import AttentionBackend
from aspire_ray.model.decoder import DecoderModel

from .graph_clock import CLOCK
from .step_attention import StepAttention


class _CudaGraph:
    """One captured piece: capture(fn) records fn's kernels; replay() reruns them."""

    def __init__(self, pool, stream: torch.cuda.Stream, mode: str = "global") -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool, self.stream, self.mode = pool, stream, mode
        self.kind = "piece"  # the step kind the graph clock files its replays under
        self.shape = None  # what its next replay's step holds, for the clock (or None)

    def capture(self, fn: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        # capture_begin/end rather than torch.cuda.graph(): that one also runs gc.collect()
        # and empty_cache() for every capture, which dominates capturing hundreds of pieces.
        # The collector stays off while capturing: a graph it destroys meanwhile (an earlier
        # engine's, in the same process) resets a graph mid-capture and invalidates it.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(self.stream):
                self.graph.capture_begin(pool=self.pool, capture_error_mode=self.mode)
                try:
                    out = fn()
                finally:
                    self.graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        return out

    def replay(self) -> None:
        CLOCK.replay(self.graph, self.kind, self.shape)  # timed while the clock runs


class EagerGraph:
    """Stand-in for tests off the GPU: replay() reruns the function and copies its result into
    the tensor returned at capture, as a CUDA graph would rewrite that memory."""

    def __init__(self, pool=None, stream=None) -> None:
        self.fn, self.out = None, None
        self.kind, self.shape = "piece", None

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        out = self.fn()
        if self.out is not None:
            self.out.copy_(out)


FINE_BUCKETS_FROM = 128  # below, token buckets are powers of two at any granularity


def buckets(max_tokens: int, per_octave: int = 1) -> list[int]:
    """Padded token counts that get graphs, up to max_tokens: powers of two, and from
    ``FINE_BUCKETS_FROM`` on ``per_octave`` of them per doubling, evenly spaced (4: 128, 160,
    192, 224, 256, 320, ...; multiples of 32, so every bucket is even, as the graphs'
    inputs need). A step's dense layers compute over its bucket's tokens: a verification of
    64 rows x 9 queries pads 576 tokens to 1,024 in powers of two, to 640 at 4 a doubling."""
    out, n = [], 1
    while n <= max_tokens:
        step = n // per_octave if n >= FINE_BUCKETS_FROM else n
        out.extend(b for b in range(n, 2 * n, step) if b <= max_tokens)
        n *= 2
    return out


PREFILL_GRAPH_TOKENS = 1024  # graphs up to here at least; longer prefill chunks run eagerly


def graph_tokens(max_num_batched_tokens: int, max_num_seqs: int, row_queries: int) -> int:
    """The largest token bucket worth a graph: a decode step of max_num_seqs rows of
    ``row_queries`` queries each, rounded up to a power of two, within the step's token budget,
    and ``PREFILL_GRAPH_TOKENS`` at least. row_queries: what a verify row holds in practice
    (one query tile: the draft policy keeps lengths within the tile their target fits in,
    ``DraftPolicy.align``; a longer row's step may run on the host). An asynchronous run replays
    graphs only if each of its steps has a bucket (``AsyncStepGraphs.fits``): at 1,024 tokens,
    165 rows verifying 7 drafts on one slot (1,320 tokens) sent whole runs to the host, each
    step planned there and synced (79% of the GPU idle at 32k x 165 on an H100,
    docs/benchmarks.md §8.57)."""
    decode = 1 << max(max_num_seqs * row_queries - 1, 0).bit_length()
    return min(max_num_batched_tokens, max(PREFILL_GRAPH_TOKENS, decode))


def row_buckets(token_buckets: list[int], max_rows: int) -> list[int]:
    """The buckets a self-planning graph family captures for up to ``max_rows`` rows: the
    token buckets that are powers of two below max_rows (finer ones would multiply the graphs:
    a family captures every token bucket of each row bucket), then max_rows itself, as vLLM's
    capture sizes end at max_num_seqs: a full batch pads to no row it cannot hold (160 rows
    verifying 9 queries each fill 1,440 tokens, a 2,048-token bucket; as 256 rows, 2,304 had
    no bucket, and every verification of specattn/g8 at 32k x 160 on an H100 was planned on the
    host, docs/benchmarks.md §8.58); all of them where max_rows is more than the largest (such
    steps are planned on the host)."""
    rows = [b for b in token_buckets if b & (b - 1) == 0]
    if not rows or max_rows > rows[-1]:
        return rows
    return [n for n in rows if n < max_rows] + [max_rows]


class PiecewiseGraphs:
    def __init__(self, model: DecoderModel, backend: AttentionBackend, max_tokens: int,
                 device: torch.device, graph_factory=None,
                 per_octave: int = 1) -> None:  # fmt: skip
        """per_octave: token buckets a doubling (``buckets``)."""
        self.model, self.backend, self.device = model, backend, device
        self.buckets = buckets(max_tokens, per_octave)
        tmax = self.buckets[-1]
        attn = model.layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype
        hidden = model.arch.hidden_size
        with torch.inference_mode():
            self.residual = torch.zeros(tmax, hidden, dtype=dtype, device=device)
            self.q = torch.zeros(tmax, attn.q_heads, attn.head_dim, dtype=dtype, device=device)
            self.attn_out = torch.zeros_like(self.q)
        self.inputs: dict[int, torch.Tensor] = {}  # n -> int64 [3, n']: ids, positions, slots
        self.graphs: dict[int, list] = {}  # n -> L + 1 captured pieces
        self.hidden: dict[int, torch.Tensor] = {}  # n -> [n, hidden] output of the last piece
        self._kv_ptr: int | None = None
        self._stream = None  # captures (and their warm-up runs) go on this side stream
        if graph_factory is None:
            pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
            # tensor parallel: other threads of the shard's process (the process group's
            # watchdog) may call CUDA while a capture runs, and a global-mode capture fails on
            # their unsafe calls; thread-local capture confines the check to this thread
            mode = "thread_local" if model.tp.size > 1 else "global"
            graph_factory = lambda: _CudaGraph(pool, self._stream, mode)
        self._new_graph = graph_factory

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding num_tokens, or None (run eagerly)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def inputs_for(self, n: int, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The static int64 [3, n'] input buffer of bucket n (n' = n rounded up to even; the
        graphs read [:, :n]), capturing the bucket first if needed (a capture must come before
        the step's inputs are written: it stores no KV)."""
        if self._kv_ptr != kv_caches[0].data_ptr():  # a new KV pool (resize): recapture
            self.graphs.clear()
            self.hidden.clear()
            self._kv_ptr = kv_caches[0].data_ptr()
        if n not in self.graphs:
            self._capture(n, kv_caches)
        return self.inputs[n]

    def capture_all(self, kv_caches: list[torch.Tensor]) -> None:
        for n in reversed(self.buckets):  # largest first: smaller ones reuse its pool memory
            self.inputs_for(n, kv_caches)

    # ---- capture -------------------------------------------------------------------------------
    def _piece(self, i: int, n: int, kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
        """Piece i of bucket n: layer i - 1's post-attention (or the embedding) and layer i's
        q/k/v and KV store (or the final norm), no attention (``DecoderModel.span(i, i)``)."""
        ids, positions, slots = self.inputs[n][:, :n]
        return self.model.span(i, i, ids, positions, self.residual[:n], None, self.attn_out[:n],
                               self.q[:n], lambda layer: (kv_caches[layer], slots))

    def _capture(self, n: int, kv_caches: list[torch.Tensor]) -> None:
        with torch.inference_mode():
            if n not in self.inputs:  # even width: every row 16-byte aligned (Triton)
                self.inputs[n] = torch.zeros(3, n + n % 2, dtype=torch.int64, device=self.device)
            self.inputs[n][2].fill_(-1)  # the warm-up run and the capture write no KV
            pieces = [lambda i=i: self._piece(i, n, kv_caches)
                      for i in range(len(self.model.layers) + 1)]  # fmt: skip
            self.run_captures(pieces)  # eager once: JIT compiles, the stream's cuBLAS workspace
            self.graphs[n], self.hidden[n] = self.run_captures(pieces, capture=True)

    def capture_idle(self, fn, idle: list[torch.Tensor], kind: str):
        """fn (a self-planning step) run once eagerly, then captured into one graph, each time
        with the ``idle`` buffers zeroed (they say which rows are live: none, so neither run
        writes KV or scores) -> (the graph, its output). kind: the step kind of its replays
        (the graph clock's ``by_kind``: "draft", "decode", "verify", "async"; an asynchronous
        graph's replays set theirs, "async" or "async_verify": ``AsyncGraphs.replay``)."""
        for t in idle:
            t.zero_()
        self.run_captures([fn])
        for t in idle:
            t.zero_()
        (graph,), out = self.run_captures([fn], capture=True)
        graph.kind = kind
        return graph, out

    def run_captures(self, fns: list, capture: bool = False):
        """Run ``fns`` in order on the capture stream: eagerly (capture=False), or each captured
        into a new graph -> (graphs, the last one's output)."""
        self._sync()
        graphs, out = [], None
        if not capture:
            side = self._stream is not None
            with torch.cuda.stream(self._stream) if side else contextlib.nullcontext():
                for fn in fns:
                    fn()
        else:
            for fn in fns:
                g = self._new_graph()
                out = g.capture(fn)
                graphs.append(g)
        self._sync()
        return graphs, out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- one step ------------------------------------------------------------------------------
    def run(self, n: int, num_tokens: int, attention: StepAttention,
            kv_caches: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """Replay bucket n (inputs already in ``inputs_for(n)``) -> hidden [num_tokens, H]."""
        graphs, t = self.graphs[n], num_tokens
        q, attn_out = self.q[:t], self.attn_out[:t]
        graphs[0].replay()
        for i, layer in enumerate(self.model.layers):
            attn_out.copy_(attention.attend_stored(i, q, kv_caches[i], layer.self_attn.scale))
            graphs[i + 1].replay()
        return self.hidden[n][:t]
