"""Triton paged attention against ``paged_attention_ref`` (CPU: Triton's interpreter)."""

import random
from dataclasses import replace

import pytest
import torch
from helpers import paged_case

from aspire_ray.attention import get_backend
from aspire_ray.kernels.attention_config import query_tile_tokens
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.paged_attention import (
    DEFAULT_CONFIG,
    AttentionConfig,
    FixedPlan,
    _plan,
    block_ms_for,
    paged_attention,
)
from aspire_ray.kernels.reference import paged_attention_ref
from aspire_ray.kernels.sdpa_rows import sdpa_row_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (atol, rtol) per dtype: bf16 allows ~2 output ulps (the CPU interpreter rounds bf16 by
# truncation and the kernel feeds bf16 probabilities to the PV product); fp32 dots are ieee.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
LSE_TOLERANCE = (1e-4, 1e-5)  # lse is float32 in every dtype

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (q heads, kv heads, head dim): GQA groups 1, 3 and 4; head dims 64 and 128.
HEADS = [(2, 2, 64), (6, 2, 64), (8, 2, 128)]
HEAD_IDS = ["g1-d64", "g3-d64", "g4-d128"]
CONFIGS = {
    "default": AttentionConfig(),
    "split2-bn16": AttentionConfig(block_n=16, kv_chunk_pages=2),
    "split3-bm32": AttentionConfig(block_m_min=32, block_m_max=32, kv_chunk_pages=3),
    "cut3": AttentionConfig(kv_chunk_pages=3, balanced_chunks=False),
}


def make_case(q_lens, kv_lens, heads, dtype, page_size=16, sparse=True, seed=0):
    return paged_case(q_lens, kv_lens, heads, dtype, DEVICE, page_size, sparse, seed)


def check(q, kv, meta, dtype, config=DEFAULT_CONFIG, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = paged_attention(q, kv, meta, scale, return_lse=True, config=config)
    ref_out, ref_lse = paged_attention_ref(q, kv, meta, scale, return_lse=True)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
    out_only = paged_attention(q, kv, meta, scale, config=config)
    torch.testing.assert_close(out_only.float(), ref_out.float(), atol=atol, rtol=rtol)
    # without the lse the same bits, but in rows that SDPA takes (prefill chunks on a GPU)
    sdpa, qo = sdpa_row_ids(q, meta, config, return_lse=False), meta.qo_indptr_host
    kept = [t for r in range(meta.num_rows) if r not in sdpa for t in range(qo[r], qo[r + 1])]
    assert torch.equal(out_only[kept], out[kept])


def _mixed_rows_cases() -> list:
    """(dtype, heads, config) cases of test_mixed_rows: on a GPU every combination (each
    dtype compiles kernels of its own). Under the CPU's interpreter (a second or two a case),
    fp32 with every heads x config, and one 16-bit dtype each, alternating so that fp16 and
    bf16 each meet every head shape and every config: the two launch the same kernels (the
    dtype picks the KV tile only by its element size, ``_block_n``; the dots upcast when
    interpreting), so they differ only in rounding, and every launch of the 36 cases (grid,
    tiles, splits, merges) is still made, by 24."""
    cases = [(dt, di, h, hi, ci, c)
             for dt, di in zip(DTYPES, DTYPE_IDS, strict=True)
             for i, (h, hi) in enumerate(zip(HEADS, HEAD_IDS, strict=True))
             for j, (ci, c) in enumerate(CONFIGS.items())
             if torch.cuda.is_available() or di == "fp32" or (di == "fp16") == ((i + j) % 2 == 0)]
    return [pytest.param(dt, h, c, id=f"{di}-{hi}-{ci}") for dt, di, h, hi, ci, c in cases]


@pytest.mark.parametrize("dtype, heads, config", _mixed_rows_cases())
def test_mixed_rows(dtype, heads, config):
    # decode (1 query), verify (5 queries) and a 100-query prefill chunk in one call; sparse
    # shuffled page lists; partial last pages (37 = 2 pages + 5, 131 = 8 pages + 3).
    q, kv, meta = make_case([1, 5, 100], [37, 70, 131], heads, dtype)
    check(q, kv, meta, dtype, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_from_empty_cache(dtype):
    # n_q == kv_len: query i sees exactly keys 0..i (plain causal prefill), full last page.
    q, kv, meta = make_case([48, 1], [48, 1], (4, 2, 64), dtype, sparse=False)
    check(q, kv, meta, dtype)


@pytest.mark.parametrize("page_size", [8, 32], ids=["ps8", "ps32"])
def test_other_page_sizes(page_size):
    q, kv, meta = make_case([1, 3, 20], [9, 65, 40], (4, 1, 64), torch.float32, page_size)
    check(q, kv, meta, torch.float32, AttentionConfig(block_n=16, kv_chunk_pages=1))


def test_many_decode_rows_split():
    # Many 1-query rows with different lengths, split into chunks of 1 page: every row merges,
    # the 300-token row from 19 splits (more than one merge step of 16).
    kv_lens = [1, 16, 17, 33, 64, 95, 3, 300]
    q, kv, meta = make_case([1] * len(kv_lens), kv_lens, (6, 2, 64), torch.float32)
    check(q, kv, meta, torch.float32, AttentionConfig(block_n=16, kv_chunk_pages=1))


@pytest.mark.parametrize("heads, splits", [(1, 64), (2, 4), (8, 16)])
def test_merge_settings(heads, splits):
    # the merge's heads per program and splits per load (AttentionConfig.merge_*): the
    # 300-token row's 19 splits in one load, or in five
    kv_lens = [1, 17, 95, 300]
    q, kv, meta = make_case([1] * len(kv_lens), kv_lens, (6, 2, 64), torch.float32)
    check(q, kv, meta, torch.float32, AttentionConfig(block_n=16, kv_chunk_pages=1,
                                                      merge_head_block=heads,
                                                      merge_split_block=splits))


def test_plan_splits_long_rows_only():
    # One long decode row among short ones: the planner splits the long row into balanced
    # chunks and leaves the short rows (and the prefill row, too many queries) whole.
    meta = PagedKVMeta.build(
        [1, 1, 100], [list(range(512)), [600], list(range(700, 709))], [8192, 5, 140], 16
    )
    plan = _plan(meta, group=4, hkv=8, cfg=AttentionConfig())
    work = torch.cat([launch.work.cpu() for launch in plan.launches], dim=1)
    splits = int((work[4] >= 0).sum())
    assert splits >= 2
    assert plan.part_rows == splits  # one partial row per split of the long row's one query
    assert int(plan.merge.count) == 1  # only that query goes through the merge
    split_rows = set(work[0][work[4] >= 0].tolist())
    assert split_rows == {0}
    mine = work[:, work[0] == 0]
    chunks = sorted(zip(mine[2].tolist(), mine[3].tolist(), strict=True))
    assert chunks[0][0] == 0 and chunks[-1][1] == 8192
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))


@pytest.mark.parametrize("group", [7, 3, 1])
def test_query_tile_is_what_the_plan_reads(group):
    """The cost model's query tile (``query_tile_tokens``, ShardInfo) is the planner's: a row
    of q queries is cut into ceil(q / tile) query tiles, each reading the row's whole KV."""
    tile = query_tile_tokens(DEFAULT_CONFIG, group)
    assert tile == DEFAULT_CONFIG.block_m_max // group
    n_qs = [1, tile, tile + 1, 2 * tile + 1]
    meta = PagedKVMeta.build(n_qs, [list(range(i * 40, i * 40 + 40)) for i in range(4)],
                             [640] * 4, 16)  # fmt: skip
    plan = _plan(meta, group, 2, DEFAULT_CONFIG)
    work = torch.cat([launch.work.cpu() for launch in plan.launches], dim=1)
    for row, n_q in enumerate(n_qs):
        mine = work[:, work[0] == row]
        read = int((mine[3] - mine[2]).sum())  # KV tokens its items read
        assert read == 640 * -(-n_q // tile), (row, n_q)
    assert query_tile_tokens(DEFAULT_CONFIG, 128) == 1  # a group wider than the tile
    assert get_backend("torch", torch.device("cpu")).query_tile_tokens(group) is None


def _fixed_meta(plan: FixedPlan, rows: int, nnz: int, page_size: int) -> PagedKVMeta:
    """Fixed buffers a CUDA graph would capture: metas of any step are copied into them."""
    z = lambda n: torch.zeros(n, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return PagedKVMeta(z(rows + 1), z(rows + 1), z(nnz), z(rows), page_size, fixed_plan=plan)


def _load(fixed: PagedKVMeta, meta: PagedKVMeta) -> None:
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        src = getattr(meta, name)
        getattr(fixed, name)[: src.shape[0]].copy_(src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fixed_plan_replays_any_step_that_fits(dtype):
    # One FixedPlan and one set of buffers, loaded with two different steps in turn (what a
    # CUDA graph replays): decode and verify rows, split and unsplit; q padded past the tokens.
    heads = (6, 2, 64)
    cfg = AttentionConfig(block_n=16, kv_chunk_pages=2)
    plan = FixedPlan(group=3, hkv=2, num_q_heads=6, head_dim=64,
                     block_ms=block_ms_for(6, 3, cfg), item_capacity=64, merge_capacity=16,
                     part_rows=128, device=torch.device(DEVICE), config=cfg)  # fmt: skip
    fixed = _fixed_meta(plan, rows=8, nnz=64, page_size=16)
    for q_lens, kv_lens, seed in (([1, 6, 1], [37, 70, 131], 0), ([5, 1], [200, 17], 1)):
        q, kv, meta = make_case(q_lens, kv_lens, heads, dtype, seed=seed)
        assert plan.load(meta)
        _load(fixed, meta)
        padded = torch.cat([q, torch.randn(16 - q.shape[0], *q.shape[1:], device=DEVICE,
                                           dtype=dtype)])  # fmt: skip
        out = paged_attention(padded, kv, fixed, q.shape[-1] ** -0.5, config=cfg)
        ref = paged_attention_ref(q, kv, meta, q.shape[-1] ** -0.5)
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(out[: q.shape[0]].float(), ref.float(), atol=atol, rtol=rtol)


def test_fixed_plan_refuses_what_does_not_fit():
    cfg = AttentionConfig(kv_chunk_pages=1)
    plan = FixedPlan(group=1, hkv=2, num_q_heads=2, head_dim=64, block_ms=block_ms_for(1, 1, cfg),
                     item_capacity=4, merge_capacity=4, part_rows=8, device=torch.device(DEVICE),
                     config=cfg)  # fmt: skip
    _, _, small = make_case([1], [40], (2, 2, 64), torch.float32)  # 3 pages: 3 splits
    assert plan.load(small)
    _, _, long_row = make_case([1], [100], (2, 2, 64), torch.float32)  # 7 splits > capacity
    assert not plan.load(long_row)
    _, _, verify = make_case([2], [40], (2, 2, 64), torch.float32)  # another query tile
    assert block_ms_for(2, 1, cfg) == [16] and plan.load(verify)
    _, _, prefill = make_case([40], [40], (2, 2, 64), torch.float32)  # BLOCK_M 64: not held
    assert not plan.load(prefill)


def test_strided_q():
    # q as a view into a fused qkv projection output: token stride larger than Hq * D.
    _, kv, meta = make_case([1, 5], [20, 40], (4, 2, 64), torch.float32)
    qkv = torch.randn(6, 8, 64, device=DEVICE)
    check(qkv[:, :4], kv, meta, torch.float32)


def test_triton_backend_matches_torch_backend():
    q, kv, meta = make_case([1, 4], [30, 50], (4, 2, 64), torch.float32)
    out = get_backend("triton", DEVICE).attention(q, kv, meta, 0.125)
    ref = get_backend("torch", DEVICE).attention(q, kv, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_rejects_bad_inputs():
    q, kv, meta = make_case([1], [20], (4, 2, 64), torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.half(), kv, meta, 0.1)
    with pytest.raises(ValueError, match="heads"):
        paged_attention(q[:, :3], kv, meta, 0.1)
    with pytest.raises(ValueError, match="tokens"):
        paged_attention(torch.cat([q, q]), kv, meta, 0.1)
    meta.qo_indptr_host = None
    with pytest.raises(ValueError, match="_host"):
        paged_attention(q, kv, meta, 0.1)


SDPA = AttentionConfig(prefill_sdpa="on", sdpa_min_queries=20)


@pytest.mark.parametrize("heads", [(6, 2, 64), (7, 1, 64), (2, 2, 128)],
                         ids=["g3", "g7", "g1-d128"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_rows_through_sdpa(dtype, heads):
    # prefill chunks of >= 20 queries through SDPA: one from an empty cache (40 of 40 keys:
    # plain causal), one after earlier chunks (24 queries over 131 keys: the mask aligned to
    # the last key), beside a decode and a verify row that the kernel keeps
    q, kv, meta = make_case([1, 5, 40, 24], [37, 70, 40, 131], heads, dtype)
    scale = q.shape[-1] ** -0.5
    out = paged_attention(q, kv, meta, scale, config=SDPA)
    ref = paged_attention_ref(q, kv, meta, scale)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    kernel = paged_attention(q, kv, meta, scale, config=replace(SDPA, prefill_sdpa="off"))
    assert torch.equal(out[:6], kernel[:6])  # the kernel's rows: the same bits
    assert not torch.equal(out[6:], kernel[6:])  # (and the long ones another computation)
    # the log-sum-exp's calls (the refresh layer's scoring) keep the kernel for every row
    with_lse, _ = paged_attention(q, kv, meta, scale, return_lse=True, config=SDPA)
    assert torch.equal(with_lse, kernel)


def test_only_long_rows_through_sdpa():
    # every row long: no kernel launch at all; short rows alone: no SDPA
    q, kv, meta = make_case([30, 21], [30, 90], (4, 2, 64), torch.float32)
    out = paged_attention(q, kv, meta, 0.125, config=SDPA)
    torch.testing.assert_close(out, paged_attention_ref(q, kv, meta, 0.125), atol=2e-5, rtol=2e-5)
    assert _plan(meta, 2, 2, replace(SDPA, skip_queries=20)).launches == []
    q, kv, meta = make_case([1, 19], [30, 90], (4, 2, 64), torch.float32)
    assert sdpa_row_ids(q, meta, SDPA, return_lse=False) == []
    q, kv, meta = make_case([1, 20], [30, 90], (4, 2, 64), torch.float32)
    assert sdpa_row_ids(q, meta, SDPA, return_lse=False) == [1]
    assert sdpa_row_ids(q, meta, SDPA, return_lse=True) == []
    # "auto": CUDA only (the CPU's serving backend is the torch reference anyway)
    auto = sdpa_row_ids(q, meta, replace(SDPA, prefill_sdpa="auto"), return_lse=False)
    assert auto == ([1] if q.is_cuda else [])


def test_prefill_sdpa_settings_are_checked():
    with pytest.raises(ValueError, match="prefill_sdpa"):
        AttentionConfig(prefill_sdpa="yes")
    with pytest.raises(ValueError, match="sdpa_min_queries"):
        AttentionConfig(sdpa_min_queries=1)


GPU_CASES = {
    "decode64-4k": ([1] * 64, [random.Random(i).randint(1, 4096) for i in range(64)]),
    "verify17": ([17] * 16, [random.Random(i).randint(17, 3000) for i in range(16)]),
    "mixed": ([1] * 30 + [9] * 10 + [700, 256], [2000] * 30 + [500] * 10 + [900, 8000]),
    "one-long-row": ([1], [16384 + 7]),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)], ids=["g4-d128", "g3-d64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_grid(dtype, heads, case):
    q_lens, kv_lens = case
    q, kv, meta = make_case(q_lens, kv_lens, heads, dtype, seed=len(q_lens))
    check(q, kv, meta, dtype)


def _mixed_case(q_lens: list[int], dtype, seed: int):
    """A mixed step of Qwen2.5-0.5B's heads: rows of these query counts over 100-3000 KV
    tokens each -> q, kv, meta."""
    kv_lens = [random.Random(i).randint(100, 3000) for i in range(len(q_lens))]
    return make_case(q_lens, kv_lens, (14, 2, 64), dtype, seed=seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_launches_side_by_side_equal_one_after_another(dtype):
    # A mixed step's draft rows (16-row tiles) and verify rows (64-row tiles) are two launches,
    # run on two streams by default: bit for bit the serial result, eagerly and in a CUDA graph.
    q, kv, meta = _mixed_case([1] * 40 + [6] * 12 + [1] * 12, dtype, seed=3)
    serial = AttentionConfig(concurrent_launches=False)
    assert len(_plan(meta, 7, 2, DEFAULT_CONFIG).launches) == 2
    want, want_lse = paged_attention(q, kv, meta, 0.125, return_lse=True, config=serial)
    out, lse = paged_attention(q, kv, meta, 0.125, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(q, kv, meta, 0.125)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)


def test_register_caps_are_checked():
    with pytest.raises(ValueError, match="max_registers"):
        AttentionConfig(max_registers=300)
    with pytest.raises(ValueError, match="wide_max_registers"):
        AttentionConfig(wide_max_registers=8)
    with pytest.raises(ValueError, match="mid_max_registers"):
        AttentionConfig(mid_max_registers=256)


def test_register_cap_by_query_tile(monkeypatch):
    # 16-row tiles (decode, draft rows) take max_registers, 32-row tiles (a verify row of 6-9
    # queries of 3-head groups) mid_max_registers, 64-row tiles wide_max_registers; a 32-row
    # tile without a mid cap takes max_registers (before session 28: the compiler's choice)
    import aspire_ray.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "interpreting", lambda: False)
    cfg = AttentionConfig(max_registers=96, mid_max_registers=128, wide_max_registers=168)
    assert [pa.register_cap(cfg, m) for m in (16, 32, 64)] == [
        {"maxnreg": 96}, {"maxnreg": 128}, {"maxnreg": 168}]  # fmt: skip
    assert pa.register_cap(AttentionConfig(mid_max_registers=None), 32) == {}
    assert pa.register_cap(DEFAULT_CONFIG, 32) == {"maxnreg": 168}
    assert pa.register_cap(DEFAULT_CONFIG, 16) == {}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_register_caps_keep_every_bit(dtype):
    # ptxas allocates registers, it does not change the arithmetic: capped programs (more of
    # them resident on an SM) give the uncapped result bit for bit, decode and verify tiles
    q, kv, meta = _mixed_case([1] * 40 + [6] * 12 + [9] * 4, dtype, seed=4)
    want, want_lse = paged_attention(q, kv, meta, 0.125, return_lse=True)
    capped = AttentionConfig(max_registers=96, mid_max_registers=128, wide_max_registers=168)
    out, lse = paged_attention(q, kv, meta, 0.125, return_lse=True, config=capped)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("first", [1200, 256], ids=["inside-a-page", "row-one-page-longer"])
def test_deterministic_config_gives_a_query_the_same_bits_in_any_row(first):
    # attention_config.DETERMINISTIC: one 64-row tile for every row, KV chunks of a fixed page
    # count cut from token 0: a query at position p gets the same output as a decode row alone
    # as the j-th query of a verify row (its later keys masked) beside another long row (issue
    # 18). row-one-page-longer: the row's last keys open a 17th page that its first query does
    # not see, where chunks balanced over the row (8 pages -> 3 chunks of 6) would cut that
    # query's keys otherwise than its 16 pages alone (2 chunks of 8). The default config splits
    # each row by what the whole step fills, and rounds otherwise.
    from dataclasses import replace

    from aspire_ray.kernels.attention_config import DETERMINISTIC

    det = replace(DEFAULT_CONFIG, **{**DETERMINISTIC, "kv_chunk_pages": 8})
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 4, 2, 32, 16
    kv = torch.randn(200, 2, ps, hkv, d, generator=gen).to(DEVICE)
    q = torch.randn(6, hq, d, generator=gen).to(DEVICE)  # the verify row's queries
    pages, other = list(range(3, 83)), list(range(100, 180))
    last = first + 5
    step = PagedKVMeta.build([6, 1], [pages[: -(-last // ps)], other], [last, 1280], ps,
                             device=DEVICE)  # fmt: skip
    q_step = torch.cat([q, torch.randn(1, hq, d, generator=gen).to(DEVICE)])
    balanced = replace(det, balanced_chunks=True)
    same = {}
    for name, cfg in (("deterministic", det), ("default", DEFAULT_CONFIG),
                      ("balanced", balanced)):  # fmt: skip
        out_v = paged_attention(q_step, kv, step, 0.3, config=cfg)
        # Triton's interpreter multiplies a tile with numpy, whose BLAS rounds a row by its
        # place in the block; a GPU's MMA does not: on the CPU the first query only
        for j in range(6) if DEVICE == "cuda" else [0]:  # query j sees first + j keys
            n = first + j
            alone = PagedKVMeta.build([1], [pages[: -(-n // ps)]], [n], ps, device=DEVICE)
            out_1 = paged_attention(q[j : j + 1], kv, alone, 0.3, config=cfg)
            same[name, j] = torch.equal(out_1[0], out_v[j])
    assert all(v for (name, _), v in same.items() if name == "deterministic"), same
    # (the default leaves 16 pages unsplit: it is blind there; balanced chunks are not)
    blind = "default" if first == 1200 else "balanced"
    assert not same[blind, 0], f"{blind} chunks should round otherwise (test is blind)"


def test_a_128_row_query_tile_holds_a_long_verify_row():
    # bench variant m128 (block_m_max 128): a row of 17 queries of 7-head groups (Qwen2.5's)
    # fits one query tile of 126 rows, so it reads its KV once (64 rows: 9 queries a tile, two
    # reads), and its output and lse are the reference's, split or not
    cfg = AttentionConfig(block_m_max=128)
    assert query_tile_tokens(cfg, 7) == 18 and query_tile_tokens(DEFAULT_CONFIG, 7) == 9
    q, kv, meta = make_case([17, 1, 13, 1], [700, 300, 410, 90], (14, 2, 64), torch.float32)
    for config in (cfg, replace(cfg, kv_chunk_pages=3)):
        check(q, kv, meta, torch.float32, config)
    plan = _plan(meta, 7, 2, cfg)
    work = torch.cat([launch.work.cpu() for launch in plan.launches], dim=1)
    mine = work[:, work[0] == 0]
    assert int((mine[3] - mine[2]).sum()) == 700  # the 17-query row's KV, read once
