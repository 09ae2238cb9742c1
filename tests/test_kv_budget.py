"""The KV pool's size and the step workspace it leaves free (``worker/kv_budget.py``).

On the CPU nothing is measured by torch, so the workspace is measured here by ``LiveBytes``:
the bytes of the tensors a step made and still holds, at their peak (what
``torch.cuda.max_memory_allocated`` reads on a GPU). The H200's failure these tests hold back:
an ``aspire`` pool sized without the sampled step's [queries, vocab] buffers, whose graph
capture then ran out of memory and left every step eager (docs/bench_decode_h200_qwen05b_32k_
max_s38.log)."""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import eager_graphs_on
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from aspire_ray.config import CacheConfig, SchedulerConfig, build_engine_config
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.tp import single_rank
from aspire_ray.worker import device_memory, kv_budget
from aspire_ray.worker.cuda_graphs import buckets
from aspire_ray.worker.model_loading import build_model

GIB = 1 << 30


class LiveBytes(TorchDispatchMode):
    """``CudaMemory.peak_of`` on the CPU: bytes of the storages that ops under it allocate
    (an output sharing no storage with its inputs), counted until freed, at their peak."""

    def peak_of(self, step) -> int:
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}
        with self:
            step()
        return self.peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if ptr in inputs or ptr in self.sizes or size == 0:
                continue
            self.sizes[ptr] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.live -= self.sizes.pop(ptr, 0)


def test_live_bytes_counts_what_a_step_holds_at_its_peak():
    def step():
        a = torch.zeros(1000, dtype=torch.float32)  # 4000 B
        b = a + 1  # 4000 B more: the peak
        del a
        torch.zeros(10, dtype=torch.float32)  # made and freed after the peak
        return b.view(10, 100)  # a view: no new storage

    assert LiveBytes().peak_of(step) == 8000


def test_step_shapes_are_the_largest_the_scheduler_emits():
    big = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=16384)
    graph_buckets = buckets(1024)
    # aspire at the H200 benchmark's settings: every query of 1024 verify rows of 17 has
    # logits, up to the step's token budget; its graphs' largest step fills the 1024 bucket
    shapes = kv_budget.step_shapes(big, 17, graph_buckets)
    assert shapes == kv_budget.StepShapes(16384, 16384, 17, 1024)
    # ar (one query a row): one logit row a request
    assert kv_budget.step_shapes(big, 1, graph_buckets).eager_rows == 1024
    # the row bucket of 3 requests (max_num_seqs, cuda_graphs.row_buckets) of verify rows of
    # 17 queries: 51 tokens, padded to the 64 bucket the verification graph runs in
    # (VerifyGraphs.ensure: bucket(n * q))
    small = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=2048)
    assert kv_budget.step_shapes(small, 17, graph_buckets).graph_rows == 64
    # finer buckets pad less: 64 rows x 9 queries (576 tokens) in 640, not 1,024
    mid = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    assert kv_budget.step_shapes(mid, 9, buckets(2048)).graph_rows == 1024
    assert kv_budget.step_shapes(mid, 9, buckets(2048, 4)).graph_rows == 640
    assert kv_budget.step_shapes(small, 17, None).graph_rows == 0  # no graphs


def test_pool_pages_leave_the_step_workspace_free():
    cache, page = CacheConfig(gpu_memory_utilization=0.5), 1000
    assert kv_budget.pool_pages(cache, page, free_bytes=200_000) == 100
    assert kv_budget.pool_pages(cache, page, free_bytes=200_000, workspace=30_500) == 69
    # an explicit pool is the user's: no workspace taken from it
    assert kv_budget.pool_pages(CacheConfig(num_pages=7), page, 200_000, 30_500) == 7
    assert kv_budget.pool_pages(CacheConfig(kv_cache_memory_bytes=9000), page, None) == 9
    assert kv_budget.pool_pages(cache, page, free_bytes=None) == kv_budget.CPU_POOL_BYTES // page
    with pytest.raises(ValueError, match="lower max_num_batched_tokens / max_num_seqs"):
        kv_budget.pool_pages(cache, page, free_bytes=200_000, workspace=99_000)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    cfg = build_engine_config(tiny_model_dir("llama"), calibrate="off")
    return build_model(cfg, single_rank(), torch.device("cpu"))


def _workspace(model, seqs: int, max_q: int, graphs: bool = True) -> int:
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=256)
    shapes = kv_budget.step_shapes(sched, max_q, buckets(64) if graphs else None)
    return kv_budget.step_workspace(model, shapes, LiveBytes())


