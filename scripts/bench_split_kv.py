"""Split-KV and tile choices for the attention of a decode step's rows, as a CUDA graph replays
them: one graph of ``--layers`` attention calls (each layer its own KV pool, as a model's), so
launch gaps and the split-KV merge count as they do in a step.

Shapes: ``--batch`` rows over sparse lists of k pages (draft rows: k = the sparse budget of a
``--context`` row), over full lists (``ar`` and verify rows, ``--q-lens``), and mixed steps
(``--mixed``: that many verify rows of ``--mixed-q`` queries over full lists, the rest draft
rows; two launches, one per query tile, as an asynchronous run's step). Per config: GPU
time per layer (median of graph replays, CUDA events), KV GB/s and its fraction of the copy
bandwidth measured in the same run.

``--plans``: how the work lists are made. ``host``: planned on the host per step (eager
steps); ``rows``: a ``FixedPlan.for_rows`` of wide tiles loaded on the device once a step, as
``aspire``'s asynchronous graphs plan every step (draft-only steps too); ``decode``: a
``FixedPlan.for_decode`` for rows of one query count, as the rounds' draft and verify graphs.
A step's rows under ``rows`` against ``decode`` is what a mixed graph pays for its plan.

    python scripts/bench_split_kv.py --batch 64 --context 32000 --out split_kv.json
    python scripts/bench_split_kv.py --q-lens 9 --mixed 8,16 --mixed-q 8 --variants default \
        --plans decode,rows
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, replace

import torch
from bench_kernels import Timer, copy_bandwidth

from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.paged_attention import DEFAULT_CONFIG, FixedPlan, paged_attention

VARIANTS = {  # name -> AttentionConfig overrides
    "default": {},
    # the last split program of a query tile merges it in the attention launch (one launch
    # fewer a call; AttentionConfig.fused_merge, the default), or a merge launch of its own
    "fusedmerge": {"fused_merge": True},
    "sepmerge": {"fused_merge": False},
    "chunk8": {"min_chunk_pages": 8},
    "chunk16": {"min_chunk_pages": 16},
    "chunk64": {"min_chunk_pages": 64},
    # the wave fit's fixed cost of a program (AttentionConfig.ramp_pages, 16): a mixed step of
    # 17 verify rows at 32k beside 47 draft rows is cut into 72-page chunks at 16, one wave of
    # 250-page chunks at 32 or more (docs/benchmarks.md §8.54)
    "ramp32": {"ramp_pages": 32},
    "ramp48": {"ramp_pages": 48},
    "unsplit": {"kv_chunk_pages": 1 << 30},
    "waves2": {"waves": 2.0},
    "waves4": {"waves": 4.0},
    "waves16": {"waves": 16.0},
    "block_n64": {"block_n": 64},
    "stages2": {"num_stages": 2},
    "stages4": {"num_stages": 4},
    "warps2": {"num_warps": 2},
    "warps8": {"num_warps": 8},
    # rows of several queries in 16- or 32-row tiles: fewer padded rows than one 64-row tile,
    # but each tile reads the chunk again (on the H200 L2 does not serve the repeats: §8.20)
    "m16": {"block_m_max": 16},
    "m32": {"block_m_max": 32},
    # every row in a tile of at least 32 / 64 query rows (a 6-query row of 3-head groups, 18
    # rows, takes 32 by default)
    "min32": {"block_m_min": 32},
    "min64": {"block_m_min": 64},
    "m16_n64": {"block_m_max": 16, "block_n": 64},
    "m32_n64": {"block_m_max": 32, "block_n": 64},
    # the split-KV merge (13 us a layer of a real mixed step: docs/benchmarks.md §8.21)
    "merge_h1": {"merge_head_block": 1},
    "merge_h2": {"merge_head_block": 2},
    "merge_s64": {"merge_split_block": 64},
    "merge_h2_s32": {"merge_head_block": 2, "merge_split_block": 32},
    "merge_h16_s8": {"merge_head_block": 16, "merge_split_block": 8},
    # a mixed step's two launches one after another instead of side by side
    "serial": {"concurrent_launches": False},
    # register caps: more programs resident on an SM (AttentionConfig.max_registers)
    "regs128": {"max_registers": 128},
    "regs96": {"max_registers": 96},
    "wide168": {"wide_max_registers": 168},
    "regs96_wide168": {"max_registers": 96, "wide_max_registers": 168},
    "nowide": {"wide_max_registers": None},
    "mid128": {"mid_max_registers": 128},  # 32-row tiles capped (AttentionConfig)
    "mid168": {"mid_max_registers": 168},  # the compiler's registers for verify tiles too
}


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def graph_ms(fn, reps: int) -> float:
    """Median time of one replay of fn captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # the plans are built (and cached on their metadata) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fixed_plan(kind: str, meta: PagedKVMeta, q_lens: list[int], pages: int, a, cfg):
    """``--plans``: None for the host plan; else a function that loads a FixedPlan of this
    kind from the device metadata and returns the metadata that carries it; False where the
    kind cannot hold these rows (``decode``: rows of one query count)."""
    if kind == "host":
        return None
    if kind not in ("rows", "decode"):
        raise SystemExit(f"--plans: unknown plan kind {kind!r} (host, rows, decode)")
    rows, dev = len(q_lens), meta.kv_indptr.device
    n_q = torch.tensor(q_lens, dtype=torch.int64, device=dev)
    if kind == "rows":
        plan = FixedPlan.for_rows(rows, sum(q_lens), max(q_lens), pages, a.q_heads, a.kv_heads,
                                  a.head_dim, dev, cfg, wide_tiles=True)  # fmt: skip

        def load_plan():
            plan.load_rows(meta.kv_indptr, meta.kv_last_page_len, n_q, a.page_size)
    elif len(set(q_lens)) > 1:
        return False
    else:
        plan = FixedPlan.for_decode(rows, pages, a.q_heads, a.kv_heads, a.head_dim, dev, cfg,
                                    q=q_lens[0])  # fmt: skip

        def load_plan():
            plan.load_decode(meta.kv_indptr, meta.kv_last_page_len, a.page_size, q_lens[0])

    def load() -> PagedKVMeta:
        load_plan()
        return PagedKVMeta(meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                           meta.kv_last_page_len, a.page_size, fixed_plan=plan)

    return load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=32000)
    p.add_argument("--rho", type=float, default=0.07, help="sparse fraction of a row's pages")
    p.add_argument("--q-heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--q-lens", type=ints, default=[1, 6], help="full rows' query counts")
    p.add_argument("--mixed", type=ints, default=[], help="verify rows of mixed steps")
    p.add_argument("--mixed-q", type=int, default=5, help="a mixed step's verify queries")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--plans", default="host", help="comma list of host, rows, decode")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    copy_gbps = copy_bandwidth(Timer(5))
    full_pages = -(-a.context // a.page_size)
    sparse_pages = max(32, math.ceil(a.rho * full_pages))
    # (kind, each row's (queries, pages)): its first rows' queries, then the rest's
    shapes = [("draft", [(1, sparse_pages)] * a.batch)]
    shapes += [(f"full_q{q}", [(q, full_pages)] * a.batch) for q in a.q_lens]
    shapes += [(f"mixed_v{v}_q{a.mixed_q}",
                [(a.mixed_q, full_pages)] * v + [(1, sparse_pages)] * (a.batch - v))
               for v in a.mixed]  # fmt: skip
    results = []
    for kind, rows in shapes:
        q_lens, n_pages = [r[0] for r in rows], [r[1] for r in rows]
        total = sum(n_pages)
        pools = [torch.randn(total, 2, a.page_size, a.kv_heads, a.head_dim,
                             dtype=torch.bfloat16, device="cuda")
                 for _ in range(a.layers)]  # fmt: skip
        order = torch.randperm(total, generator=gen).tolist()
        starts = [sum(n_pages[:i]) for i in range(len(rows))]
        pages = [order[s:s + n] for s, n in zip(starts, n_pages, strict=True)]
        q = torch.randn(sum(q_lens), a.q_heads, a.head_dim, dtype=torch.bfloat16,
                        device="cuda")  # fmt: skip
        kv_bytes = total * a.page_size * 2 * a.kv_heads * a.head_dim * 2
        q_len, n = max(q_lens), max(n_pages)
        for name, plan_kind in [(v, k) for v in a.variants.split(",")
                                for k in a.plans.split(",")]:  # fmt: skip
            cfg = replace(DEFAULT_CONFIG, **VARIANTS[name])
            meta = PagedKVMeta.build(q_lens, pages, [m * a.page_size for m in n_pages],
                                     a.page_size, "cuda")  # fmt: skip
            load = fixed_plan(plan_kind, meta, q_lens, total, a, cfg)
            if load is False:
                continue  # a decode plan holds rows of one query count only

            def step(meta=meta, cfg=cfg, pools=pools, q=q, load=load):
                if load is not None:
                    meta = load()  # once a step, as a self-planning graph loads its plan
                for pool in pools:
                    paged_attention(q, pool, meta, a.head_dim**-0.5, config=cfg)

            ms = graph_ms(step, a.reps) / a.layers
            gbps = kv_bytes / ms / 1e6
            results.append({"kind": kind, "q_len": q_len, "pages": n, "variant": name,
                            "plan": plan_kind, "config": asdict(cfg), "us_per_layer": ms * 1e3,
                            "kv_gbps": gbps, "of_copy": gbps / copy_gbps})  # fmt: skip
            print(f"{kind:8s} {name:10s} {plan_kind:6s} {ms * 1e3:7.1f} us/layer  {gbps:6.0f} "
                  f"GB/s ({gbps / copy_gbps:4.0%} of copy)")  # fmt: skip
        del pools
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps, "batch": a.batch,
              "context": a.context, "sparse_pages": sparse_pages, "layers": a.layers,
              "heads": [a.q_heads, a.kv_heads, a.head_dim], "page_size": a.page_size,
              "results": results}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
