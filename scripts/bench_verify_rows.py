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
from bench_kernels import Timer, add_row_shape_args, copy_bandwidth, rows_meta

from aspire_ray.kernels.paged_attention import DEFAULT_CONFIG, paged_attention

VARIANTS = {  # name -> AttentionConfig overrides tried beside the default
    "default": {},
    "warps8": {"num_warps": 8},
    "stages2": {"num_stages": 2},
    "stages4": {"num_stages": 4},
    "block_n64": {"block_n": 64},
    "block_m32max": {"block_m_max": 32},
}


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_row_shape_args(p)
    p.add_argument("--q-lens", type=ints, default=[1, 2, 4, 6, 8])
    p.add_argument("--variants", default="default", help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    timer = Timer(a.reps)
    bw = copy_bandwidth(timer)
    n_pages = a.batch * -(-a.context // a.page_size)
    kv = torch.randn(n_pages, 2, a.page_size, a.kv_heads, a.head_dim, dtype=torch.bfloat16,
                     device="cuda")  # fmt: skip
    kv_bytes = a.batch * a.context * 2 * a.kv_heads * a.head_dim * 2
    results = []
    for name in a.variants.split(","):
        cfg = replace(DEFAULT_CONFIG, **VARIANTS[name])
        base = None
        for q_len in a.q_lens:
            meta = rows_meta(a.batch, q_len, a.context, a.page_size, gen)
            q = torch.randn(a.batch * q_len, a.q_heads, a.head_dim, dtype=torch.bfloat16,
                            device="cuda")  # fmt: skip
            ms = timer(lambda q=q, meta=meta, cfg=cfg: paged_attention(q, kv, meta, 0.125,
                                                                       config=cfg))
            base = base or ms
            results.append({"variant": name, "q_len": q_len, "ms": ms,
                            "kv_gb_per_s": kv_bytes / ms / 1e6, "vs_q1": ms / base,
                            "floor_ms": kv_bytes / bw / 1e6})  # fmt: skip
            r = results[-1]
            print(f"{name:13s} q_len {q_len:2d}: {ms:7.3f} ms  {r['kv_gb_per_s']:7.0f} GB/s  "
                  f"{r['vs_q1']:.2f}x q_len 1  (floor {r['floor_ms']:.3f} ms)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "copy_gb_per_s": bw, "config": asdict(DEFAULT_CONFIG),
                       "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
