"""Paper-shape step costs: AR, sparse draft and verify steps at 16k-100k contexts, random weights.

For each architecture (Qwen3-1.7B, Qwen3-8B, DeepSeek-R1-Distill-Llama-8B shapes) and context,
B requests are placed at that context and three kinds of step are timed on the engine's own
worker (CUDA graphs on, as in serving):
    ar      one decode row per request over all its KV (a verify row with d = 0)
    draft   one draft row per request over its sparse pages S_i (k_i = max(k_min, rho * P_i)),
            with the refresh layer's scoring and re-selection (spec mode aspire_fixed)
    verify  one verify row of gamma drafts per request (gamma + 1 query tokens, all KV)
c = draft / ar is the cost ratio of DESIGN.md §1.5. The KV contents do not change these costs,
so no prompt is prefilled: each request gets its pages and one real prefill token at position
ctx - 1 (the earlier KV stays zero). This makes 100k contexts affordable.

PROJECTION (not a measurement of decoding): with a mean accepted length L (tokens committed per
verification, measured on a real model elsewhere), the speedup of drafting gamma tokens then
verifying is  L * t_ar / (gamma * t_draft + t_verify).  Pass ``--accepted-length`` values,
e.g. from scripts/bench_decode.py's JSON, to get it per shape and context.

    python scripts/bench_cost.py --shapes qwen3-1.7b qwen3-8b llama-8b \
        --contexts 16384 32768 100000 --out docs/bench_cost_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time

import torch
from bench_tp import SHAPES

from aspire_ray.engine.calibration import _GREEDY, Sweep, SweepRunner
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import RowKind, RowPlan, StepPlan

# CPU smoke runs of this script (--shapes tiny --device cpu --dtype float32)
TINY = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


class TailOnlyRunner(SweepRunner):
    """SweepRunner whose synthetic requests skip the prefill: pages + one token at ctx - 1."""

    def requests(self, ctx: int, n: int) -> list[str]:
        ids = [f"__cost-{ctx}-{i}" for i in range(n)]
        rows = []
        for rid in ids:
            pages = self.blocks.allocate(rid, self._pages_per_request(ctx))
            self._owned[rid] = pages
            rows.append(RowPlan(rid, RowKind.PREFILL, [self._token()], ctx - 1, 0, list(pages),
                                sample=False))
        self._execute(StepPlan(self._next_id(), rows, {rid: _GREEDY for rid in ids}))
        return ids


def make_plan(runner: SweepRunner, kind: str, ids: list[str], ctx: int, gamma: int) -> StepPlan:
    if kind == "draft":
        return runner.draft_plan(ids, ctx)
    return runner.verify_plan(ids, ctx, 0 if kind == "ar" else gamma)


def time_plan(runner: SweepRunner, kind: str, ids: list[str], ctx: int, args) -> dict:
    """Median wall time of executing a plan (driver view, incl. launches) and of the forward."""
    walls, fwds = [], []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(args.repeats + 2):  # two warm-ups: graph capture of the bucket, allocator
        plan = make_plan(runner, kind, ids, ctx, args.gamma)
        sync()
        t0 = time.perf_counter()
        out = runner._execute(plan)
        sync()
        if i >= 2:
            walls.append(time.perf_counter() - t0)
            fwds.append(out.timings.forward)
    return {"wall_ms": 1e3 * statistics.median(walls), "forward_ms": 1e3 * statistics.median(fwds)}


def batch_for(shape: dict, ctx: int, dtype_bytes: int, budget_bytes: float, cap: int) -> int:
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim
    return max(1, min(cap, int(budget_bytes // (per_token * dtype_bytes * (ctx + 64)))))


def run_shape(name: str, args) -> list[dict]:
    shape = dict(SHAPES.get(name, TINY),
                 max_position_embeddings=max(max(args.contexts) + 256, 8192))
    max_ctx = max(args.contexts)
    budget = args.kv_gib * 2**30
    elt = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    b_max = max(batch_for(shape, c, elt, budget, args.max_batch) for c in args.contexts)
    # requests of one context at a time: the pool holds the largest of those sets
    pages = 16 + max(batch_for(shape, c, elt, budget, args.max_batch)
                     * math.ceil((c + args.gamma + 2) / 16) for c in args.contexts)
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=shape,
                              device=args.device, dtype=args.dtype, spec_mode="aspire_fixed",
                              calibrate="off", num_pages=pages, max_num_seqs=b_max,
                              max_model_len=max_ctx + 256, gamma=args.gamma,
                              max_num_batched_tokens=max(8192, b_max * (args.gamma + 1)))
    engine = LLMEngine(cfg)
    runner = TailOnlyRunner(engine, Sweep(contexts=tuple(args.contexts), batches=(1,),
                                          drafts=(args.gamma,)))
    results = []
    try:
        for ctx in args.contexts:
            b = batch_for(shape, ctx, elt, budget, args.max_batch)
            ids = runner.requests(ctx, b)
            r = {"shape": name, "context": ctx, "batch": b,
                 "sparse_tokens_per_row": engine.policy.sparse_tokens(ctx),
                 **{kind: time_plan(runner, kind, ids, ctx, args)
                    for kind in ("ar", "draft", "verify")}}
            runner.release()
            for key in ("wall_ms", "forward_ms"):
                r[f"c_{key}"] = r["draft"][key] / r["ar"][key]
            t_ar, t_d, t_v = (r[k]["wall_ms"] for k in ("ar", "draft", "verify"))
            r["projected_speedup"] = {str(L): L * t_ar / (args.gamma * t_d + t_v)
                                      for L in args.accepted_length}
            results.append(r)
            print(f"{name:11s} ctx={ctx:6d} B={b:3d}  ar {t_ar:7.2f} ms  draft {t_d:7.2f} ms  "
                  f"verify(d={args.gamma}) {t_v:7.2f} ms  c={r['c_wall_ms']:.3f} "
                  f"(forward-only c={r['c_forward_ms']:.3f})  projected: " + " ".join(
                      f"L={L}: {s:.2f}x" for L, s in r["projected_speedup"].items()), flush=True)
    finally:
        runner.release()
        engine.shutdown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-1.7b", "qwen3-8b", "llama-8b"],
                   choices=sorted(SHAPES) + ["tiny"])
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 100000])
    p.add_argument("--gamma", type=int, default=10, help="drafts per verification")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--kv-gib", type=float, default=80.0, help="KV budget that sets the batch")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--accepted-length", type=float, nargs="+", default=[4.0, 6.0],
                   help="mean accepted lengths to project with (measured elsewhere)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    for name in args.shapes:
        results += run_shape(name, args)
        gc.collect()  # the engine's captured graphs and KV pool are freed only now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results,
                       "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                       else "cpu"}, f, indent=1)


if __name__ == "__main__":
    main()
