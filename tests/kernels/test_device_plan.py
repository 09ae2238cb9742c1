"""Work lists planned on the device (``device_plan``, CUDA-graph draft steps) equal the host
plans item for item, so the attention splits and merges in the same order; padding rows (no
page) get no work. The fixed plan they load runs the attention as the host plan does."""

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import paged_case

from aspire_ray.kernels.attention_config import AttentionConfig
from aspire_ray.kernels.device_plan import (
    attention_items,
    decode_attention_items,
    ragged_fixed,
    score_items,
)
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.page_scores import _host_work, page_scores, token_max_probs, work_tokens
from aspire_ray.kernels.paged_attention import (
    FixedPlan,
    _host_plan,
    _num_sms,
    block_ms_for,
    paged_attention,
)

PS = 16
# The kernels on these tests' CPU tensors (their plans sized by the CPU's 4 "SMs"): Triton's
# interpreter only. A GPU host runs them on the device in tests/test_gpu_engine.py's engines.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="interpreter tests: their tensors are on the CPU")
# default: the wave-fitted chunk; small-chunks: the same with chunks down to a page (fewer
# slots, so the tests' rows span several waves); waves-rule: the older chunk, total pages over
# waves x SMs; fixed-chunks: a fixed chunk; cut-chunks: a fixed chunk cut from token 0 (the
# deterministic mode's), not balanced over the row
CONFIGS = [AttentionConfig(), AttentionConfig(min_chunk_pages=1, waves=2.0, resident_programs=1),
           AttentionConfig(min_chunk_pages=1, waves=2.0, resident_programs=None),
           AttentionConfig(kv_chunk_pages=3),
           AttentionConfig(kv_chunk_pages=3, balanced_chunks=False)]  # fmt: skip
IDS = ["default", "small-chunks", "waves-rule", "fixed-chunks", "cut-chunks"]


def _meta(pages: list[int], lasts: list[int], q: int = 1) -> PagedKVMeta:
    """Rows of q queries; rows of 0 pages are padding (they exist on the device only)."""
    live = [p for p in pages if p]
    meta = PagedKVMeta.build([q] * len(live), [list(range(p)) for p in live],
                             [(p - 1) * PS + la for p, la in zip(live, lasts, strict=False)],
                             PS)  # fmt: skip
    return meta


