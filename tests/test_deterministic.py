"""The deterministic mode (``EngineConfig.deterministic``, issue 18): a row's logits are the
same bits whatever the other rows of its step, its own query count (a decode row, a verify
row, a prefill chunk) and its place in the batch. Here on the CPU's torch reference (linear
layers as one-row GEMMs, each query attended alone); the GPU's kernels (one GEMM tiling, one
attention tile and fixed KV chunks) in tests/kernels/test_linear.py and the `-m gpu` tests."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.attention import get_backend
from aspire_ray.config import build_engine_config
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.tp import single_rank
from aspire_ray.tp.layers import invariant_linear, set_batch_invariant
from aspire_ray.worker.model_loading import build_model

PAGE = 4


def test_invariant_linear_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(9, 40, generator=gen)
    alone = torch.cat([invariant_linear(x[i : i + 1], w, b) for i in range(9)])
    assert torch.equal(invariant_linear(x, w, b), alone)
    assert torch.equal(invariant_linear(x[2:7], w, b), alone[2:7])
    torch.testing.assert_close(alone, torch.nn.functional.linear(x, w, b))


class _Plan:
    """The model's attention plan for one step: store the step's K/V by slot, then attend."""

    def __init__(self, backend, q_lens, page_lists, kv_lens, slots):
        self.backend, self.slots = backend, torch.tensor(slots, dtype=torch.int64)
        self.meta = PagedKVMeta.build(q_lens, page_lists, kv_lens, PAGE)

    def attend(self, layer, q, k, v, kv_cache, scale):
        self.backend.store_kv(k, v, kv_cache, self.slots)
        return self.backend.attention(q, kv_cache, self.meta, scale)


def _step(model, backend, caches, rows):
    """rows: (tokens, first position, page list) each -> logits [sum tokens, V]."""
    ids, pos, slots, q_lens, pages, kv_lens = [], [], [], [], [], []
    for tokens, start, plist in rows:
        ids += tokens
        pos += range(start, start + len(tokens))
        slots += [plist[p // PAGE] * PAGE + p % PAGE for p in range(start, start + len(tokens))]
        q_lens.append(len(tokens))
        n = start + len(tokens)
        pages.append(plist[: -(-n // PAGE)])
        kv_lens.append(n)
    plan = _Plan(backend, q_lens, pages, kv_lens, slots)
    hidden = model(torch.tensor(ids), torch.tensor(pos), plan, caches)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_rows_logits_do_not_depend_on_its_step(tiny_model_dir, deterministic):
    cfg = build_engine_config(tiny_model_dir("llama"))
    model = build_model(cfg, single_rank(), torch.device("cpu"))
    if deterministic:
        set_batch_invariant(model)
    backend = get_backend("torch", "cpu", deterministic=deterministic)
    arch = model.arch
    shape = (64, 2, PAGE, arch.num_kv_heads, arch.head_dim)
    caches = [torch.zeros(shape) for _ in range(arch.num_layers)]
    seq = random_prompts(1, [20], vocab=256, seed=1)[0]
    other = random_prompts(2, [14, 9], vocab=256, seed=2)
    pages = [list(range(0, 10)), list(range(20, 30)), list(range(40, 50))]
    # prompts: the sequence's first 12 tokens, and two other requests, in one prefill step
    _step(model, backend, caches, [(seq[:12], 0, pages[0]), (other[0], 0, pages[1]),
                                   (other[1], 0, pages[2])])  # fmt: skip
    base = [c.clone() for c in caches]

    def logits_at_12(rows, index):
        for c, b in zip(caches, base, strict=True):
            c.copy_(b)
        return _step(model, backend, caches, rows)[index]

    alone = logits_at_12([(seq[12:13], 12, pages[0])], 0)  # a decode row, alone
    ways = {
        "decode row in a batch": logits_at_12(
            [(other[0][:1], 14, pages[1]), (seq[12:13], 12, pages[0]),
             (other[1][:1], 9, pages[2])], 1),  # fmt: skip
        "verify row of 5 queries": logits_at_12([(seq[12:17], 12, pages[0])], 0),
        "verify row beside a draft row": logits_at_12(
            [(other[1][:1], 9, pages[2]), (seq[12:16], 12, pages[0])], 1),
    }
    same = {name: torch.equal(x, alone) for name, x in ways.items()}
    if deterministic:
        assert all(same.values()), same
    else:  # the default kernels round otherwise by the row count: the test can fail
        assert not all(same.values()), same
        for x in ways.values():
            torch.testing.assert_close(x, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed", "aspire"])
def test_deterministic_modes_match_ar(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(3, [8, 24, 40], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(3)]  # fmt: skip

    def run(spec_mode):
        cfg = build_engine_config(model_dir, spec_mode=spec_mode, max_num_batched_tokens=64,
                                  num_pages=120, max_num_seqs=4, page_size=4, calibrate="off",
                                  k_min=3, recent_pages=1, d_max=6, deterministic=True)
        return run_staggered(LLMEngine(cfg), prompts, params, arrive_every=2)

    assert run(mode) == run("ar")


def test_deterministic_attention_options_are_checked():
    pytest.importorskip("triton")
    from aspire_ray.attention.triton_backend import TritonBackend

    backend = TritonBackend(deterministic=True)
    assert backend.config.block_m_min == backend.config.block_m_max == 64
    assert backend.config.kv_chunk_pages == 64
    assert backend.config.prefill_sdpa == "off"  # a flash kernel tiles by the row's shape
    assert TritonBackend(deterministic=True, kv_chunk_pages=8).config.kv_chunk_pages == 8
    for bad in ({"kv_chunk_pages": None}, {"block_m_min": 16}, {"split_max_q": 8},
                {"prefill_sdpa": "on"}):
        with pytest.raises(ValueError, match="contradict deterministic"):
            TritonBackend(deterministic=True, **bad)
    with pytest.raises(ValueError, match="deterministic needs"):
        get_backend("flashinfer", "cuda", deterministic=True)


def test_serve_settings_carry_deterministic():
    from aspire_ray.serving.settings import EngineArgs

    assert EngineArgs(deterministic=True).to_engine_config().deterministic is True
    assert EngineArgs().to_engine_config().deterministic is False


def _deterministic_graphs_run(model_dir, spec_mode):
    """``spec_mode`` on the deterministic mode's (emulated) graphs, 3 staggered requests."""
    from helpers import use_eager_graphs

    prompts = random_prompts(3, [8, 30, 50], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=7 + i, temperature=0.0, ignore_eos=True)
              for i in range(3)]  # fmt: skip
    cfg = build_engine_config(model_dir, spec_mode=spec_mode, max_num_batched_tokens=64,
                              num_pages=120, max_num_seqs=4, page_size=4, calibrate="off",
                              k_min=3, recent_pages=1, d_max=4, gamma=3, async_steps=4,
                              attention_backend="triton", deterministic=True)
    engine = LLMEngine(cfg)
    w = use_eager_graphs(engine, chunk_pages=4, deterministic=True)
    out = run_staggered(engine, prompts, params, arrive_every=2)
    replayed = w.step_graphs.steps + (w.draft_graphs.steps if w.draft_graphs else 0) + \
        (w.async_graphs.steps if w.async_graphs else 0)  # fmt: skip
    assert w.backend.config.block_m_min == 64 and replayed > 5
    return out


@pytest.fixture(scope="module")
def deterministic_graphs_ar(tiny_model_dir):
    # `ar` on the deterministic graphs, every mode's reference below: the same run for each
    # mode (a third of each case's time under the interpreter), so it runs once
    pytest.importorskip("triton")
    return _deterministic_graphs_run(tiny_model_dir("llama_3l"), "ar")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["magicdec", "aspire"])
def test_deterministic_graphs_match_ar(tiny_model_dir, deterministic_graphs_ar, mode):
    # the GPU's paths (self-planning graphs, fixed plans of one 64-row tile and fixed chunks)
    # under Triton's interpreter: they plan and replay with the deterministic attention (the
    # bitwise property itself is the GPU's: the interpreter's numpy rounds by tile position)
    pytest.importorskip("triton")
    got = _deterministic_graphs_run(tiny_model_dir("llama_3l"), mode)
    assert got == deterministic_graphs_ar
