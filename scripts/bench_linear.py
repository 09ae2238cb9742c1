"""A decode step's linear layers: cuBLAS (torch F.linear) against ``kernels.linear`` per shape.

Each shape is one model's projection ([N, K] weights) at a step's row count M. Every timing is
one CUDA graph that replays the op over ``--layers`` distinct weight copies (as a forward walks
its layers, so the weights come from HBM, not L2), divided by the layers: per-call time with
graph launch gaps, the way the engine's step graphs run it. Reported beside each: the weight
bytes / the copy bandwidth measured in the same run (the call's floor) and the ratio.

    python scripts/bench_linear.py --model-shape qwen2.5-coder-0.5b --rows 64,576 \
        --out bench_linear.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F
from bench_floor import copy_bandwidth

from aspire_ray.kernels.linear import LinearConfig, triton_linear

# model shape -> projection -> (N, K)
SHAPES = {
    "qwen2.5-coder-0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896),
                           "down": (896, 4864), "lm_head": (151936, 896)},
    "qwen2.5-coder-1.5b": {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536),
                           "down": (1536, 8960)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                 "down": (4096, 12288)},
}


def graph_time(fn, layers: int, reps: int) -> float:
    """Seconds per call: one graph of ``layers`` calls fn(i), median of reps replays."""
    for i in range(layers):  # compile / warm up outside the capture
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            fn(i)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / layers)
    return statistics.median(times)


def candidates(sweep: str) -> list[LinearConfig]:
    if sweep == "default":
        return [LinearConfig()]
    out = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (2, 4), (3, 4, 5)):
        out.append(LinearConfig(64, bn, bk, warps, stages))
    return out


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-shape", default="qwen2.5-coder-0.5b", choices=sorted(SHAPES))
    p.add_argument("--projections", default=None, help="comma list (default: all)")
    p.add_argument("--rows", type=ints, default=[64, 576])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", choices=("default", "all"), default="all")
    p.add_argument("--top", type=int, default=3, help="best Triton configs listed per shape")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30, 10)["bytes_per_s"]
    shapes = SHAPES[args.model_shape]
    names = args.projections.split(",") if args.projections else list(shapes)
    results = []
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}")
    print(f"{'proj':>8} {'M':>5} {'floor us':>9} {'cublas us':>10} {'triton us':>10} "
          f"{'ratio cb':>9} {'ratio tr':>9}  best config")
    for name in names:
        n, k = shapes[name]
        layers = max(2, min(args.layers, (4 << 30) // (n * k * 2)))
        ws = [torch.randn(n, k, dtype=dtype, device="cuda") * 0.02 for _ in range(layers)]
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            y = torch.empty(m, n, dtype=dtype, device="cuda")
            floor = n * k * 2 / bw
            mm = lambda i, x=x, y=y, ws=ws: torch.mm(x, ws[i].t(), out=y)  # noqa: E731
            cublas = graph_time(mm, layers, args.reps)
            ref = F.linear(x, ws[0]).float()
            timed = []
            for cfg in candidates(args.sweep):
                try:
                    got = triton_linear(x, ws[0], cfg=cfg, out=y).float()
                    if not torch.allclose(got, ref, atol=2e-2, rtol=2e-2):
                        raise AssertionError("wrong result")
                    call = lambda i, c=cfg, x=x, y=y, ws=ws: triton_linear(x, ws[i], cfg=c, out=y)  # noqa: E731
                    t = graph_time(call, layers, args.reps)
                except Exception as e:  # a config that does not compile or fit: skipped
                    print(f"  skip {cfg}: {type(e).__name__}")
                    continue
                timed.append((t, cfg))
            timed.sort(key=lambda tc: tc[0])
            best_t, best = timed[0]
            print(f"{name:>8} {m:5d} {floor * 1e6:9.2f} {cublas * 1e6:10.2f} {best_t * 1e6:10.2f} "
                  f"{cublas / floor:8.2f}x {best_t / floor:8.2f}x  {best}")
            results.append({
                "projection": name, "n": n, "k": k, "m": m, "layers": layers,
                "floor_us": floor * 1e6, "cublas_us": cublas * 1e6,
                "triton": [{"us": t * 1e6, "config": vars(c)} for t, c in timed[:args.top]],
            })  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "gpu": torch.cuda.get_device_name(),
                       "copy_bandwidth": bw, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
