"""The refresh layer's scoring kernel (``page_scores``) under program shapes, on one CUDA GPU.

Shape: ``--batch`` rows of one query over ``--context`` tokens each (the refresh layer of a
draft step scores every row's full list), pages shuffled over the pool. Per ``ScoreConfig``
variant: GPU time (median, L2 flushed before each run), the K bytes it must read, their floor
at the copy bandwidth measured in the same run, and the ratio; one full attention call over
the same rows beside it (K and V: twice the bytes).

    python scripts/bench_scoring.py --batch 64 --context 32000 --out bench_scoring.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from functools import partial

import torch
from bench_kernels import Timer, add_row_shape_args, copy_bandwidth, rows_meta

from aspire_ray.kernels.page_scores import DEFAULT_SCORE_CONFIG, page_scores
from aspire_ray.kernels.paged_attention import paged_attention

VARIANTS = {  # name -> ScoreConfig overrides
    "default": {},
    "tiles2": {"tiles_per_item": 2},
    "tiles8": {"tiles_per_item": 8},
    "tile128": {"tile_tokens": 128},
    "tile128_x2": {"tile_tokens": 128, "tiles_per_item": 2},
    "tile32_x8": {"tile_tokens": 32, "tiles_per_item": 8},
    "p4": {"programs_per_sm": 4},
    "p16": {"programs_per_sm": 16},
    "p32": {"programs_per_sm": 32},
    "w2": {"num_warps": 2},
    "w8": {"num_warps": 8},
    "s2": {"num_stages": 2},
    "s3": {"num_stages": 3},
    "w2_p16": {"num_warps": 2, "programs_per_sm": 16},
    "tile128_w8": {"tile_tokens": 128, "num_warps": 8},
    "tile128_s2": {"tile_tokens": 128, "num_stages": 2},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_row_shape_args(p)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    timer = Timer(a.reps)
    copy_gbps = copy_bandwidth(timer)
    gen = torch.Generator().manual_seed(0)
    n = -(-a.context // a.page_size)
    kv = torch.randn(a.batch * n, 2, a.page_size, a.kv_heads, a.head_dim,
                     dtype=torch.bfloat16, device="cuda")  # fmt: skip
    meta = rows_meta(a.batch, 1, a.context, a.page_size, gen)
    q = torch.randn(a.batch, a.q_heads, a.head_dim, dtype=torch.bfloat16, device="cuda")
    scale = a.head_dim**-0.5
    _, lse = paged_attention(q, kv, meta, scale, return_lse=True)
    k_bytes = a.batch * a.context * a.kv_heads * a.head_dim * 2
    floor_ms = k_bytes / copy_gbps / 1e6
    full_ms = timer(partial(paged_attention, q, kv, meta, scale))
    reference = page_scores(q, lse, kv, meta, scale)
    print(f"copy {copy_gbps:.0f} GB/s; K {k_bytes / 1e6:.0f} MB, floor {floor_ms * 1e3:.1f} us; "
          f"full attention {full_ms * 1e3:.1f} us")  # fmt: skip
    results = []
    for name in a.variants.split(","):
        cfg = replace(DEFAULT_SCORE_CONFIG, **VARIANTS[name])
        fn = partial(page_scores, q, lse, kv, meta, scale, config=cfg)
        diff = float((fn() - reference).abs().max())  # every shape scores the same pages
        ms = timer(fn)
        results.append({"variant": name, "config": asdict(cfg), "us": ms * 1e3,
                        "over_floor": ms / floor_ms, "over_full_attention": ms / full_ms,
                        "max_abs_diff_vs_default": diff})  # fmt: skip
        print(f"{name:12s} {ms * 1e3:7.1f} us  {ms / floor_ms:5.2f}x floor  "
              f"{ms / full_ms:5.2f}x full attention  diff {diff:.1e}")  # fmt: skip
    report = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
              "batch": a.batch, "context": a.context, "page_size": a.page_size,
              "heads": [a.q_heads, a.kv_heads, a.head_dim], "k_bytes": k_bytes,
              "floor_us": floor_ms * 1e3, "full_attention_us": full_ms * 1e3,
              "results": results}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
