"""GEMMs with a fused epilogue against the unfused kernels they replace, at a decode step's rows.

Variants, per step row count M (Qwen2.5-0.5B shapes, bf16; one layer's call each):
    a  qkv: F.linear (cuBLAS) + rope.rotary_embedding with the KV store
    b  qkv: linear.triton_linear (invariant_config) + rope.rotary_embedding with the KV store
    c  qkv: qkv_rope.qkv_rope (fused)
    d  mlp: F.linear (cuBLAS) gate_up + activation.silu_and_mul
    e  mlp: linear.triton_linear (invariant_config) + activation.silu_and_mul
    f  mlp: gate_up_silu.gate_up_silu (fused)
Each timing is one CUDA graph replaying the variant over ``--layers`` distinct weight copies
(and KV caches), so weights come from HBM, not L2, and launch gaps count as in the engine's
step graphs (``bench_linear.graph_time``): us per call, the median of ``--reps`` replays. A
small sweep of block configs for c and f (their default among them) reports the best; once per
M, the fused outputs are compared with the unfused Triton path (bitwise, else the max abs diff)
and with cuBLAS's.

    PYTHONPATH=. python3 scripts/bench_fused_epilogues.py --tokens 64,128 --out fused.json

``--device cpu`` (Triton's interpreter, tiny shapes: ``--model-shape tiny --dtype float16``)
runs every variant and check once, untimed: the smoke test's path.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch
import torch.nn.functional as F
import triton
from bench_linear import graph_time

from aspire_ray.kernels.activation import silu_and_mul
from aspire_ray.kernels.gate_up_silu import gate_up_silu, gate_up_silu_config
from aspire_ray.kernels.linear import LinearConfig, invariant_config, triton_linear
from aspire_ray.kernels.qkv_rope import qkv_rope, qkv_rope_config
from aspire_ray.kernels.rope import rotary_embedding
from aspire_ray.model.rotary import RotaryEmbedding

# hidden K, q heads, kv heads, head dim, intermediate I, qkv bias, rope theta
SHAPES = {"qwen2.5-0.5b": (896, 14, 2, 64, 4864, True, 1e6), "tiny": (64, 4, 2, 32, 96, True, 1e4)}
PAGE_SIZE, MAX_POS = 16, 32768
QKV_SWEEP = [LinearConfig(64, bn, bk, w, s) for bn, bk, w, s in
             [(32, 64, 4, 4), (32, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
              (32, 128, 2, 4)]]  # fmt: skip
GU_SWEEP = [LinearConfig(64, bn, bk, w, s) for bn, bk, w, s in
            [(16, 64, 4, 4), (16, 64, 4, 3), (16, 128, 4, 4), (32, 128, 4, 3), (64, 64, 4, 4),
             (32, 64, 8, 4), (32, 64, 4, 3)]]  # fmt: skip


def diff(got, exp) -> dict:
    """Bitwise equality and the max abs difference of two tensors or tuples of tensors."""
    got, exp = (got,) if torch.is_tensor(got) else got, (exp,) if torch.is_tensor(exp) else exp
    d = max((g.float() - e.float()).abs().max().item() for g, e in zip(got, exp, strict=True))
    return {"equal": all(torch.equal(g, e) for g, e in zip(got, exp, strict=True)),
            "max_abs_diff": d}  # fmt: skip


class Layers:
    """``n`` layers' qkv and gate_up weights (and qkv biases, KV caches) and one step's inputs
    of ``m`` tokens: x [m, K], positions, slots (distinct, every page of the pool in play)."""

    def __init__(self, shape, n: int, m: int, dtype, device, gen) -> None:
        k, self.hq, self.hk, self.d, inter, bias, theta = shape
        nq = (self.hq + 2 * self.hk) * self.d
        rnd = lambda *s: (torch.randn(*s, generator=gen) * 0.05).to(dtype).to(device)
        self.w = [rnd(nq, k) for _ in range(n)]
        self.b = [rnd(nq) if bias else None for _ in range(n)]
        self.gu = [rnd(2 * inter, k) for _ in range(n)]
        pages = triton.cdiv(m, PAGE_SIZE) * 2
        self.caches = [rnd(pages, 2, PAGE_SIZE, self.hk, self.d) for _ in range(n)]
        self.x = (torch.randn(m, k, generator=gen)).to(dtype).to(device)
        self.pos = torch.randint(0, MAX_POS, (m,), generator=gen).to(device)
        self.slots = torch.randperm(pages * PAGE_SIZE, generator=gen)[:m].to(device)
        rope = RotaryEmbedding(self.d, theta, MAX_POS, None)
        self.cos, self.sin = rope.cos.to(device), rope.sin.to(device)
        self.q_out = torch.empty(m, self.hq, self.d, dtype=dtype, device=device)
        self.qkv_buf = torch.empty(m, nq, dtype=dtype, device=device)
        self.gu_buf = torch.empty(m, 2 * inter, dtype=dtype, device=device)

    def rope(self, qkv, i):
        """rotary_embedding over a [m, N] projection: q into q_out, k and v into cache i."""
        m, hq, hk, d = qkv.shape[0], self.hq, self.hk, self.d
        q, k, v = (s.view(m, -1, d) for s in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        q = rotary_embedding(self.pos, q, k, self.cos, self.sin, self.q_out,
                             kv=(v, self.caches[i], self.slots))  # fmt: skip
        return q, k, v

    def variants(self, qkv_cfg: LinearConfig, gu_cfg: LinearConfig) -> dict:
        """name -> fn(layer): the six variants of the module docstring."""
        inv_qkv, inv_gu = invariant_config(*self.w[0].shape), invariant_config(*self.gu[0].shape)
        return {
            "a_qkv_cublas_rope": lambda i: self.rope(F.linear(self.x, self.w[i], self.b[i]), i),
            "b_qkv_triton_rope": lambda i: self.rope(
                triton_linear(self.x, self.w[i], self.b[i], inv_qkv, out=self.qkv_buf), i),
            "c_qkv_rope_fused": lambda i: qkv_rope(
                self.x, self.w[i], self.b[i], self.pos, self.cos, self.sin, self.q_out,
                self.caches[i], self.slots, self.hq, self.hk, self.d, qkv_cfg),
            "d_mlp_cublas_silu": lambda i: silu_and_mul(F.linear(self.x, self.gu[i])),
            "e_mlp_triton_silu": lambda i: silu_and_mul(
                triton_linear(self.x, self.gu[i], cfg=inv_gu, out=self.gu_buf)),
            "f_gate_up_silu_fused": lambda i: gate_up_silu(self.x, self.gu[i], gu_cfg),
        }  # fmt: skip

    def outputs(self, fn) -> tuple:
        """fn(0)'s outputs, layer 0's cache after it (from the cache as it was) included."""
        before = self.caches[0].clone()
        out = fn(0)
        out = tuple(t.clone() for t in ((out,) if torch.is_tensor(out) else out))
        cache = self.caches[0].clone()
        self.caches[0].copy_(before)
        return out + ((cache,) if len(out) == 3 else ())


def run_tokens(args, m: int, dtype, device, timed: bool) -> dict:
    gen = torch.Generator().manual_seed(m)
    layers = Layers(SHAPES[args.model_shape], args.layers, m, dtype, device, gen)
    qkv_cfg = qkv_rope_config(*layers.w[0].shape)
    gu_cfg = gate_up_silu_config(*layers.gu[0].shape)
    fns = layers.variants(qkv_cfg, gu_cfg)
    outs = {name: layers.outputs(fn) for name, fn in fns.items()}
    checks = {
        "qkv_fused_vs_triton": diff(outs["c_qkv_rope_fused"], outs["b_qkv_triton_rope"]),
        "qkv_fused_vs_cublas": diff(outs["c_qkv_rope_fused"], outs["a_qkv_cublas_rope"]),
        "mlp_fused_vs_triton": diff(outs["f_gate_up_silu_fused"], outs["e_mlp_triton_silu"]),
        "mlp_fused_vs_cublas": diff(outs["f_gate_up_silu_fused"], outs["d_mlp_cublas_silu"]),
    }  # fmt: skip

    def timer(fn):
        return graph_time(fn, args.layers, args.reps) * 1e6 if timed else None

    us = {name: timer(fn) for name, fn in fns.items()}
    sweep = {"c_qkv_rope_fused": [], "f_gate_up_silu_fused": []}
    if args.sweep:
        swept = (("c_qkv_rope_fused", qkv_cfg, QKV_SWEEP, "b_qkv_triton_rope"),
                 ("f_gate_up_silu_fused", gu_cfg, GU_SWEEP, "e_mlp_triton_silu"))  # fmt: skip
        for name, default, cands, ref in swept:  # the default timed again beside the others
            for cfg in [default] + [c for c in cands if c != default]:
                fn = layers.variants(cfg, cfg)[name]
                try:
                    check = diff(layers.outputs(fn), outs[ref])
                    if check["max_abs_diff"] > 0.05:
                        raise AssertionError(f"wrong result: {check}")
                    t = timer(fn)
                except Exception as e:  # a config that does not compile or fit: skipped
                    print(f"  skip {name} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                sweep[name].append({"config": vars(cfg), "us": t, **check})
    if timed:
        for runs in sweep.values():
            runs.sort(key=lambda r: r["us"])
    return {"tokens": m, "us": us, "checks": checks, "sweep": sweep,
            "default_configs": {"c_qkv_rope_fused": vars(qkv_cfg),
                                "f_gate_up_silu_fused": vars(gu_cfg)}}  # fmt: skip


def table(results: list[dict]) -> str:
    names = list(results[0]["us"])
    lines = [f"{'variant':<22}" + "".join(f"{'M=' + str(r['tokens']):>10}" for r in results)]
    for name in names:
        lines.append(f"{name:<22}" + "".join(
            f"{r['us'][name]:10.2f}" if r["us"][name] is not None else f"{'-':>10}"
            for r in results))  # fmt: skip
    for r in results:
        for name, runs in r["sweep"].items():
            if runs and runs[0]["us"] is not None:
                best = runs[0]
                cfg = ",".join(str(v) for v in best["config"].values())
                lines.append(f"M={r['tokens']} best {name}: {best['us']:.2f} us ({cfg}: "
                             f"block_m,n,k,warps,stages; equal={best['equal']})")  # fmt: skip
        for name, c in r["checks"].items():
            lines.append(f"M={r['tokens']} {name}: equal={c['equal']} "
                         f"max_abs_diff={c['max_abs_diff']:.3g}")  # fmt: skip
    return "\n".join(lines)


def kernel_bench_args(description: str, shapes, shape: str,
                      layers: int) -> argparse.ArgumentParser:  # fmt: skip
    """The options of a per-layer kernel benchmark over weight copies in a CUDA graph (this
    script's, ``bench_fused_mlp.py``'s)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-shape", default=shape, choices=sorted(shapes))
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    p.add_argument("--layers", type=int, default=layers, help="weight copies a graph walks")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--device", default="cuda", help="cpu: Triton's interpreter, untimed")
    p.add_argument("--out", default=None)
    return p


def main() -> None:
    args = kernel_bench_args(__doc__.split("\n")[0], SHAPES, "qwen2.5-0.5b", 24).parse_args()
    device = torch.device(args.device)
    timed = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    results = [run_tokens(args, m, dtype, device, timed) for m in args.tokens]
    gpu = torch.cuda.get_device_name() if timed else None
    print(f"{gpu or 'cpu (untimed)'}; us per call, {args.model_shape} {args.dtype}, "
          f"{args.layers} layers a graph")  # fmt: skip
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu,
                       "torch": torch.__version__, "triton": triton.__version__,
                       "command": shlex.join([sys.executable, *sys.argv]), "args": vars(args),
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
