"""The split-KV merge folded into the attention launch (``AttentionConfig.fused_merge``, issue
14) against ``paged_attention_ref`` and the separate merge launch.

Triton's interpreter (the CPU run) executes programs one after another, so each query tile's
last split item merges: these tests check the merge math, the split count the kernel derives
from an item and the counters' return to zero, not the GPU's concurrency (the ``gpu`` test
below runs real concurrent programs)."""

from dataclasses import replace

import pytest
import torch
from test_paged_attention import DEVICE, LSE_TOLERANCE, TOLERANCES, make_case, requires_cuda

import aspire_ray.kernels.paged_attention as pa
from aspire_ray.kernels.attention_config import DETERMINISTIC
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.paged_attention import (
    AttentionConfig,
    FixedPlan,
    _plan,
    block_ms_for,
    paged_attention,
)
from aspire_ray.kernels.reference import paged_attention_ref

# rows split into chunks of 2 pages (a 37-token row: 2 chunks) or of 1 (a 300-token row: 19
# chunks, more than merge_split_block's 16); small KV tiles keep the interpreter quick
CHUNK2 = AttentionConfig(block_n=16, kv_chunk_pages=2, fused_merge=True)
CHUNK1 = AttentionConfig(block_n=16, kv_chunk_pages=1, fused_merge=True)
# (q lens, kv lens, (q heads, kv heads, head dim), config)
CASES = {
    "decode-2-chunks-g3": ([1, 1], [37, 20], (6, 2, 64), CHUNK2),
    "decode-19-chunks-g1": ([1, 1, 1], [300, 17, 95], (2, 2, 64), CHUNK1),
    "verify-g3": ([5, 6], [70, 200], (6, 2, 64), CHUNK2),
    # 10 queries of 7-head groups: two 64-row query tiles, each merged on its own counter
    "verify-two-tiles-g7": ([10, 3], [150, 60], (7, 1, 64), CHUNK2),
    "mixed-g3": ([1, 5, 100], [37, 70, 131], (6, 2, 64), CHUNK2),
    "mixed-g7-d128": ([1, 4, 1], [300, 90, 33], (7, 1, 128), CHUNK1),
    # the automatic (wave-fitted) chunk, balanced over the row
    "auto-chunks-g3": ([1, 3, 1], [900, 400, 40],
                       (6, 2, 64), AttentionConfig(min_chunk_pages=1, fused_merge=True)),
}  # fmt: skip


# fp32 every case; bf16 the mixed one (16-bit dtypes launch the same kernels, rounded
# otherwise: test_paged_attention's _mixed_rows_cases)
PARAMS = [pytest.param(*case, torch.float32, id=f"fp32-{name}") for name, case in CASES.items()]
PARAMS.append(pytest.param(*CASES["mixed-g3"], torch.bfloat16, id="bf16-mixed-g3"))


def _separate(cfg: AttentionConfig) -> AttentionConfig:
    return replace(cfg, fused_merge=False)


@pytest.mark.parametrize("q_lens, kv_lens, heads, cfg, dtype", PARAMS)
def test_matches_reference_and_separate_merge(q_lens, kv_lens, heads, cfg, dtype):
    q, kv, meta = make_case(q_lens, kv_lens, heads, dtype)
    group, hkv = heads[0] // heads[1], heads[1]
    plan = _plan(meta, group, hkv, cfg)
    assert plan.merge is not None and plan.counters is not None  # the case splits
    scale = q.shape[-1] ** -0.5
    out, lse = paged_attention(q, kv, meta, scale, return_lse=True, config=cfg)
    assert not plan.counters.any()  # every counter back to zero
    ref_out, ref_lse = paged_attention_ref(q, kv, meta, scale, return_lse=True)
    sep_out, sep_lse = paged_attention(q, kv, meta, scale, return_lse=True, config=_separate(cfg))
    atol, rtol = TOLERANCES[dtype]
    for want, want_lse in ((ref_out, ref_lse), (sep_out, sep_lse)):
        torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
        torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
    # without the lse: the same bits (RETURN_LSE only adds the lse's stores)
    assert torch.equal(paged_attention(q, kv, meta, scale, config=cfg), out)
    assert not plan.counters.any()


