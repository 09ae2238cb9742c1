"""Benchmark the paged-KV kernels on one CUDA GPU, against the GPU's own copy bandwidth.

Measures, side by side in one run (bf16, decode rows of one query each):
- copy bandwidth: a large device-to-device torch copy (bytes read + bytes written);
- our paged attention over full page lists and over sparse lists (a random ``--sparse-frac``
  subset of each row's pages, last page last), as achieved HBM bandwidth (bytes of K and V read);
- torch SDPA over the same KV gathered into contiguous tensors (the gather itself is timed apart);
- the refresh-layer scoring kernel (token_max_probs) against one full attention layer;
- when flashinfer imports, its paged prefill wrapper (our flashinfer backend) on the full lists.
Every timing is the median over ``--reps`` runs with CUDA events, L2 flushed before each run.
Optionally (``--sweep splits|all``) the kernel configuration is tuned first on a few shapes.

    python scripts/bench_kernels.py --sweep splits --out bench_kernels.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.nn.functional as F

from aspire_ray.kernels.kv_store import store_kv
from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.page_scores import token_max_probs
from aspire_ray.kernels.paged_attention import DEFAULT_CONFIG, AttentionConfig, paged_attention

try:  # optional column; the flashinfer plan is cached on the metadata, as ours is
    from aspire_ray.attention.flashinfer_backend import FlashInferBackend
except ImportError:
    FlashInferBackend = None

GIB = 1 << 30
DEVICE = "cuda"
# (context, batch) shapes the sweep tunes on: decode batches that fill the GPU, then few long rows
SWEEP_FILLED = [(16384, 128), (32768, 32)]
SWEEP_FEW = [(32768, 1), (65536, 4), (16384, 16)]
# (block_n, num_warps, num_stages) candidates
SWEEP_TILES = [(32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
               (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3)]  # fmt: skip


def parse_args() -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_kernels.json", help="where to write the JSON results")
    p.add_argument("--contexts", type=ints, default=[4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 64, 256])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sparse-frac", type=float, default=0.08)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--pool-gib", type=float, default=64.0, help="KV pool size (memory permitting)")
    p.add_argument("--sdpa-max-gib", type=float, default=16.0, help="largest gathered K+V for SDPA")
    p.add_argument(
        "--sweep",
        choices=["none", "splits", "all"],
        default="none",
        help="tune the kernel config first: split sizes only, or tiles then split sizes",
    )
    return p.parse_args()


class Timer:
    """Median GPU time of fn in ms: CUDA events around each run, L2 flushed before each run."""

    def __init__(self, reps: int) -> None:
        self.reps = reps
        # 1 GiB: evicts the 60 MB L2 and keeps the GPU busy while the host enqueues the next run
        self.flush = torch.empty(GIB, dtype=torch.uint8, device=DEVICE)

    def __call__(self, fn, reps: int | None = None) -> float:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(True), torch.cuda.Event(True)) for _ in range(reps or self.reps)
        ]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def load_module(path: str, name: str):
    """The module in a file, imported as ``name`` (an older version of one of our kernels
    files, timed beside the current one; a name inside ``aspire_ray.kernels`` lets its relative
    imports resolve)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def copy_bandwidth(timer: Timer) -> float:
    """GB/s of a 4 GiB device-to-device copy, counting bytes read and written."""
    src = torch.randn(GIB, dtype=torch.float32, device=DEVICE)
    dst = torch.empty_like(src)
    ms = timer(partial(dst.copy_, src))
    return 2 * 4 * GIB / ms / 1e6


