"""The piecewise-graph forward equals the eager forward (CPU: graphs emulated by re-running the
captured pieces, so bucketing, padding, static buffers and the piece split are what is tested)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.attention import AttentionBackend
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.worker.cuda_graphs import (
    EagerGraph,
    PiecewiseGraphs,
    buckets,
    graph_tokens,
    row_buckets,
)

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)


class _SkipPadding(AttentionBackend):
    """The reference store, skipping negative slots as the Triton store does (padding)."""

    def store_kv(self, k, v, kv_cache, slot_mapping):
        keep = slot_mapping >= 0
        super().store_kv(k[keep], v[keep], kv_cache, slot_mapping[keep])


def _run(model_dir, mode, graphs: bool):
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                              num_pages=120, **SPARSE)  # fmt: skip
    engine = LLMEngine(cfg)
    w = engine.executor.worker
    if graphs:
        w.graphs = PiecewiseGraphs(w.model, _SkipPadding(), 16, w.device, EagerGraph)
    prompts = random_prompts(4, [1, 20, 60], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4
    return run_staggered(engine, prompts, params, arrive_every=2), w


@pytest.mark.parametrize("family,mode", [("llama", "ar"), ("qwen3", "ar"), ("llama", "aspire")])
def test_graphed_equals_eager(tiny_model_dir, family, mode):
    model_dir = tiny_model_dir(family)
    expected, _ = _run(model_dir, mode, graphs=False)
    got, w = _run(model_dir, mode, graphs=True)
    assert got == expected
    assert w.graphs.graphs, "no step ran through the graphs"
    assert len(w.graphs.graphs[min(w.graphs.graphs)]) == w.arch.num_layers + 1


def test_buckets():
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(1000)[-1] == 512
    # finer from 128 tokens: a 64-row verification of 9 queries (576 tokens) pads to 1,024,
    # 768 or 640; below 128 the same powers of two at every granularity
    assert buckets(1024, 2)[6:] == [64, 128, 192, 256, 384, 512, 768, 1024]
    assert buckets(1024, 4)[8:] == [160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert buckets(100, 4) == buckets(100) and buckets(1000, 4)[-1] == 896
    assert [next(b for b in buckets(1024, k) if b >= 576) for k in (1, 2, 4)] == [1024, 768, 640]
    assert all(b % 32 == 0 for k in (2, 4) for b in buckets(2048, k) if b >= 128)
    # self-planning graphs keep their rows in powers of two below max_num_seqs (each captures
    # every token bucket of its rows), then max_num_seqs: the same at every granularity
    for k in (1, 2, 4):
        assert row_buckets(buckets(1024, k), 64) == [1, 2, 4, 8, 16, 32, 64]
        assert row_buckets(buckets(1024, k), 170) == [1, 2, 4, 8, 16, 32, 64, 128, 170]


def test_graphs_cover_every_decode_step_within_the_budget():
    # ar at 64 rows, prefill chunks, and 64 verify rows of a 9-query tile: 1,024 tokens
    assert graph_tokens(2048, 64, 1) == 1024 and graph_tokens(2048, 64, 9) == 1024
    # 165 rows verifying 7 drafts on one slot (1,320 tokens): the 2,048 bucket
    assert next(b for b in buckets(graph_tokens(2048, 165, 9)) if b >= 165 * 8) == 2048
    # never past the step's token budget; a few rows keep the 1,024 floor (prefill chunks)
    assert graph_tokens(512, 64, 17) == 512 and graph_tokens(16384, 4, 17) == 1024
    assert graph_tokens(16384, 300, 9) == 4096


def _run_triton(model_dir, mode, whole: bool):
    """Triton attention (the interpreter on a CPU); whole: piecewise + whole-step graphs."""
    from aspire_ray.attention.triton_backend import TritonBackend
    from aspire_ray.kernels.paged_attention import AttentionConfig
    from aspire_ray.worker.step_graphs import StepGraphs

    # no start-up calibration: its sweep would run under the interpreter too (and time it)
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                              num_pages=120, attention_backend="triton", max_num_seqs=4,
                              calibrate="off", **SPARSE)  # fmt: skip
    engine = LLMEngine(cfg)
    w = engine.executor.worker
    # small chunks: rows split, so the fixed plans' merge and partial buffers are exercised
    w.backend = TritonBackend(AttentionConfig(min_chunk_pages=1, waves=2.0))
    w.step_resources = replace(w.step_resources, backend=w.backend)  # planning's backend too
    if whole:
        w.graphs = PiecewiseGraphs(w.model, w.backend, 16, w.device, EagerGraph)
        split = w.refresh_layer if w.selector is not None and w.selector.uses_scores else None
        w.step_graphs = StepGraphs(w.graphs, split, w.max_q, 16, w.backend.config)
    prompts = random_prompts(4, [1, 20, 60], vocab=256, seed=4)
    # 6 tokens (the interpreter runs every program): still 20+ steps replayed whole
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 4
    return run_staggered(engine, prompts, params, arrive_every=2), w


@pytest.mark.parametrize("mode", ["ar", "magicdec", "aspire"])
def test_whole_step_graphs_equal_eager(tiny_model_dir, mode):
    # the same Triton kernels and work split: the outputs are identical, not just close
    # interpreted kernels: 3 layers (aspire: around its refresh layer), 2 for ar and magicdec
    model_dir = tiny_model_dir("llama_3l" if mode == "aspire" else "llama_2l")
    expected, _ = _run_triton(model_dir, mode, whole=False)
    got, w = _run_triton(model_dir, mode, whole=True)
    assert got == expected
    assert w.step_graphs.steps > 10, "too few steps replayed whole"
    assert len(w.step_graphs.graphs[min(w.step_graphs.graphs)]) == (2 if mode == "aspire" else 1)


def test_row_buckets_hold_up_to_max_rows_or_all():
    # a self-planning graph family's row buckets: the powers of two below max_num_seqs, then
    # max_num_seqs (a full batch pads to no row it cannot hold: 160 rows of a 9-query tile
    # fill 1,440 tokens, a 2,048 bucket, where 256 rows' 2,304 had none); with more requests
    # than the largest token bucket (1024 of them at 512 tokens a step) all of them, where the
    # comparison with no bucket raised TypeError at start-up
    assert row_buckets(buckets(512), 64) == [1, 2, 4, 8, 16, 32, 64]
    assert row_buckets(buckets(512), 48) == [1, 2, 4, 8, 16, 32, 48]
    assert row_buckets(buckets(512), 1024) == buckets(512)
    assert row_buckets(buckets(2048), 160)[-1] * 9 <= graph_tokens(2048, 160, 9) == 2048
