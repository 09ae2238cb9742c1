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
    # "preempting": 14 pages of 16 tokens cannot hold 5 requests of up to 94 tokens at once
    num_pages = 200 if pool == "roomy" else 14
    cfg = build_engine_config(model_dir, max_num_batched_tokens=64, num_pages=num_pages,
                              d_max=4)
    engine = LLMEngine(cfg)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)] * 5
    got = run_staggered(engine, prompts, params, arrive_every=3)
    assert list(got.values()) == expected
    if pool == "preempting":
        assert engine.scheduler.num_preemptions > 0
