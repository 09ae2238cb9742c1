"""scripts/bench_split_kv.py --plans: the FixedPlans it loads (as the asynchronous graphs and
the rounds' graphs plan their steps) attend as the host plan does (CPU, Triton's interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import scripts_imported
from test_paged_attention import make_case

from aspire_ray.kernels.attention_config import AttentionConfig


def test_fixed_plans_attend_as_the_host_plan():
    cfg = AttentionConfig(block_n=16, kv_chunk_pages=2)  # split rows, small tiles
    a = SimpleNamespace(q_heads=6, kv_heads=2, head_dim=64, page_size=16)
    with scripts_imported("bench_split_kv") as (bs,):
        from aspire_ray.kernels.paged_attention import paged_attention

        for q_lens, kv_lens in (([1, 1, 1], [40, 90, 17]), ([4, 1, 1], [70, 90, 33])):
            q, kv, meta = make_case(q_lens, kv_lens, (6, 2, 64), torch.float32)
            pages = int(meta.kv_indptr[-1])
            want = paged_attention(q, kv, meta, 0.125, config=cfg)
            assert bs.fixed_plan("host", meta, q_lens, pages, a, cfg) is None
            kinds = ["rows", "decode"] if len(set(q_lens)) == 1 else ["rows"]
            if len(kinds) == 1:  # ragged rows: no decode plan holds them
                assert bs.fixed_plan("decode", meta, q_lens, pages, a, cfg) is False
            for kind in kinds:
                fixed = bs.fixed_plan(kind, meta, q_lens, pages, a, cfg)()
                assert fixed.fixed_plan is not None
                got = paged_attention(q, kv, fixed, 0.125, config=cfg)
                torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