def test_the_workspace_holds_the_sampled_steps_logits_and_probabilities(tiny_model):
    vocab, row = tiny_model.arch.vocab_size, tiny_model.arch.vocab_size * 4  # float32 row
    # 8 requests verifying 16 drafts: 136 queries, all with logits, under the 256 budget;
    # the graph step of 64 queries (the largest bucket)
    eager = _workspace(tiny_model, 8, 17, graphs=False)
    both = _workspace(tiny_model, 8, 17)
    # float32 logits and probabilities of every query, and beside them the verified drafts'
    # q stacked (8 rows x 16)
    assert eager >= (2 * 136 + 8 * 16) * row, eager
    # the graph's step adds its own: at least its probabilities (its logits: the model's dtype)
    assert both - eager >= 64 * row, (both, eager, vocab)


def test_the_pool_shrinks_as_the_largest_step_grows(tiny_model):
    # the regression: the pool was sized from free memory alone, whatever the largest step
    # (more rows, more queries a row) needed beside it
    cache, page = CacheConfig(gpu_memory_utilization=0.9), 4096
    free = 64 << 20
    sizes = [(4, 1), (4, 17), (16, 17)]  # (max_num_seqs, max_q)
    spaces = [_workspace(tiny_model, seqs, q) for seqs, q in sizes]
    pages = [kv_budget.pool_pages(cache, page, free, ws) for ws in spaces]
    assert spaces[0] < spaces[1] < spaces[2]
    assert pages[0] > pages[1] > pages[2]
    assert pages[2] == (int(free * 0.9) - spaces[2]) // page


def test_the_graphs_q_stores_leave_the_step_workspace_free(tiny_model_dir, monkeypatch):
    # a sampled variant's q store, made after the pool, left 1 GiB free where the capture of
    # its step needed more: now it leaves the measured workspace
    cfg = build_engine_config(tiny_model_dir("llama"), spec_mode="aspire", num_pages=64,
                              max_num_seqs=4, max_num_batched_tokens=64, page_size=4,
                              calibrate="off")  # fmt: skip
    w = LLMEngine(cfg).executor.worker
    w.step_workspace = 3 * GIB
    graphs = eager_graphs_on(w).async_graphs
    store = graphs.rows_q
    assert store.spare == w.store_spare == 3 * GIB
    monkeypatch.setattr(device_memory, "free_device_bytes",
                        lambda device: store.nbytes + 2 * GIB)  # fmt: skip
    assert not graphs.q_store_fits()
    monkeypatch.setattr(device_memory, "free_device_bytes",
                        lambda device: store.nbytes + 3 * GIB)  # fmt: skip
    assert graphs.q_store_fits()
    w.step_workspace = 0  # never below SPARE_BYTES
    assert w.store_spare == device_memory.SPARE_BYTES


def test_a_capture_out_of_memory_is_an_error_not_an_eager_engine(tiny_model_dir, monkeypatch):
    # the H200 run: one sampled variant's capture ran out of memory and every graph was
    # dropped, `aspire` 0.66x `ar` with a warning; now start-up fails and says what to lower
    cfg = build_engine_config(tiny_model_dir("llama"), spec_mode="aspire", num_pages=64,
                              max_num_seqs=4, max_num_batched_tokens=64, page_size=4,
                              calibrate="off")  # fmt: skip
    w = eager_graphs_on(LLMEngine(cfg).executor.worker)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 594.00 MiB.")

    for graphs in (w.graphs, w.step_graphs):  # captured before: not what is tested
        monkeypatch.setattr(graphs, "capture_all", lambda *args, **kwargs: None)
    monkeypatch.setattr(w.async_graphs, "capture_all", out_of_memory)
    with pytest.raises(RuntimeError, match="gpu_memory_utilization .* max_num_seqs") as err:
        w.warmup()
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert w.async_graphs is not None and w.graphs is not None  # nothing silently dropped


def test_the_host_samples_a_large_step_in_runs(tiny_model, monkeypatch):
    # Worker._sample holds the logits, probabilities and verified q of HOST_SAMPLE_ROWS logit
    # rows at a time (``Worker.logit_runs``): the eager step of 136 logit rows (8 verify rows
    # of 17) holds less when a run holds 34 of them (2 verify rows): 102 rows' logits and
    # probabilities and 96 drafts' q less
    def peak() -> int:
        return LiveBytes().peak_of(lambda: kv_budget.run_step(tiny_model, 136, 136, 17, False))

    whole = peak()
    monkeypatch.setattr(kv_budget.sampler, "HOST_SAMPLE_ROWS", 34)
    runs = peak()
    row = tiny_model.arch.vocab_size * 4
    assert runs <= whole - (2 * 102 + 96) * row, (runs, whole)
