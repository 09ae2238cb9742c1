"""The KV pool's size (``CacheConfig``), and the step workspace it leaves room for.

An explicit page count wins; else a byte budget; else, on a GPU, ``gpu_memory_utilization`` of
the memory free once the weights are loaded, *less the step workspace*: the transient memory of
the largest steps the engine may run, measured as vLLM's profile run measures it, by running
them once before the pool exists and reading the allocator's peak (``step_workspace``). Two
steps are measured, and their peaks added, because both stay on the device once the graphs are
captured:

    eager   the largest step the host plans (prefill chunks; decode steps that no graph
            holds): the forward over max_num_batched_tokens tokens, the final hidden states of
            its most logit rows, min(max_num_batched_tokens, max_num_seqs * max_q) (every
            query of a verify row has logits), and its choices from them, a run of at most
            ``sampler.HOST_SAMPLE_ROWS`` logit rows at a time (``Worker.logit_runs``): their
            float32 logits, the top-k / top-p probabilities (float32 [rows, V]) and
            speculative rejection sampling of rows of max_q queries, their drafts' q stacked
            (float32 [drafts, V]). What it frees the
            allocator keeps cached for the next eager step, and a graph's capture cannot take
            that cache (each capture's eager run leaves its own peak there too).
    graph   the largest captured step, sampled: ``graph_rows`` tokens, each with logits (an
            asynchronous run's mixed step, a verification): the forward, the logits in the
            model's dtype, the probabilities and a draw. A CUDA graph holds its peak in the
            graphs' memory pool for as long as it lives.

At Qwen2.5's vocabulary (151,936) a row of float32 logits or probabilities is 0.6 MB: with
max_num_seqs 1024 and max_num_batched_tokens 16384 the eager step of an ``aspire`` batch
(16,384 logit rows) takes ~4 GB by these buffers' sizes (2,048 rows' logits and probabilities
and 1,920 drafts' q at a time; ~31 GB when all of them were sampled at once, ~14 GB while the
step's 10 GB of logits were made whole; not yet measured on a GPU), the graph step (1,024
rows) ~0.9 GB. An asynchronous run's step planned
on the host (``async_runs``) samples in the same runs; its q store of a run's rows, [max_q,
rows, V], is about the stacked q counted here. The attention's scratch is not measured (its
output is; the fixed plans' split-KV partials are made with the graphs, out of the 1 -
gpu_memory_utilization left over). On the CPU the pool is 1 GiB; nothing is measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aspire_ray.config import CacheConfig, SchedulerConfig
from aspire_ray.plan import Stream

from . import rejection_sampler, sampler
from .cuda_graphs import row_buckets

CPU_POOL_BYTES = 1 << 30  # the pool on the CPU, where nothing is measured


@dataclass(frozen=True)
class StepShapes:
    """The largest steps the scheduler can hand a worker."""

    eager_tokens: int  # query tokens of a host-planned step (max_num_batched_tokens)
    eager_rows: int  # its logit rows: a decode row's every query, a prefill row's last
    max_q: int  # most queries of a verify row (max_drafts + 1; 1 without drafts)
    graph_rows: int  # tokens, each with logits, of the largest captured step; 0: no graphs


def step_shapes(scheduler: SchedulerConfig, max_q: int,
                buckets: list[int] | None) -> StepShapes:  # fmt: skip
    """The largest steps of this configuration. buckets: the graphs' token buckets (ascending;
    None: no graphs). A graph of n rows (the largest row bucket: max_num_seqs, or the largest
    power-of-two bucket where max_num_seqs is past it, ``cuda_graphs.row_buckets``) takes
    up to n * max_q tokens, padded to the smallest token bucket holding them: a rounds'
    verification of 64 rows x 9 queries runs in the 1,024 bucket, not 512 (the
    largest bucket where none holds them: fewer rows' steps fill it)."""
    eager_rows = min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * max_q)
    graph_rows = 0
    if buckets:
        rows = row_buckets(buckets, scheduler.max_num_seqs)[-1]
        graph_rows = next((b for b in buckets if b >= rows * max_q), buckets[-1])
    return StepShapes(scheduler.max_num_batched_tokens, eager_rows, max_q, graph_rows)


