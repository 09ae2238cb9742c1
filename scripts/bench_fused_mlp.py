"""A decode step's MLP and the norm after it, as the engine runs them, against the one-launch MLP
whose partials that norm sums (``kernels/mlp_partials.py``, ``EngineConfig.fused_mlp``).

Variants, per step row count M, one layer's calls each:
    separate  gate_up_silu.gate_up_silu (fused epilogue) + F.linear down (cuBLAS, with its
              split-K reduce where cuBLAS picks one) + fused_norm.rms_norm with the residual add
    fused     mlp_partials.mlp_partials + fused_norm.rms_norm_parts (with the residual add)
Each timing is one CUDA graph replaying the variant over ``--layers`` distinct weight copies
(``bench_linear.graph_time``: weights from HBM, launch gaps as in a step graph): us per layer,
the median of ``--reps`` replays; the bytes floor is the layer's MLP weights over the copy
bandwidth of ``bench_kernels.copy_bandwidth``. ``MLPConfig`` tiles are swept (``--sweep``); each
fused output is checked against the separate one (max abs difference of the norm's output).

    PYTHONPATH=. python3 scripts/bench_fused_mlp.py --model-shape smollm2-135m --tokens 64,128 \
        --out fused_mlp.json

``--device cpu`` (Triton's interpreter, tiny shapes, float32) runs every variant and check
once, untimed: the smoke test's path.
"""

from __future__ import annotations

import json
import shlex
import sys

import torch
import torch.nn.functional as F
from bench_fused_epilogues import kernel_bench_args
from bench_linear import graph_time

from aspire_ray.kernels.fused_norm import rms_norm, rms_norm_parts
from aspire_ray.kernels.gate_up_silu import gate_up_silu
from aspire_ray.kernels.linear import LinearConfig
from aspire_ray.kernels.mlp_partials import DEFAULT_MLP_CONFIG, MLPConfig, mlp_partials

SHAPES = {"smollm2-135m": (576, 1536), "qwen2.5-0.5b": (896, 4864), "tiny": (48, 80)}  # H, I
SWEEP = [MLPConfig(64, bi, bk, bn, w, s) for bi, bk, bn, w, s in
         [(32, 64, 64, 4, 2), (64, 64, 64, 4, 2), (64, 128, 64, 4, 2), (64, 64, 128, 4, 2),
          (128, 64, 64, 4, 2), (128, 64, 64, 8, 2), (64, 64, 64, 4, 3)]]  # fmt: skip
TINY = MLPConfig(16, 16, 16, 16)  # the interpreter's pace
EPS = 1e-6


class Layers:
    """``--layers`` copies of one layer's MLP weights and norm weight, a step's input rows."""

    def __init__(self, shape, n: int, m: int, dtype, device, gen) -> None:
        h, i = shape

        def rand(*s, scale=1.0):
            return (torch.randn(*s, generator=gen) * scale).to(dtype).to(device)

        self.gu = [rand(2 * i, h, scale=h**-0.5) for _ in range(n)]
        self.d = [rand(h, i, scale=i**-0.5) for _ in range(n)]
        self.w = [1 + rand(h, scale=0.1) for _ in range(n)]
        self.x = rand(m, h)
        self.residual = rand(m, h)
        self.res = self.residual.clone()  # the residual each call updates
        self.weight_bytes = (self.gu[0].numel() + self.d[0].numel()) * self.x.element_size()

    def separate(self, i: int, gu_cfg: LinearConfig | None = None) -> torch.Tensor:
        mlp = F.linear(gate_up_silu(self.x, self.gu[i], gu_cfg), self.d[i])
        return rms_norm(mlp, self.w[i], EPS, self.res)

    def fused(self, i: int, cfg: MLPConfig) -> torch.Tensor:
        return rms_norm_parts(mlp_partials(self.x, self.gu[i], self.d[i], cfg), self.w[i], EPS,
                              self.res)  # fmt: skip

    def output(self, fn) -> torch.Tensor:
        """fn's norm output for layer 0 from the pristine residual."""
        self.res.copy_(self.residual)
        return fn(0)


def run_tokens(args, m: int, dtype, device, timed: bool, bandwidth: float | None) -> dict:
    gen = torch.Generator().manual_seed(m)
    layers = Layers(SHAPES[args.model_shape], args.layers, m, dtype, device, gen)
    small = args.device == "cpu"
    gu_cfg = LinearConfig(16, 16, 16) if small else None
    want = layers.output(lambda i: layers.separate(i, gu_cfg))
    configs = [TINY] if small else ([DEFAULT_MLP_CONFIG] + [c for c in SWEEP if
                                                            c != DEFAULT_MLP_CONFIG]
                                    if args.sweep else [DEFAULT_MLP_CONFIG])  # fmt: skip

    def timer(fn):
        return graph_time(fn, args.layers, args.reps) * 1e6 if timed else None

    separate_us = timer(lambda i: layers.separate(i, gu_cfg))
    runs = []
    for cfg in configs:
        try:
            got = layers.output(lambda i, c=cfg: layers.fused(i, c))
            max_diff = float((got.float() - want.float()).abs().max())
            us = timer(lambda i, c=cfg: layers.fused(i, c))
        except Exception as e:  # a tile that does not compile or fit: skipped
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        runs.append({"config": vars(cfg), "us": us, "max_abs_diff": max_diff})
    floor_us = layers.weight_bytes / bandwidth * 1e6 if bandwidth else None
    return {"tokens": m, "separate_us": separate_us, "floor_us": floor_us,
            "default": runs[0] if runs and runs[0]["config"] == vars(configs[0]) else None,
            "fused": sorted(runs, key=lambda r: r["us"]) if timed else runs}  # fmt: skip


def table(results: list[dict]) -> str:
    lines = ["| tokens | separate us | fused us (default tile) | best fused us (tile) | floor us "
             "| max abs diff |", "|---|---|---|---|---|---|"]  # fmt: skip

    def us(x):
        return "-" if x is None else f"{x:.2f}"

    for r in results:
        best = r["fused"][0] if r["fused"] else None
        d = r["default"]
        tile = "" if best is None else "/".join(
            str(best["config"][k]) for k in ("block_i", "block_k", "block_n", "num_warps"))
        lines.append(f"| {r['tokens']} | {us(r['separate_us'])} | {us(d and d['us'])} "
                     f"| {us(best and best['us'])} ({tile}) | {us(r['floor_us'])} "
                     f"| {max(f['max_abs_diff'] for f in r['fused']):.2e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    args = kernel_bench_args(__doc__.split("\n\n")[0], SHAPES, "smollm2-135m",
                             30).parse_args()  # fmt: skip
    device = torch.device(args.device)
    timed = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    if not timed:
        args.model_shape, dtype = "tiny", torch.float32  # the interpreter's bf16 dot is off
    bandwidth = None
    if timed:
        from bench_floor import copy_bandwidth

        bandwidth = copy_bandwidth(device, 1 << 30, 10)["bytes_per_s"]
    results = [run_tokens(args, m, dtype, device, timed, bandwidth) for m in args.tokens]
    print(table(results))
    if args.out:
        report = {"command": shlex.join([sys.executable, *sys.argv]), "args": vars(args),
                  "gpu": torch.cuda.get_device_name() if timed else None,
                  "bandwidth": bandwidth, "results": results}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
