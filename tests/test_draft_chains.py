"""Draft chains (SpecConfig.draft_chains): a synchronized batch runs its remaining draft steps
back to back in one plan, drafts fed forward on the device. Same tokens as one plan per draft
step, and as plain autoregressive decoding (fp32, CPU)."""

from __future__ import annotations

import pytest
from helpers import random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)


def _run(model_dir, mode, temperature=0.0, **extra):
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                              num_pages=120, **SPARSE, **extra)  # fmt: skip
    engine = LLMEngine(cfg)
    chains = []
    execute = engine.executor.execute

    def recording(plan):
        chains.append(max((row.num_steps for row in plan.rows), default=1))
        return execute(plan)

    engine.executor.execute = recording
    prompts = random_prompts(4, [30, 100, 150], vocab=256, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)] * 4
    return run_staggered(engine, prompts, params, arrive_every=2), chains


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed"])
def test_chains_give_the_tokens_of_single_draft_steps(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    expected, _ = _run(model_dir, "ar")
    single, single_chains = _run(model_dir, mode, draft_chains=False)
    chained, chains = _run(model_dir, mode)
    assert set(single_chains) == {1}
    assert max(chains) == SPARSE["gamma"]  # whole chains ran (all drafts of a round at once)
    assert len(chains) < len(single_chains)
    assert chained == single == expected


def test_no_chains_when_sampling_or_per_request(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    _, sampled = _run(model_dir, "magicdec", temperature=0.8)
    _, per_request = _run(model_dir, "aspire")
    assert set(sampled) == {1} and set(per_request) == {1}
