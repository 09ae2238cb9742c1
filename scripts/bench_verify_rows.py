"""Paged attention of verify rows (q_len > 1) against decode rows (q_len = 1), same KV bytes.

A verify row of d + 1 queries reads the same KV as a decode row: a kernel that loads each KV
tile once for all of a row's queries and all q heads of a kv head (q_len x GQA packing) costs
about what a decode row costs (issue 14 item 4). Per q_len: GPU time (median, CUDA events, L2
flushed), achieved KV bandwidth, and the ratio to q_len 1; optionally for a few tile configs.

    python scripts/bench_verify_rows.py --batch 64 --context 32000 --q-heads 14 --kv-heads 2 \
        --head-dim 64 --q-lens 1,2,4,6,8 --out verify_rows.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import torch
from bench_kernels import Timer, add_row_shape_args, copy_bandwidth

from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.paged_attention import DEFAULT_CONFIG, paged_attention

VARIANTS = {  # name -> AttentionConfig overrides tried beside the default
    "default": {},
    "warps8": {"num_warps": 8},
    "stages2": {"num_stages": 2},
    "stages4": {"num_stages": 4},
    "block_n64": {"block_n": 64},
    "block_m32max": {"block_m_max": 32},
    # the KV split: chunks of a fixed size, or another program target (few rows: issue 15)
    "chunk16": {"kv_chunk_pages": 16},
    "chunk32": {"kv_chunk_pages": 32},
    "chunk64": {"kv_chunk_pages": 64},
    "chunk128": {"kv_chunk_pages": 128},
    "chunk256": {"kv_chunk_pages": 256},
    "oldsplit": {"resident_programs": None},  # the older chunk rule (waves x SMs programs)
    "ramp8": {"ramp_pages": 8},  # the wave-fitted rule's parameters
    "ramp32": {"ramp_pages": 32},
    "res2": {"resident_programs": 2},
    "res4": {"resident_programs": 4},
    "waves3": {"waves": 3.0, "resident_programs": None},
    "waves4": {"waves": 4.0, "resident_programs": None},
    "waves6": {"waves": 6.0, "resident_programs": None},
    "waves16": {"waves": 16.0, "resident_programs": None},
    "waves32": {"waves": 32.0, "resident_programs": None},
    # a mixed call's launches (draft rows' tile, verify rows' tile) one after another, or
    # every row in the verify rows' tile (one launch)
    "seqattn": {"concurrent_launches": False},
    "onelaunch": {"block_m_min": 64},
}


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def kernel_us(fn, reps: int) -> dict[str, float]:
    """GPU microseconds a call of fn spends in each kernel (torch.profiler, mean of reps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.key.startswith("_"):
            out[e.key] = e.device_time_total / reps
    return out


def mixed_rows_meta(batch: int, q_len: int, a: argparse.Namespace,
                    gen: torch.Generator) -> tuple[PagedKVMeta, int]:  # fmt: skip
    """batch verify rows of q_len queries over a.context tokens, then a.draft_rows rows of one
    query over a.draft_pages pages each (a mixed step's draft rows), on distinct pages.
    Returns the meta and the pages it needs."""
    n = -(-a.context // a.page_size)
    total = batch * n + a.draft_rows * a.draft_pages
    pages = torch.randperm(total, generator=gen).tolist()
    lists = [pages[i * n : (i + 1) * n] for i in range(batch)]
    lists += [pages[batch * n + i * a.draft_pages:batch * n + (i + 1) * a.draft_pages]
              for i in range(a.draft_rows)]  # fmt: skip
    q_lens = [q_len] * batch + [1] * a.draft_rows
    kv_lens = [a.context] * batch + [a.draft_pages * a.page_size] * a.draft_rows
    return PagedKVMeta.build(q_lens, lists, kv_lens, a.page_size, "cuda"), total


def bench_batch(a: argparse.Namespace, batch: int, gen: torch.Generator, timer: Timer,
                bw: float) -> list[dict]:  # fmt: skip
    """Every variant x q_len on batch rows of a.context tokens (with a.draft_rows draft rows
    beside them in the same call); ratios to q_len 1 of a variant."""
    per_token = 2 * a.kv_heads * a.head_dim * 2  # K and V bytes of a token, bf16
    kv_bytes = (batch * a.context + a.draft_rows * a.draft_pages * a.page_size) * per_token
    kv = None
    results = []
    for name in a.variants.split(","):
        cfg = replace(DEFAULT_CONFIG, **VARIANTS[name])
        base = None
        for q_len in a.q_lens:
            meta, n_pages = mixed_rows_meta(batch, q_len, a, gen)
            if kv is None:
                kv = torch.randn(n_pages, 2, a.page_size, a.kv_heads, a.head_dim,
                                 dtype=torch.bfloat16, device="cuda")  # fmt: skip
            q = torch.randn(batch * q_len + a.draft_rows, a.q_heads, a.head_dim,
                            dtype=torch.bfloat16, device="cuda")  # fmt: skip
            fn = lambda q=q, kv=kv, meta=meta, cfg=cfg: paged_attention(q, kv, meta, 0.125,
                                                                        config=cfg)
            ms = timer(fn)
            base = base or ms
            kernels = kernel_us(fn, 10) if a.profile else {}
            results.append({"batch": batch, "draft_rows": a.draft_rows, "variant": name,
                            "q_len": q_len, "ms": ms, "kv_gb_per_s": kv_bytes / ms / 1e6,
                            "vs_q1": ms / base, "floor_ms": kv_bytes / bw / 1e6,
                            "kernel_us": kernels})  # fmt: skip
            r = results[-1]
            split = "  ".join(f"{k} {v:.1f} us" for k, v in kernels.items())
            print(f"{batch:3d} rows {name:9s} q_len {q_len:2d}: {ms:7.3f} ms  "
                  f"{r['kv_gb_per_s']:7.0f} GB/s  {r['vs_q1']:.2f}x q_len 1  "
                  f"(floor {r['floor_ms']:.3f} ms)  {split}", flush=True)  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_row_shape_args(p)
    p.add_argument("--q-lens", type=ints, default=[1, 2, 4, 6, 8])
    p.add_argument("--variants", default="default", help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--batches", type=ints, default=None,
                   help="several row counts (default: --batch): few verify rows as in a mixed step")
    p.add_argument("--draft-rows", type=int, default=0,
                   help="one-query rows added to every call (a mixed step's draft rows)")
    p.add_argument("--draft-pages", type=int, default=128, help="pages of each draft row")
    p.add_argument("--profile", action="store_true", help="also GPU us by kernel (profiler)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    timer = Timer(a.reps)
    bw = copy_bandwidth(timer)
    results = []
    for batch in a.batches or [a.batch]:
        results += bench_batch(a, batch, gen, timer, bw)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "copy_gb_per_s": bw, "config": asdict(DEFAULT_CONFIG),
                       "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
