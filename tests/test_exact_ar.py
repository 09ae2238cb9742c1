"""Greedy generation equals transformers' generate token for token (fp32, CPU)."""

from __future__ import annotations

import pytest
from helpers import hf_greedy, random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

LENGTHS = [1, 5, 17, 40, 70]  # 1 token .. several 16-token pages
MAX_NEW = 24


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama3_scaled"])
@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_greedy_matches_transformers(tiny_model_dir, family, pool):
    model_dir = tiny_model_dir(family)
    prompts = random_prompts(5, LENGTHS, vocab=256, seed=1)
    expected = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
    # "preempting": 8 pages of 16 tokens cannot hold 5 requests of up to 94 tokens at once
    # (ar's decode chains finish the early requests quickly: a roomier pool may not preempt)
    num_pages = 200 if pool == "roomy" else 8
    # no admission headroom in the preempting pool: requests are admitted and then preempted
    cfg = build_engine_config(model_dir, max_num_batched_tokens=64, num_pages=num_pages,
                              d_max=4, admission_headroom_tokens=0)  # fmt: skip
    engine = LLMEngine(cfg)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)] * 5
    got = run_staggered(engine, prompts, params, arrive_every=3)
    assert list(got.values()) == expected
    if pool == "preempting":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_pause_decoding_prefills_everything_first(tiny_model_dir, mode):
    """scheduler.pause_decoding (the decode benchmarks' start line): while set, only prompts
    are computed, so every request holds exactly its prefill's token; resumed, the outputs
    equal transformers' greedy ones."""
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(4, LENGTHS, vocab=256, seed=2)
    expected = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=32,
                              num_pages=200, d_max=4)
    engine = LLMEngine(cfg)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.scheduler.pause_decoding = True
    steps = 0
    while any(r.in_prefill or r.num_computed == 0 for r in engine.requests.values()):
        engine.step()
        steps += 1
    assert steps > 1  # 32-token chunks: the prompts took several steps
    assert [len(engine.requests[f"r{i}"].output_token_ids) for i in range(4)] == [1] * 4
    assert not engine.step()  # nothing to do while paused
    engine.scheduler.pause_decoding = False
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    assert [got[f"r{i}"] for i in range(4)] == expected


@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_prefill_chunks_through_sdpa_match_transformers(tiny_model_dir, mode):
    """The Triton backend with prefill rows through SDPA (``AttentionConfig.prefill_sdpa``, on
    by default on CUDA): 32-token chunks, so later chunks attend to earlier ones through the
    mask aligned to their last key; decode, draft and verify rows stay on the kernel (Triton's
    interpreter here). Greedy output equals transformers' token for token."""
    model_dir = tiny_model_dir("qwen2")
    prompts = random_prompts(3, [17, 40, 90], vocab=256, seed=3)
    expected = [hf_greedy(model_dir, p, 8) for p in prompts]
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=32,
                              num_pages=200, d_max=4, attention_backend="triton",
                              calibrate="off",
                              attention_options={"prefill_sdpa": "on", "sdpa_min_queries": 8})
    engine = LLMEngine(cfg)
    sdpa_calls = []
    from aspire_ray.kernels import paged_attention as pa

    original = pa.sdpa_rows
    pa.sdpa_rows = lambda *a: (sdpa_calls.append(a[4]), original(*a))[1]  # noqa: E731
    try:
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
        got = run_staggered(engine, prompts, params, arrive_every=2)
    finally:
        pa.sdpa_rows = original
    assert list(got.values()) == expected
    assert len(sdpa_calls) > 10  # chunks of 8+ queries went through SDPA, layer by layer


def test_the_merge_inside_the_attention_launch_matches_transformers(tiny_model_dir, monkeypatch):
    """``AttentionConfig.fused_merge`` through the engine (`aspire`: draft, verify and mixed
    rows, Triton's interpreter here): chunks of one page split every row of more than one, the
    merge launch never runs, and the greedy output equals transformers' token for token."""
    from aspire_ray.kernels import paged_attention as pa

    model_dir = tiny_model_dir("qwen2")
    prompts = random_prompts(3, [17, 40, 70], vocab=256, seed=4)
    expected = [hf_greedy(model_dir, p, 12) for p in prompts]
    cfg = build_engine_config(model_dir, spec_mode="aspire", max_num_batched_tokens=32,
                              num_pages=200, d_max=4, attention_backend="triton",
                              calibrate="off",
                              attention_options={"fused_merge": True, "kv_chunk_pages": 1})
    engine = LLMEngine(cfg)

    class NoLaunch:  # the separate merge kernel
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel was launched")

    monkeypatch.setattr(pa, "_merge_kernel", NoLaunch())
    built, merged = pa._build_plan, []  # plans with split rows (their counters)
    monkeypatch.setattr(pa, "_build_plan", lambda *a: (p := built(*a), merged.append(
        p.counters is not None))[0])  # fmt: skip
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 3
    got = run_staggered(engine, prompts, params, arrive_every=2)
    assert list(got.values()) == expected
    assert sum(merged) > 10  # steps whose rows were split merged in the attention launch
