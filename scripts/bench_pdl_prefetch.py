"""A decode forward's chain of skinny GEMMs: does a kernel that streams its weight slice into L2
before it waits for its predecessor (programmatic dependent launch) beat one that waits first?

docs/benchmarks.md §8.35 tried PDL with every kernel waiting for its predecessor first thing:
no gain, since a graph replay already keeps a kernel's dispatch short. §8.40 found a 64-row
draft step's projections at ~4x their weight bytes: each small GEMM's K loop waits on HBM
latency chunk after chunk. Here each GEMM's weight slice does not depend on its predecessor, so
a kernel dispatched early (PDL) can ask for it (``cp.async.bulk.prefetch.L2``, one thread a
program) while the predecessor still runs, then wait, then stream it from L2.

The chain is Qwen2.5-Coder-0.5B's per-layer projections (qkv [1152, 896], o [896, 896], gate_up
[9728, 896], down [896, 4864]; each GEMM's input the previous one's output, sliced), ``--layers``
distinct weight copies so that the weights come from HBM, captured in one CUDA graph and
replayed; per-layer time = replay / layers. Variants, one Triton kernel (kernels/linear.py's
tiling, ``invariant_config``) compiled four ways, and cuBLAS:

    plain     no PDL                         (today's engine)
    pdl       PDL, wait first                (§8.35)
    prefetch  PDL, L2 prefetch, then wait    (this experiment)
    cublas    torch.nn.functional.linear

Every Triton variant's output is checked bitwise against ``plain`` (same tiles, same K order).
GPU only (Hopper: the bulk prefetch and griddepcontrol are sm_90 instructions).

    python scripts/bench_pdl_prefetch.py --rows 64,128 --out pdl_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from bench_floor import copy_bandwidth

from aspire_ray.kernels.linear import dot_one, dot_precision, invariant_config

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
VARIANTS = {"plain": 0, "pdl": 1, "prefetch": 2}


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """Thread 0 of the program asks for nbytes at ptr (16-byte aligned, a multiple of 16) to be
    brought into L2; the other threads do nothing."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;\n"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chain_linear_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, MODE: tl.constexpr, ELEM: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 2:
        # this program's weight rows [n0, n0 + BLOCK_N) are contiguous (stride_wn == K)
        n0 = pid_n * BLOCK_N
        rows = tl.minimum(BLOCK_N, N - n0)
        base = w_ptr + n0.to(tl.int64) * stride_wn
        total = rows * K * ELEM
        for off in range(0, total, 32768):
            _prefetch_l2(base + off // ELEM, tl.minimum(32768, total - off))
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok, n_ok = rm < M, rn < N
    acc = dot_one(x_ptr + rm[:, None] * stride_xm, m_ok, w_ptr + rn[None, :] * stride_wn, n_ok,
                  K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)  # kernels/linear.py's K loop
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def chain_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, mode: int) -> None:
    """out[:, :] = x @ w^T with the chain kernel in ``mode`` (0 plain, 1 pdl, 2 prefetch)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.is_contiguous() and x.stride(1) == 1 and out.stride(1) == 1
    cfg = invariant_config(n, k)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    extra = {"launch_pdl": True} if mode else {}
    _chain_linear_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=dot_precision(x), MODE=mode,
        ELEM=x.element_size(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )  # fmt: skip


class Chain:
    """``layers`` layers of the four projections, each GEMM's input its predecessor's output:
    h [M, 896] -> qkv [M, 1152] -> o(qkv[:, :896]) -> gate_up [M, 9728] -> down(gu[:, :4864])."""

    def __init__(self, rows: int, layers: int, dtype: torch.dtype, device: str) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.w = [{name: (torch.randn(n, k, generator=g, device=device, dtype=torch.float32)
                          / k ** 0.5).to(dtype) for name, (n, k) in SHAPES.items()}
                  for _ in range(layers)]  # fmt: skip
        self.h = torch.randn(rows, 896, generator=g, device=device, dtype=torch.float32).to(dtype)
        self.buf = {name: torch.empty(rows, n, device=device, dtype=dtype)
                    for name, (n, _) in SHAPES.items()}  # fmt: skip
        self.out = torch.empty(rows, 896, device=device, dtype=dtype)

    def run(self, variant: str) -> None:
        gemm = (lambda x, w, o: torch.matmul(x, w.t(), out=o)) if variant == "cublas" else (
            lambda x, w, o: chain_linear(x, w, o, VARIANTS[variant]))
        x = self.h
        for layer in self.w:
            gemm(x, layer["qkv"], self.buf["qkv"])
            gemm(self.buf["qkv"][:, :896], layer["o"], self.buf["o"])
            gemm(self.buf["o"], layer["gate_up"], self.buf["gate_up"])
            gemm(self.buf["gate_up"][:, :4864], layer["down"], self.out)
            x = self.out

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.w for w in layer.values())


def replay_seconds(chain: Chain, variant: str, reps: int) -> list[float]:
    chain.run(variant)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.run(variant)
    times = []
    for _ in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return times[3:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="64,128", help="comma list of row counts (a step's tokens)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--variants", default="plain,pdl,prefetch,cublas")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device, 1 << 30, 10)
    variants = args.variants.split(",")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "bandwidth": bw, "args": vars(args), "results": []}
    print(f"# {report['gpu']}, copy bandwidth {bw['bytes_per_s'] / 1e12:.3f} TB/s; "
          f"{args.layers} layers of qkv, o, gate_up, down (Qwen2.5-0.5B shapes), bf16")
    print("| rows | variant | us a layer (median) | floor us | ratio | bitwise = plain |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        chain = Chain(rows, args.layers, torch.bfloat16, "cuda")
        floor = chain.weight_bytes() / args.layers / bw["bytes_per_s"]
        reference = None
        for variant in variants:
            times = replay_seconds(chain, variant, args.reps)
            chain.run(variant)
            torch.cuda.synchronize()
            result = chain.out.clone()
            if variant == "plain":
                reference = result
            same = (None if reference is None or variant == "cublas"
                    else bool(torch.equal(result, reference)))  # fmt: skip
            per_layer = statistics.median(times) / args.layers
            report["results"].append({"rows": rows, "variant": variant, "layer_s": per_layer,
                                      "floor_s": floor, "replays_s": times, "same": same})
            print(f"| {rows} | {variant} | {1e6 * per_layer:.2f} | {1e6 * floor:.2f} | "
                  f"{per_layer / floor:.2f}x | {same} |")
        del chain
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