def test_ragged_fixed():
    row, local, total = ragged_fixed(torch.tensor([2, 0, 3]), 7)
    assert total.tolist() == [5]
    assert row[:5].tolist() == [0, 0, 2, 2, 2] and local[:5].tolist() == [0, 1, 0, 1, 2]
    assert (local[5:] >= 3).all()  # past the total: outside the last row


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("pages", [[1, 40, 3, 200], [65, 64, 1], [300], [5, 9, 2, 33, 70, 1]])
@pytest.mark.parametrize("q", [1, 6, 20])  # decode rows; verify rows; two query tiles a row
def test_attention_items_equal_the_host_plan(cfg, pages, q):
    pages = [max(p, -(-q // PS) + 1) for p in pages] if q > 1 else pages  # KV >= its queries
    rng = np.random.default_rng(len(pages))
    lasts = rng.integers(1, PS + 1, len(pages)).tolist()
    meta = _meta(pages, lasts, q)
    group, hkv = 4, 2
    host = _host_plan(meta, group, hkv, cfg, torch.device("cpu"))
    (items_host,) = host.items.values()
    # the same rows with two padding rows (no page) behind them
    indptr = torch.tensor(meta.kv_indptr_host + [meta.kv_indptr_host[-1]] * 2)
    last = torch.tensor(lasts + [1, 1])
    cap = items_host.shape[1] + 5
    items, count, merge, n_merge = decode_attention_items(indptr, last, PS, group, hkv, cfg,
                                                          _num_sms(torch.device("cpu")), cap, q)
    assert count.item() == items_host.shape[1]
    assert np.array_equal(items[:, : count.item()].numpy(), items_host)
    assert n_merge.item() == host.merge.shape[1]
    assert np.array_equal(merge[:, : n_merge.item()].numpy(), host.merge)
    assert host.part_rows <= (items_host[4] >= 0).sum() * q  # the fixed plans' bound


def test_score_items_equal_the_host_work():
    meta = _meta([3, 1, 17], [5, 16, 1])
    host = _host_work(meta)
    indptr = torch.tensor(meta.kv_indptr_host + [meta.kv_indptr_host[-1]])
    work, count = score_items(indptr, PS, work_tokens(PS), host.shape[1] + 3)
    assert count.item() == host.shape[1]
    assert np.array_equal(work[:, : count.item()].numpy(), host)


@pytest.mark.parametrize("cfg", CONFIGS[1:], ids=IDS[1:])
@pytest.mark.parametrize("n_q", [1, 3])  # decode rows; verify rows (gamma 2)
def test_fixed_plan_loaded_on_the_device_runs_as_the_host_plan(cfg, n_q):
    heads = (8, 2, 64)
    q, kv, meta = paged_case([n_q] * 3, [700, 33, 260], heads, torch.float32, "cpu", PS, True, 3)
    expected, lse_expected = paged_attention(q, kv, meta, 0.125, return_lse=True, config=cfg)
    rows = meta.num_rows + 1  # and one padding row
    plan = FixedPlan.for_decode(rows, kv.shape[0], heads[0], heads[1], heads[2],
                                torch.device("cpu"), cfg, q=n_q)  # fmt: skip
    indptr = torch.cat([meta.kv_indptr, meta.kv_indptr[-1:]])
    last = torch.cat([meta.kv_last_page_len, torch.ones(1, dtype=torch.int32)])
    plan.load_decode(indptr, last, PS, n_q)
    qo = torch.arange(rows + 1, dtype=torch.int32) * n_q
    fixed = PagedKVMeta(qo, indptr.int(), meta.kv_indices, last.int(), PS, fixed_plan=plan)
    q_pad = torch.cat([q, torch.zeros_like(q[:n_q])])
    out, lse = paged_attention(q_pad, kv, fixed, 0.125, return_lse=True, config=cfg)
    assert torch.equal(out[:-n_q], expected) and torch.equal(lse[:-n_q], lse_expected)
    if n_q > 1:
        return  # page scores are a draft row's (one query)
    work = score_items(fixed.kv_indptr, PS, work_tokens(PS), 64)
    work = (work[0].int(), work[1].int())
    scores = token_max_probs(q_pad, lse, kv, fixed, 0.125, work=work)
    nnz = meta.kv_indices.shape[0]
    assert torch.equal(scores[:nnz], token_max_probs(q, lse_expected, kv, meta, 0.125))
    sums = page_scores(q_pad, lse, kv, fixed, 0.125, work=work)
    assert torch.equal(sums[:nnz], page_scores(q, lse_expected, kv, meta, 0.125))


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("n_q", [[1, 6, 1, 3, 1], [2, 1, 1, 17], [1]])  # a mixed step's rows
def test_ragged_rows_equal_the_host_plan(cfg, n_q):
    """Draft rows (one query) and verify rows (d + 1) of one step: every launch's items and
    the merge, item for item the host plan's, with a padding row (no page, no query) behind."""
    pages = [40, 3, 200, 9, 65][: len(n_q)]
    lasts = np.random.default_rng(len(n_q)).integers(1, PS + 1, len(n_q)).tolist()
    meta = PagedKVMeta.build(n_q, [list(range(p)) for p in pages],
                             [(p - 1) * PS + la for p, la in zip(pages, lasts, strict=True)], PS)
    group, hkv = 4, 2
    host = _host_plan(meta, group, hkv, cfg, torch.device("cpu"))
    cfg_bms = block_ms_for(17, group, cfg)
    indptr = torch.tensor(meta.kv_indptr_host + [meta.kv_indptr_host[-1]])
    last = torch.tensor(lasts + [1])
    *launches, (merge, n_merge) = attention_items(
        indptr, last, torch.tensor(n_q + [0]), PS, group, hkv, cfg,
        _num_sms(torch.device("cpu")), cfg_bms, 512, 64)
    for bm, (items, count) in zip(cfg_bms, launches, strict=True):
        expected = host.items.get(bm, np.zeros((6, 0), np.int64))
        assert count.item() == expected.shape[1]
        assert np.array_equal(items[:, : count.item()].numpy(), expected)
    assert n_merge.item() == host.merge.shape[1]
    assert np.array_equal(merge[:, : n_merge.item()].numpy(), host.merge)


@pytest.mark.parametrize("cfg", CONFIGS[1:], ids=IDS[1:])
def test_fixed_plan_of_ragged_rows_runs_as_the_host_plan(cfg):
    heads, n_q = (8, 2, 64), [1, 4, 1, 2]
    q, kv, meta = paged_case(n_q, [700, 33, 260, 90], heads, torch.float32, "cpu", PS, True, 5)
    expected, lse_expected = paged_attention(q, kv, meta, 0.125, return_lse=True, config=cfg)
    plan = FixedPlan.for_rows(5, 16, 5, kv.shape[0], *heads, torch.device("cpu"), cfg)
    indptr = torch.cat([meta.kv_indptr, meta.kv_indptr[-1:]])  # and one padding row
    last = torch.cat([meta.kv_last_page_len, torch.ones(1, dtype=torch.int32)])
    plan.load_rows(indptr, last, torch.tensor(n_q + [0]), PS)
    qo = torch.cat([meta.qo_indptr, meta.qo_indptr[-1:]])
    fixed = PagedKVMeta(qo, indptr.int(), meta.kv_indices, last.int(), PS, fixed_plan=plan)
    q_pad = torch.cat([q, torch.zeros_like(q[:3])])  # the token bucket's padding
    out, lse = paged_attention(q_pad, kv, fixed, 0.125, return_lse=True, config=cfg)
    assert torch.equal(out[: q.shape[0]], expected)
    assert torch.equal(lse[: q.shape[0]], lse_expected)


@functools.cache
def _wide_tiles_step(cfg: AttentionConfig) -> tuple:
    """The mixed step of test_wide_tiles_... (q, kv, meta) and its output by the host plan,
    once a config: the host plan never reads ``mixed_one_launch`` (only a fixed plan's wide
    tiles do), so both launch layouts compare with the one output, computed once."""
    q, kv, meta = paged_case([1, 4, 1, 2, 7], [700, 33, 260, 90, 120], (8, 2, 64),
                             torch.float32, "cpu", PS, True, 6)  # fmt: skip
    return q, kv, meta, paged_attention(q, kv, meta, 0.125, config=cfg)


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("cfg", CONFIGS[1:], ids=IDS[1:])
def test_wide_tiles_put_every_verify_row_in_one_launch(cfg, one_launch):
    """A mixed step's verify rows in the widest tile's launch, and its draft rows with them
    (``mixed_one_launch``) or in their own; a step of draft rows only keeps their tile: the
    same output as the host plan's per-row tiles (fp32)."""
    q, kv, meta, expected = _wide_tiles_step(cfg)
    cfg = replace(cfg, mixed_one_launch=one_launch)
    heads, n_q = (8, 2, 64), [1, 4, 1, 2, 7]
    plan = FixedPlan.for_rows(5, 16, 7, kv.shape[0], *heads, torch.device("cpu"), cfg,
                              wide_tiles=True)  # fmt: skip
    assert len(plan.plan.launches) == 2  # draft rows' tile and the widest

    def rows_per_launch(n_q):
        plan.load_rows(meta.kv_indptr, meta.kv_last_page_len, torch.tensor(n_q), PS)
        return [set(launch.work[0, : launch.count.item()].tolist())
                for launch in plan.plan.launches]  # fmt: skip

    assert rows_per_launch([1] * 5) == [set(range(5)), set()]
    assert rows_per_launch(n_q) == ([set(), set(range(5))] if one_launch
                                    else [{0, 2}, {1, 3, 4}])  # fmt: skip
    fixed = PagedKVMeta(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                        PS, fixed_plan=plan)  # fmt: skip
    torch.testing.assert_close(paged_attention(q, kv, fixed, 0.125, config=cfg), expected,
                               rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("n_q", [[1, 4, 1, 2, 7], [1] * 5], ids=["mixed", "draft-rows"])
def test_a_wide_only_plan_runs_any_step_in_one_launch(n_q):
    """``for_rows(wide_only=True)``: one launch of the widest tile (an asynchronous graph of
    more queries than rows, where ``mixed_one_launch`` puts every row there), and a step of
    rows of one query alone, planned in their own tile, gives the host plan's output in it."""
    cfg = CONFIGS[1]
    q, kv, meta = paged_case(n_q, [700, 33, 260, 90, 120], (8, 2, 64), torch.float32, "cpu",
                             PS, True, 6)  # fmt: skip
    expected = paged_attention(q, kv, meta, 0.125, config=cfg)
    plan = FixedPlan.for_rows(5, 16, 7, kv.shape[0], 8, 2, 64, torch.device("cpu"), cfg,
                              wide_only=True)  # fmt: skip
    assert [launch.block_m for launch in plan.plan.launches] == [32]  # 7 queries x 4 heads
    plan.load_rows(meta.kv_indptr, meta.kv_last_page_len, torch.tensor(n_q), PS)
    assert set(plan.plan.launches[0].work[0, : plan.plan.launches[0].count.item()].tolist()) \
        == set(range(5))  # fmt: skip
    fixed = PagedKVMeta(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                        PS, fixed_plan=plan)  # fmt: skip
    torch.testing.assert_close(paged_attention(q, kv, fixed, 0.125, config=cfg), expected,
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def _loaded(plan: FixedPlan, fused: bool, load) -> list[tuple[int, np.ndarray]]:
    """Every launch's and the merge's (count, work) after ``load(plan)``."""
    plan.clear()
    plan.fused_planning = fused
    load(plan)
    return [(launch.count.item(), launch.work[:, : launch.count.item()].numpy().copy())
            for launch in [*plan.plan.launches, plan.plan.merge]]  # fmt: skip


def _same(a, b) -> bool:
    return all(ca == cb and np.array_equal(wa, wb) for (ca, wa), (cb, wb) in zip(a, b, strict=True))


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("wide", [False, True, "two"], ids=["tiles", "wide", "wide-two"])
@pytest.mark.parametrize("n_q", [[1, 6, 1, 3, 1], [2, 1, 1, 17], [1]])
def test_fused_planning_writes_the_tensor_ops_lists(cfg, wide, n_q):
    """``plan_kernel.plan_into`` (one launch) fills a fixed plan exactly as
    ``attention_items``' tensor ops do, for ragged rows and a padding row; wide tiles with a
    mixed step's rows in one launch or ("two") its draft rows in their own."""
    if wide == "two":
        cfg, wide = replace(cfg, mixed_one_launch=False), True
    pages = [40, 3, 200, 9, 65][: len(n_q)]
    lasts = np.random.default_rng(len(n_q)).integers(1, PS + 1, len(n_q)).tolist()
    indptr = torch.tensor([0, *np.cumsum(pages).tolist(), sum(pages)], dtype=torch.int32)
    last, nq = torch.tensor([*lasts, 1], dtype=torch.int32), torch.tensor([*n_q, 0])
    plan = FixedPlan.for_rows(len(n_q) + 1, 64, 17, 400, 8, 2, 64, torch.device("cpu"), cfg,
                              wide_tiles=wide)  # fmt: skip
    assert plan.fused_planning
    load = lambda p: p.load_rows(indptr, last, nq, PS)  # noqa: E731
    fused, ops = _loaded(plan, True, load), _loaded(plan, False, load)
    assert sum(count for count, _ in fused[:-1]) > 0
    assert _same(fused, ops)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("q", [1, 6, 20])
def test_fused_planning_of_decode_rows(cfg, q):
    pages = [max(p, -(-q // PS) + 1) for p in [1, 40, 3, 200]]
    indptr = torch.tensor([0, *np.cumsum(pages).tolist(), sum(pages)], dtype=torch.int32)
    last = torch.tensor([3, 16, 1, 9, 1], dtype=torch.int32)
    plan = FixedPlan.for_decode(5, sum(pages), 8, 2, 64, torch.device("cpu"), cfg, q=q)
    load = lambda p: p.load_decode(indptr, last, PS, q)  # noqa: E731
    assert _same(_loaded(plan, True, load), _loaded(plan, False, load))


def test_fused_planning_only_where_exact():
    from aspire_ray.kernels.plan_kernel import fused_planning_fits

    assert fused_planning_fits(AttentionConfig(waves=2.0), 4, [16, 64])
    older = AttentionConfig(waves=2.5, resident_programs=None)  # the older rule: a float ceil
    assert not fused_planning_fits(older, 3, [16])  # (7.5)
    assert fused_planning_fits(AttentionConfig(waves=2.5), 3, [16])  # wave-fitted: integers
    assert fused_planning_fits(AttentionConfig(waves=2.5, kv_chunk_pages=4), 3, [16])


@pytest.mark.parametrize("rows", [
    [2000] * 10,  # a mixed step's verify rows alone
    [2000] * 10 + [140] * 54,  # ... and its draft rows (sparse lists) beside them
    [2000] * 64,  # an ar step, a synchronized round's verification
    [140] * 64,  # a draft step
])  # fmt: skip
def test_wave_fitted_chunks_fill_whole_waves(rows):
    # H200-sized: 132 SMs x 3 resident programs = 396 slots, 2 kv heads (Qwen2.5-Coder-0.5B
    # at 32k tokens). The older rule cut such steps into 2-3 waves of short chunks, the last
    # wave part empty and every program paying its start; the wave-fitted chunk fills one
    # wave (nearly: a chunk cuts the longest row into whole parts) with the longest chunks.
    from aspire_ray.kernels.paged_attention import _fit_chunk

    cfg, sms, hkv = AttentionConfig(), 132, 2
    n = np.array(rows, dtype=np.int64)
    chunk = _fit_chunk(n, np.ones_like(n), n > 0, hkv, cfg, sms)
    programs = int((-(-n // chunk)).sum()) * hkv
    slots = cfg.resident_programs * sms
    assert 0.9 * slots <= programs <= slots, (chunk, programs)
    old = replace(cfg, resident_programs=None)
    old_chunk = max(old.min_chunk_pages, -(-int(n.sum()) * hkv // int(old.waves * sms)))
    old_programs = int((-(-n // old_chunk)).sum()) * hkv
    assert old_programs > 2 * slots if len(rows) != 64 or rows[0] != 140 else old_programs > slots


@pytest.mark.parametrize("rows", [70, 140])
def test_fused_planning_of_many_rows_fits_the_host_chunk(rows):
    """Past 64 rows the plan kernel tries the wave fit's k a group at a time
    (``plan_kernel._fit_group``): the chunk, and so every list, is still the host's, on rows
    whose page counts give ties and a spread bound that binds."""
    cfg = CONFIGS[1]  # small chunks: many k differ in cost
    rng = np.random.default_rng(rows)
    pages = rng.choice([1, 2, 7, 16, 33, 64, 150], size=rows).tolist()
    n_q = rng.choice([1, 1, 1, 6], size=rows).tolist()
    indptr = torch.tensor([0, *np.cumsum(pages).tolist()], dtype=torch.int32)
    last = torch.tensor(rng.integers(1, PS + 1, rows).tolist(), dtype=torch.int32)
    plan = FixedPlan.for_rows(rows, 64, 64, sum(pages), 8, 2, 64, torch.device("cpu"), cfg,
                              wide_tiles=True)  # fmt: skip
    assert plan.fused_planning
    load = lambda p: p.load_rows(indptr, last, torch.tensor(n_q), PS)  # noqa: E731
    fused, ops = _loaded(plan, True, load), _loaded(plan, False, load)
    assert sum(count for count, _ in fused[:-1]) > 0
    assert _same(fused, ops)


@pytest.mark.parametrize("group", [None, 1, 2])
def test_the_wave_fit_keeps_the_longest_chunk_on_a_tie(group, monkeypatch):
    """Rows of 12, 95 and 76 pages on the CPU's 4 "SMs": k = 2 (48 pages) and k = 3 (32)
    cost the same; the host takes the first. So does the plan kernel, whether the two k are
    tried in one group or in groups of their own (``_fit_group`` forced to 1 or 2)."""
    from aspire_ray.kernels import plan_kernel

    if group is not None:
        monkeypatch.setattr(plan_kernel, "_fit_group", lambda rows: group)
    pages = [12, 95, 76]
    indptr = torch.tensor([0, *np.cumsum(pages).tolist()], dtype=torch.int32)
    last, n_q = torch.tensor([5, 16, 2], dtype=torch.int32), torch.tensor([1, 1, 1])
    plan = FixedPlan.for_rows(3, 16, 16, sum(pages), 8, 2, 64, torch.device("cpu"), CONFIGS[1],
                              wide_tiles=True)  # fmt: skip
    load = lambda p: p.load_rows(indptr, last, n_q, PS)  # noqa: E731
    fused, ops = _loaded(plan, True, load), _loaded(plan, False, load)
    assert fused[0][0] == 1 + 2 + 2  # 48-page chunks (32: 1 + 3 + 3 items)
    assert _same(fused, ops)


@pytest.mark.parametrize("ramp,chunk,programs", [(16, 72, 1140), (32, 250, 366), (48, 250, 366)])
def test_a_mixed_steps_chunk_follows_the_programs_fixed_cost(ramp, chunk, programs):
    # docs/benchmarks.md §8.54: `aspire`'s mixed step at 32k x 64 on an H100 (132 SMs x 3
    # resident programs, 2 kv heads): 17 verify rows of 2,000 pages beside 47 draft rows of
    # 140. Priced at ramp_pages 16 the fit cuts it into ~2.9 waves of 72-page chunks (a
    # program's fixed cost 22% of its chunk); at 32 or more, one wave of 250-page chunks.
    # Which is faster is the GPU's question (bench variants rp32, rp48).
    from aspire_ray.kernels.paged_attention import _fit_chunk

    cfg, sms, hkv = AttentionConfig(ramp_pages=ramp), 132, 2
    n = np.array([2000] * 17 + [140] * 47, dtype=np.int64)
    got = _fit_chunk(n, np.ones_like(n), n > 0, hkv, cfg, sms)
    assert got == chunk
    assert int((-(-n // got)).sum()) * hkv == programs