def test_any_finishing_order():
    # On a GPU the split programs finish in any order; the interpreter runs them in work-list
    # order, so shuffled work lists stand in: the tiles' arrivals interleave (a verify row of
    # two query tiles, two kv heads, each with a counter of its own) and any chunk may be last
    heads = (14, 2, 64)
    q, kv, meta = make_case([10, 1, 3], [150, 200, 60], heads, torch.float32)
    want = paged_attention(q, kv, meta, 0.125, config=_separate(CHUNK2))
    plan = _plan(meta, 7, 2, CHUNK2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for launch in plan.launches:
            n = int(launch.count)
            launch.work[:, :n] = launch.work[:, :n][:, torch.randperm(n, generator=gen)]
        out = paged_attention(q, kv, meta, 0.125, config=CHUNK2)
        assert not plan.counters.any()
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_no_merge_launch(monkeypatch):
    # the fused path makes one launch fewer a call: the merge kernel is never launched
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel was launched")

    q, kv, meta = make_case([1, 5], [37, 70], (6, 2, 64), torch.float32)
    monkeypatch.setattr(pa, "_merge_kernel", NoLaunch())
    out = paged_attention(q, kv, meta, 0.125, config=CHUNK2)
    torch.testing.assert_close(out, paged_attention_ref(q, kv, meta, 0.125), atol=2e-5, rtol=2e-5)
    with pytest.raises(AssertionError, match="merge kernel was launched"):
        paged_attention(q, kv, meta, 0.125, config=_separate(CHUNK2))


def test_unsplit_steps_need_no_counters():
    # no split row (2 pages each): no merge, no counters, FUSED_MERGE off in the kernel
    q, kv, meta = make_case([1, 3], [20, 30], (4, 2, 64), torch.float32)
    plan = _plan(meta, 2, 2, CHUNK2)
    assert plan.merge is None and plan.counters is None
    out = paged_attention(q, kv, meta, 0.125, config=CHUNK2)
    torch.testing.assert_close(out, paged_attention_ref(q, kv, meta, 0.125), atol=2e-5, rtol=2e-5)


def _fixed_plan(cfg: AttentionConfig, share: FixedPlan | None = None) -> FixedPlan:
    return FixedPlan(group=3, hkv=2, num_q_heads=6, head_dim=64,
                     block_ms=block_ms_for(6, 3, cfg), item_capacity=64, merge_capacity=16,
                     part_rows=128, device=torch.device(DEVICE), config=cfg,
                     share=share)  # fmt: skip


def test_fixed_plan_replays_with_counters_back_at_zero():
    # One FixedPlan's buffers loaded with one step, another, then the first again (what a CUDA
    # graph replays): each call merges on counters the last left at zero. A counter left
    # short would merge the next call's tile early, from the earlier step's partials.
    heads = (6, 2, 64)
    plan = _fixed_plan(CHUNK2)
    assert plan.plan.counters.shape == (128 * 2,) and not plan.plan.counters.any()
    z = lambda n: torch.zeros(n, dtype=torch.int32, device=DEVICE)  # noqa: E731
    fixed = PagedKVMeta(z(9), z(9), z(64), z(8), 16, fixed_plan=plan)
    steps = [([1, 6, 1], [37, 70, 131], 0), ([5, 1], [200, 17], 1), ([1, 6, 1], [37, 70, 131], 0)]
    outs = []
    for q_lens, kv_lens, seed in steps:
        q, kv, meta = make_case(q_lens, kv_lens, heads, torch.float32, seed=seed)
        assert plan.load(meta)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
            src = getattr(meta, name)
            getattr(fixed, name)[: src.shape[0]].copy_(src)
        out = paged_attention(q, kv, fixed, 0.125, config=CHUNK2)
        assert not plan.plan.counters.any()
        torch.testing.assert_close(out, paged_attention_ref(q, kv, meta, 0.125), atol=2e-5,
                                   rtol=2e-5)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[2])
    # a plan sharing this one's partial buffers shares its counters (never used at once)
    assert _fixed_plan(CHUNK2, share=plan).plan.counters is plan.plan.counters