def run_step(model, tokens: int, logit_rows: int, max_q: int, graph: bool) -> None:
    """One step of the largest shapes, all rows sampled, for ``step_workspace`` to measure:
    the forward over ``tokens`` tokens (attention's output zeros: only its buffer is
    counted), then the choices of ``logit_rows`` rows of logits, as a graph makes them
    (graph=True: ``sampling_logits``, the probabilities, a draw each) or the host (float32
    logits, the probabilities, rejection sampling of rows of ``max_q`` queries with their
    drafts' q stacked, as ``Worker._verify_sampled`` stacks them)."""
    dev = model.embed_tokens.weight.device
    ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
    positions = torch.arange(tokens, device=dev) % model.arch.max_position_embeddings
    hidden = model.span(0, len(model.layers), ids, positions, None,
                        lambda i, q, k, v: torch.zeros_like(q))  # fmt: skip
    if graph:
        logits, _ = model.sampling_logits(hidden[:logit_rows])
        n = logit_rows
    else:  # the step's logit rows gathered (``StepBatch.logit_index``), then the host
        # samples a run of rows at a time (``Worker.logit_runs``): the float32 logits, the
        # probabilities and the verified drafts' q of at most HOST_SAMPLE_ROWS logit rows
        n = min(logit_rows, sampler.HOST_SAMPLE_ROWS)
        rows = hidden[torch.arange(logit_rows, device=dev)]  # [logit_rows, hidden]
        logits = model.compute_logits(rows[:n])
        logits.argmax(dim=-1)
    del hidden
    temperature = torch.ones(n, dtype=torch.float32, device=dev)
    top_k = torch.full((n,), 50, dtype=torch.int64, device=dev)
    top_p = torch.full((n,), 0.9, dtype=torch.float32, device=dev)
    # the logits stay alive beside what follows, as in ``Worker._execute``'s sampling
    probs = sampler.probs_from_logits(logits, temperature, top_k, top_p, True, True)
    rows = n // max_q if not graph else 0
    if rows == 0:
        seeds = torch.zeros(n, dtype=torch.int64, device=dev)
        sampler.sample_from_probs(probs, seeds, seeds, Stream.TARGET)
        return
    drafts = [0] * (max_q - 1)
    verify = [rejection_sampler.SampledVerify(r * max_q, drafts, 0, 0) for r in range(rows)]
    q = torch.full((rows * (max_q - 1), probs.shape[1]), 1.0 / probs.shape[1],
                   dtype=torch.float32, device=dev)  # fmt: skip
    rejection_sampler.verify_sampled_batch(probs, verify, q)


class CudaMemory:
    """torch's allocator on one CUDA device, as ``step_workspace`` and ``pool_pages`` read it
    (tests stand in for it on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free(self) -> int:
        """Bytes free on the device, the allocator's cache handed back first."""
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def peak_of(self, step: Callable[[], None]) -> int:
        """Bytes ``step`` had allocated at its peak, beyond what was allocated before it."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before


def step_workspace(model, shapes: StepShapes, memory) -> int:
    """Bytes the KV pool leaves for the steps (module docstring): the eager step's peak plus
    the graph step's, each measured by ``memory.peak_of``. An out-of-memory error here is
    raised as a RuntimeError naming the settings that shrink the steps."""
    steps = [(shapes.eager_tokens, shapes.eager_rows, False)]
    if shapes.graph_rows:
        steps.append((shapes.graph_rows, shapes.graph_rows, True))
    total = 0
    with torch.inference_mode():
        for tokens, rows, graph in steps:
            try:
                total += memory.peak_of(lambda t=tokens, r=rows, g=graph: run_step(
                    model, t, r, shapes.max_q, g))  # fmt: skip
            except torch.OutOfMemoryError as e:
                raise RuntimeError(
                    f"the largest {'graph' if graph else 'eager'} step ({tokens} tokens, "
                    f"{rows} rows of logits over a vocabulary of {model.arch.vocab_size}) "
                    f"does not fit in the memory left after the weights; lower "
                    f"max_num_batched_tokens or max_num_seqs") from e  # fmt: skip
    return total


def pool_pages(cache: CacheConfig, page_bytes: int, free_bytes: int | None,
               workspace: int = 0) -> int:  # fmt: skip
    """Pages of the KV pool: ``cache.num_pages``; else ``kv_cache_memory_bytes`` of pages;
    else, on a GPU (free_bytes: its free memory with the weights loaded),
    ``gpu_memory_utilization`` of that less the step workspace (bytes); else (the CPU,
    free_bytes None) 1 GiB of pages. Fewer than two pages raise ValueError."""
    if cache.num_pages is not None:
        pages = cache.num_pages
    elif cache.kv_cache_memory_bytes is not None:
        pages = cache.kv_cache_memory_bytes // page_bytes
    elif free_bytes is not None:
        budget = int(free_bytes * cache.gpu_memory_utilization) - workspace
        pages = max(budget, 0) // page_bytes
        if pages < 2:
            raise ValueError(
                f"KV cache budget holds only {pages} pages: gpu_memory_utilization "
                f"{cache.gpu_memory_utilization} of {free_bytes / 2**30:.2f} GiB free, "
                f"less {workspace / 2**30:.2f} GiB for the largest steps; raise "
                f"gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs"
            )  # fmt: skip
    else:
        pages = CPU_POOL_BYTES // page_bytes
    if pages < 2:
        raise ValueError(f"KV cache budget holds only {pages} pages; raise it")
    return pages
