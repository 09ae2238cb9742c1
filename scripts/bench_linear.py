"""Few-token GEMMs of a decode step: cuBLAS (F.linear) against the split-K kernel, in graphs.

A decode or draft step runs each layer's four GEMMs (qkv, o, gate_up, down) with M = the batch's
rows. Per model shape and M: one CUDA graph of those GEMMs over ``--layers`` layers with their
own weights (so the weights stream from HBM as in a real step, not from L2), replayed; the GPU
time per layer by GEMM, the weight bytes, the floor = bytes / copy bandwidth measured in the same
run, and the ratio; plus the largest difference between the two kernels' outputs.

    python scripts/bench_linear.py --shapes qwen2.5-coder-0.5b,smollm2 --m 16,32,64 \
        --out docs/bench_linear_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import asdict
from functools import partial

import torch
import torch.nn.functional as F

from aspire_ray.kernels.skinny_linear import (
    DEFAULT_CONFIG,
    SkinnyConfig,
    counters,
    skinny_linear,
    split_k,
)

# name -> (hidden, intermediate, q heads, kv heads, head dim, qkv bias)
SHAPES = {
    "smollm2": (576, 1536, 9, 3, 64, False),
    "qwen2.5-coder-0.5b": (896, 4864, 14, 2, 64, True),
    "qwen2.5-coder-1.5b": (1536, 8960, 12, 2, 128, True),
    "qwen3-8b": (4096, 12288, 32, 8, 128, False),
}


def layer_weights(shape, layers: int, dtype) -> list[dict]:
    h, inter, hq, hkv, d, bias = shape
    out = []
    for _ in range(layers):
        w = {"qkv": torch.randn((hq + 2 * hkv) * d, h), "o": torch.randn(h, hq * d),
             "gate_up": torch.randn(2 * inter, h), "down": torch.randn(h, inter)}
        w = {k: (v / v.shape[1] ** 0.5).to(dtype).cuda() for k, v in w.items()}
        w["qkv_bias"] = torch.randn((hq + 2 * hkv) * d).to(dtype).cuda() if bias else None
        out.append(w)
    return out


def gemms(w: dict, x_h: torch.Tensor, x_inter: torch.Tensor, fn) -> list[torch.Tensor]:
    """The four GEMMs of one layer on fixed inputs (their outputs, for the comparison)."""
    return [fn(x_h, w["qkv"], w["qkv_bias"]), fn(x_h, w["o"], None),
            fn(x_h, w["gate_up"], None), fn(x_inter, w["down"], None)]  # fmt: skip


def graph_ms(fn, reps: int) -> float:
    """Median GPU time of one replay of a graph of fn (captured after a warm-up run)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_layers(ws: list[dict], x_h, x_i, fn, reps: int) -> dict[str, float]:
    """us per layer: the four GEMMs of every layer in one graph ("all"), and each GEMM kind
    alone over every layer."""
    layers = len(ws)
    out = {"all": graph_ms(lambda: [gemms(w, x_h, x_i, fn) for w in ws], reps) * 1e3 / layers}
    for g in ("qkv", "o", "gate_up", "down"):
        x = x_i if g == "down" else x_h
        out[g] = graph_ms(lambda x=x, g=g: [fn(x, w[g], w["qkv_bias"] if g == "qkv" else None)
                                            for w in ws], reps) * 1e3 / layers  # fmt: skip
    return out


SWEEP = {"block_n": (32, 64, 128), "block_k": (64, 128, 256), "programs_per_sm": (1, 2, 4),
         "min_k_blocks": (1, 2, 4)}


def sweep(ws: list[dict], x_h, x_i, reps: int) -> dict[str, list]:
    """Per GEMM kind: (us per layer, config) of every SWEEP config, fastest first."""
    out = {}
    for g in ("qkv", "o", "gate_up", "down"):
        x = x_i if g == "down" else x_h
        rows = []
        for values in itertools.product(*SWEEP.values()):
            cfg = SkinnyConfig(**dict(zip(SWEEP, values, strict=True)))
            fn = partial(skinny_linear, config=cfg)
            us = graph_ms(lambda x=x, g=g, fn=fn: [fn(x, w[g], w["qkv_bias"] if g == "qkv"
                                                      else None) for w in ws], reps)  # fmt: skip
            rows.append((us * 1e3 / len(ws), asdict(cfg)))
        out[g] = sorted(rows, key=lambda r: r[0])
    return out


def copy_bandwidth() -> float:
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() * 4 / statistics.median(times) / 1e-3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen2.5-coder-0.5b,smollm2")
    p.add_argument("--m", default="16,32,64", help="rows (tokens) per GEMM")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="also time every SWEEP config")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dtype = torch.bfloat16
    torch.manual_seed(0)
    counters(torch.device("cuda"))
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    results = []
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        ws = layer_weights(shape, a.layers, dtype)
        for m in [int(v) for v in a.m.split(",")]:
            x_h = torch.randn(m, shape[0]).to(dtype).cuda()
            x_i = torch.randn(m, shape[1]).to(dtype).cuda()
            diff = max((s - c).abs().max().item() for s, c in zip(
                gemms(ws[0], x_h, x_i, skinny_linear), gemms(ws[0], x_h, x_i, F.linear),
                strict=True))  # fmt: skip
            row = {"shape": name, "m": m, "max_abs_diff": diff, "per_layer_us": {}}
            for kernel, fn in (("cublas", F.linear), ("skinny", skinny_linear)):
                row["per_layer_us"][kernel] = time_layers(ws, x_h, x_i, fn, a.reps)
            nbytes = {g: ws[0][g].numel() * ws[0][g].element_size()
                      for g in ("qkv", "o", "gate_up", "down")}  # fmt: skip
            row["weight_bytes"] = nbytes
            row["floor_us"] = {g: b / bw * 1e6 for g, b in nbytes.items()}
            row["floor_us"]["all"] = sum(nbytes.values()) / bw * 1e6
            row["splits"] = {g: split_k(ws[0][g].shape[0], ws[0][g].shape[1], sms)[0]
                             for g in nbytes}  # fmt: skip
            row["config"] = asdict(DEFAULT_CONFIG)
            if a.sweep:
                row["sweep"] = sweep(ws, x_h, x_i, a.reps)
                for g, rows in row["sweep"].items():
                    print(f"  sweep {g}: best " + "; ".join(
                        f"{us:.1f} us {cfg}" for us, cfg in rows[:3]), flush=True)  # fmt: skip
            results.append(row)
            cu, sk = row["per_layer_us"]["cublas"], row["per_layer_us"]["skinny"]
            fl = row["floor_us"]
            print(f"{name:20s} M {m:3d}: " + "  ".join(
                f"{g} {cu[g]:.1f}/{sk[g]:.1f}/{fl[g]:.1f}" for g in ("qkv", "o", "gate_up", "down",
                                                                     "all")) +
                f"  us (cublas/skinny/floor)  diff {diff:.3g}", flush=True)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "copy_bytes_per_s": bw, "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