@pytest.mark.parametrize("fused_planning", [True, False], ids=["plan-kernel", "tensor-ops"])
def test_device_planned_rows_merge_in_the_kernel(fused_planning):
    # load_rows' work lists (the Triton planner or device_plan's tensor ops) cut the rows as
    # the host plan does, so the split count the kernel derives from an item is theirs too
    heads = (8, 2, 64)
    cfg = AttentionConfig(min_chunk_pages=1, waves=2.0, resident_programs=1, fused_merge=True)
    n_q = [1, 3, 1]
    q, kv, meta = make_case(n_q, [700, 260, 33], heads, torch.float32, seed=3)
    want = paged_attention(q, kv, meta, 0.125, config=_separate(cfg))
    plan = FixedPlan.for_rows(4, 8, 3, kv.shape[0], *heads, torch.device(DEVICE), cfg)
    plan.fused_planning = fused_planning and plan.fused_planning
    indptr = torch.cat([meta.kv_indptr, meta.kv_indptr[-1:]])  # and one padding row
    last = torch.cat([meta.kv_last_page_len, torch.ones(1, dtype=torch.int32)])
    plan.load_rows(indptr, last, torch.tensor(n_q + [0]), 16)
    assert int(plan.plan.merge.count) > 0  # the long rows split
    fixed = PagedKVMeta(torch.cat([meta.qo_indptr, meta.qo_indptr[-1:]]), indptr, meta.kv_indices,
                        last, 16, fixed_plan=plan)  # fmt: skip
    out = paged_attention(q, kv, fixed, 0.125, config=cfg)
    assert not plan.plan.counters.any()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_deterministic_mode_keeps_its_bits():
    # attention_config.DETERMINISTIC with the fused merge: one program merges each tile, in
    # split order whichever program it is, so a call repeats its bits, and a query gets the
    # same bits alone as the first query of a verify row one page longer (its later chunks
    # add exact zeros), as test_paged_attention's deterministic test asks of the separate one
    det = replace(AttentionConfig(), **{**DETERMINISTIC, "kv_chunk_pages": 8}, fused_merge=True)
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 4, 2, 32, 16
    kv = torch.randn(200, 2, ps, hkv, d, generator=gen).to(DEVICE)
    q = torch.randn(6, hq, d, generator=gen).to(DEVICE)
    pages = list(range(3, 83))
    step = PagedKVMeta.build([6], [pages[:17]], [261], ps, device=DEVICE)
    out = paged_attention(q, kv, step, 0.3, config=det)
    assert torch.equal(paged_attention(q, kv, step, 0.3, config=det), out)
    alone = PagedKVMeta.build([1], [pages[:16]], [256], ps, device=DEVICE)
    assert torch.equal(paged_attention(q[:1], kv, alone, 0.3, config=det)[0], out[0])


def test_fused_merge_is_checked():
    with pytest.raises(ValueError, match="fused_merge"):
        AttentionConfig(fused_merge="yes")
    assert AttentionConfig().fused_merge  # on since its H100 run (docs/benchmarks.md §8.53)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_concurrent_merges(dtype):
    # Many split rows at once on a GPU (the merging program is whichever finishes last), the
    # partials' visibility to it included: eagerly, then in a CUDA graph replayed twice.
    kv_lens = [6 + (i * 997) % 4000 for i in range(64)] + [16384 + 7]
    q_lens = [1] * 48 + [6] * 16 + [1]
    q, kv, meta = make_case(q_lens, kv_lens, (9, 3, 64), dtype, seed=5)
    cfg = AttentionConfig(min_chunk_pages=4, fused_merge=True)
    want, want_lse = paged_attention(q, kv, meta, 0.125, return_lse=True, config=_separate(cfg))
    atol, rtol = TOLERANCES[dtype]
    for _ in range(3):
        out, lse = paged_attention(q, kv, meta, 0.125, return_lse=True, config=cfg)
        torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
        torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
    plan = _plan(meta, 3, 3, cfg)
    assert plan.merge is not None and not plan.counters.any()
    # the eager calls' kernel variant (RETURN_LSE is a constexpr: a launch without the lse is
    # another compiled kernel, whose bits may differ; the H100 run of session 40 saw it)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_lse = paged_attention(q, kv, meta, 0.125, return_lse=True, config=cfg)
    for _ in range(2):
        captured.zero_()
        captured_lse.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out) and torch.equal(captured_lse, lse)
        assert not plan.counters.any()