def add_row_shape_args(p: argparse.ArgumentParser) -> None:
    """The rows of one attention call at the real Qwen2.5-Coder-0.5B shape (64 x 32k, 14 q / 2
    kv heads of 64): the options the per-step-kind benchmarks share."""
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=32000)
    p.add_argument("--q-heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)


def rows_meta(batch: int, q_len: int, context: int, page_size: int,
              gen: torch.Generator) -> PagedKVMeta:  # fmt: skip
    """batch rows of q_len queries over context tokens each, on distinct random pages."""
    n = -(-context // page_size)
    pages = torch.randperm(batch * n, generator=gen).view(batch, n).tolist()
    return PagedKVMeta.build([q_len] * batch, pages, [context] * batch, page_size, "cuda")


def make_meta(page_table: torch.Tensor, kv_len: int, page_size: int) -> PagedKVMeta:
    """Decode rows (1 query each) over page_table [B, n] (physical page ids), kv_len tokens each."""
    b, n = page_table.shape
    qo, kvp, last = (
        list(range(b + 1)),
        list(range(0, (b + 1) * n, n)),
        [kv_len - (n - 1) * page_size],
    )
    dev = page_table.device
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)
    return PagedKVMeta(
        qo_indptr=as_t(qo),
        kv_indptr=as_t(kvp),
        kv_indices=page_table.reshape(-1).to(torch.int32).contiguous(),
        kv_last_page_len=as_t(last * b),
        page_size=page_size,
        qo_indptr_host=qo,
        kv_indptr_host=kvp,
        kv_last_page_len_host=last * b,
    )


def sparse_table(page_table: torch.Tensor, frac: float, gen: torch.Generator) -> torch.Tensor:
    """A random subset of each row's pages (shuffled, non-monotone), the last page kept last."""
    n = page_table.shape[1]
    k = max(1, math.ceil(frac * n))
    cols = torch.randperm(n - 1, generator=gen)[: k - 1].tolist() + [n - 1]
    return page_table[:, cols]


def attention_bytes(rows: int, tokens: int, a: argparse.Namespace) -> int:
    """Bytes the attention must move: K and V of every listed token once, q in, out out."""
    return rows * (tokens * a.kv_heads * a.head_dim * 2 + 2 * a.q_heads * a.head_dim) * 2


def sdpa_baseline(q, kv_cache, page_table, kv_len, timer):
    """SDPA (flash / efficient / cuDNN, never the math fallback) over contiguous gathered KV."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def gather():
        b, n = page_table.shape
        kv = []
        for i in (0, 1):
            x = kv_cache[:, i][page_table.long()]  # [B, n, ps, Hkv, D]
            x = x.permute(0, 3, 1, 2, 4).reshape(b, x.shape[3], -1, x.shape[4])
            kv.append(x[:, :, :kv_len].contiguous())  # [B, Hkv, L, D]
        return kv

    gather_ms = timer(gather)
    k, v = gather()
    qs = q[:, :, None]  # [B, Hq, 1, D]
    backends = [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ]
    with sdpa_kernel(backends):
        fn = lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
        out = fn()[:, :, 0]
        ms = timer(fn)
    return ms, gather_ms, out


def sweep(kv_cache, pool_pages, a, timer, gen, tiles) -> tuple[AttentionConfig, list[dict]]:
    """Tune tile sizes on decode shapes that fill the GPU, then split sizes on few long rows."""
    results = []

    def score(cfg, shapes):
        bws = []
        for ctx, b in shapes:
            n = ctx // a.page_size
            table = torch.randperm(pool_pages, generator=gen)[: b * n].view(b, n).to(DEVICE)
            meta = make_meta(table, ctx, a.page_size)
            q = torch.randn(b, a.q_heads, a.head_dim, dtype=torch.bfloat16, device=DEVICE)
            ms = timer(partial(paged_attention, q, kv_cache, meta, 0.1, config=cfg), reps=10)
            bws.append(attention_bytes(b, ctx, a) / ms / 1e6)
        gmean = math.exp(sum(map(math.log, bws)) / len(bws))
        results.append({"config": asdict(cfg), "shapes": shapes, "gbps": bws, "gmean_gbps": gmean})
        print(f"  sweep {cfg}: {' '.join(f'{x:.0f}' for x in bws)} GB/s (gmean {gmean:.0f})")
        return gmean

    best = DEFAULT_CONFIG
    if tiles:
        best = max(
            (replace(best, block_n=bn, num_warps=w, num_stages=s) for bn, w, s in SWEEP_TILES),
            key=lambda cfg: score(cfg, SWEEP_FILLED),
        )
    best = max(
        (replace(best, waves=w, min_chunk_pages=m) for w in (4.0, 8.0, 16.0) for m in (8, 16, 32)),
        key=lambda cfg: score(cfg, SWEEP_FEW),
    )
    return best, results


def host_overheads(kv_cache, pool_pages, a, config, gen) -> dict[str, float]:
    """Host time of one call (plan cached) on a 1-row 4k shape whose GPU time is tiny: the
    wrapper's checks plus Triton's launch path, which CUDA graphs remove."""
    n = min(256, pool_pages)
    table = torch.randperm(pool_pages, generator=gen)[:n].view(1, n).to(DEVICE)
    meta = make_meta(table, n * a.page_size, a.page_size)
    q = torch.randn(1, a.q_heads, a.head_dim, dtype=torch.bfloat16, device=DEVICE)
    _, lse = paged_attention(q, kv_cache, meta, 0.1, return_lse=True)
    k = torch.randn(1, a.kv_heads, a.head_dim, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    one_launch = replace(config, kv_chunk_pages=1 << 30)
    calls = {
        "attention_split": partial(paged_attention, q, kv_cache, meta, 0.1, config=config),
        "attention_one_launch": partial(paged_attention, q, kv_cache, meta, 0.1, config=one_launch),
        "token_max_probs": partial(token_max_probs, q, lse, kv_cache, meta, 0.1),
        "store_kv": partial(store_kv, k, k, kv_cache, slots),
    }
    result = {}
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        result[name] = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
    return result


def main() -> None:
    a = parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    timer = Timer(a.reps)
    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth(timer)
    print(f"{props.name}: {props.multi_processor_count} SMs, copy bandwidth {copy_gbps:.0f} GB/s")

    page_bytes = 2 * a.page_size * a.kv_heads * a.head_dim * 2
    free, _ = torch.cuda.mem_get_info()
    pool_bytes = min(a.pool_gib * GIB, free - 30 * GIB)
    pool_pages = int(pool_bytes // page_bytes)
    kv_cache = torch.empty(
        pool_pages, 2, a.page_size, a.kv_heads, a.head_dim, dtype=torch.bfloat16, device=DEVICE
    )
    for chunk in kv_cache.split(1 << 14):
        chunk.normal_()
    print(f"KV pool: {pool_pages} pages of {a.page_size} tokens ({pool_bytes / GIB:.0f} GiB)")

    config, sweep_results = DEFAULT_CONFIG, []
    if a.sweep != "none":
        config, sweep_results = sweep(kv_cache, pool_pages, a, timer, gen, a.sweep == "all")
        print(f"chosen config: {config}")

    rows, check = [], None
    scale = a.head_dim**-0.5
    flashinfer = FlashInferBackend() if FlashInferBackend is not None else None
    for ctx in a.contexts:
        for b in a.batches:
            n = ctx // a.page_size
            if b * n > pool_pages:
                print(f"skip ctx {ctx} batch {b}: needs {b * n * page_bytes / GIB:.0f} GiB of KV")
                continue
            table = torch.randperm(pool_pages, generator=gen)[: b * n].view(b, n).to(DEVICE)
            meta = make_meta(table, ctx, a.page_size)
            sparse = sparse_table(table, a.sparse_frac, gen)
            sparse_len = (sparse.shape[1] - 1) * a.page_size + a.page_size
            smeta = make_meta(sparse, sparse_len, a.page_size)
            q = torch.randn(b, a.q_heads, a.head_dim, dtype=torch.bfloat16, device=DEVICE)

            full_ms = timer(partial(paged_attention, q, kv_cache, meta, scale, config=config))
            sparse_ms = timer(partial(paged_attention, q, kv_cache, smeta, scale, config=config))
            out, lse = paged_attention(q, kv_cache, meta, scale, return_lse=True, config=config)
            score_ms = timer(partial(token_max_probs, q, lse, kv_cache, meta, scale))
            row = {
                "context": ctx,
                "batch": b,
                "full_ms": full_ms,
                "full_gbps": attention_bytes(b, ctx, a) / full_ms / 1e6,
                "sparse_pages": sparse.shape[1],
                "sparse_ms": sparse_ms,
                "sparse_gbps": attention_bytes(b, sparse_len, a) / sparse_ms / 1e6,
                "score_ms": score_ms,
                "score_over_full": score_ms / full_ms,
            }
            if flashinfer is not None:
                fi = partial(flashinfer.attention, q, kv_cache, meta, scale)
                row["flashinfer_ms"] = timer(fi)  # its warm-up runs plan, once per meta
                row["flashinfer_gbps"] = attention_bytes(b, ctx, a) / row["flashinfer_ms"] / 1e6
                row["max_abs_diff_vs_flashinfer"] = (out.float() - fi().float()).abs().max().item()
            kv_gib = 2 * b * ctx * a.kv_heads * a.head_dim * 2 / GIB
            if kv_gib <= a.sdpa_max_gib and torch.cuda.mem_get_info()[0] > (2 * kv_gib + 4) * GIB:
                try:
                    sdpa_ms, gather_ms, sdpa_out = sdpa_baseline(q, kv_cache, table, ctx, timer)
                    row.update(sdpa_ms=sdpa_ms, gather_ms=gather_ms)
                    row["sdpa_gbps"] = attention_bytes(b, ctx, a) / sdpa_ms / 1e6
                    err = (out.float() - sdpa_out.float()).abs().max().item()
                    row["max_abs_diff_vs_sdpa"] = err
                    check = err if check is None else max(check, err)
                    del sdpa_out
                except RuntimeError as e:  # no fused SDPA kernel for this shape
                    row["sdpa_error"] = str(e).split("\n")[0][:200]
            rows.append(row)
            sd = f"{row['sdpa_gbps']:6.0f}" if "sdpa_gbps" in row else "     -"
            fi_col = f"  flashinfer {row['flashinfer_gbps']:6.0f} GB/s" if flashinfer else ""
            print(
                f"ctx {ctx:6d} B {b:3d}  full {full_ms:8.3f} ms {row['full_gbps']:6.0f} GB/s "
                f"({row['full_gbps'] / copy_gbps:4.0%})  sparse {sparse_ms:7.3f} ms "
                f"{row['sparse_gbps']:6.0f} GB/s  sdpa {sd} GB/s{fi_col}  score/full "
                f"{row['score_over_full']:.2f}"
            )

    host_us = host_overheads(kv_cache, pool_pages, a, config, gen)
    print("host us per call: " + ", ".join(f"{k} {v:.0f}" for k, v in host_us.items()))

    result = {
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "flashinfer": __import__("flashinfer").__version__ if flashinfer else None,
        "shape": {
            "q_heads": a.q_heads,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "page_size": a.page_size,
            "dtype": "bfloat16",
            "sparse_frac": a.sparse_frac,
        },
        "copy_gbps": copy_gbps,
        "config": asdict(config),
        "host_us_per_call": host_us,
        "max_abs_diff_vs_sdpa": check,
        "rows": rows,
        "sweep": sweep_results,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)


def print_table(r: dict) -> None:
    copy = r["copy_gbps"]
    host = r["host_us_per_call"]["attention_split"]
    print(f"\n{r['device']}  copy {copy:.0f} GB/s  host {host:.0f} us per attention call")
    fi = r.get("flashinfer") is not None
    print(
        "   ctx    B |  full GB/s  %copy | sparse GB/s %copy |  SDPA GB/s |"
        + (" flashinfer GB/s |" if fi else "")
        + " score/full"
    )
    for x in r["rows"]:
        sd = f"{x['sdpa_gbps']:10.0f}" if "sdpa_gbps" in x else "         -"
        fi_col = f" {x['flashinfer_gbps']:15.0f} |" if fi else ""
        print(
            f"{x['context']:6d} {x['batch']:4d} | {x['full_gbps']:10.0f}"
            f" {x['full_gbps'] / copy:6.0%}"
            f" | {x['sparse_gbps']:10.0f} {x['sparse_gbps'] / copy:5.0%} | {sd} |{fi_col}"
            f" {x['score_over_full']:10.2f}"
        )


if __name__ == "__main__":
    main()
