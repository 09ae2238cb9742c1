"""Time a decode step's small per-forward kernels on one GPU, side by side in one run.

- greedy tokens: ``torch.argmax`` against ``kernels.argmax.argmax_rows`` over T rows of a
  152k-vocabulary bf16 LM head output (a view of its padded width, as the model hands it);
- the plan kernel (``FixedPlan.load_rows``, one launch): the current ``kernels/plan_kernel.py``
  and, with ``--baseline-plan-kernel FILE``, another version of that file (an older commit's),
  on a mixed step's rows: ``--verify-rows`` rows of 6 queries over the whole context and the
  rest draft rows of one query over ``--draft-pages`` pages.

Each variant is captured in a CUDA graph of ``--inner`` calls and replayed ``--repeats`` times;
the median a call is reported (us). JSON with ``--out``.

    python3 scripts/bench_step_kernels.py --baseline-plan-kernel /tmp/old_plan_kernel.py \\
        --out docs/bench_step_kernels_h200_s27.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from bench_kernels import load_module
from bench_linear import graph_time

from aspire_ray.kernels import paged_attention
from aspire_ray.kernels.argmax import argmax_rows
from aspire_ray.kernels.paged_attention import FixedPlan

PAGE_SIZE = 16


def graph_us(fn, inner: int, repeats: int) -> float:
    """Median microseconds a call of fn, replayed in a CUDA graph of ``inner`` calls."""
    return 1e6 * graph_time(lambda i: fn(), inner, repeats)


def bench_argmax(tokens: int, vocab: int, padded: int, inner: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, padded, generator=gen, device="cuda").bfloat16()[:, :vocab]
    out = torch.empty(tokens, dtype=torch.int64, device="cuda")
    same = torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    return {"tokens": tokens, "vocab": vocab, "same_as_torch": same,
            "torch_us": graph_us(lambda: torch.argmax(logits, dim=-1), inner, repeats),
            "triton_us": graph_us(lambda: argmax_rows(logits, out), inner, repeats)}  # fmt: skip


def bench_plan(rows: int, verify_rows: int, context: int, draft_pages: int,
               baseline: str | None, inner: int, repeats: int) -> dict:  # fmt: skip
    full = -(-context // PAGE_SIZE)
    pages = np.array([full] * verify_rows + [draft_pages] * (rows - verify_rows))
    n_q = torch.tensor([6] * verify_rows + [1] * (rows - verify_rows), device="cuda")
    indptr = torch.tensor([0, *np.cumsum(pages).tolist()], dtype=torch.int32, device="cuda")
    last = torch.full((rows,), 7, dtype=torch.int32, device="cuda")
    plan = FixedPlan.for_rows(rows, int(n_q.sum()), 6, int(pages.sum()), 14, 2, 64,
                              torch.device("cuda"), wide_tiles=True)  # fmt: skip
    if not plan.fused_planning:
        raise SystemExit("this GPU's plan is not planned by the plan kernel")
    load = lambda: plan.load_rows(indptr, last, n_q, PAGE_SIZE)  # noqa: E731
    result = {"rows": rows, "verify_rows": verify_rows, "context": context,
              "draft_pages": draft_pages, "current_us": graph_us(load, inner, repeats)}  # fmt: skip
    load()
    current = plan.buffer.clone()
    if baseline is not None:
        current_into = paged_attention.plan_into
        paged_attention.plan_into = load_module(
            baseline, "aspire_ray.kernels._baseline_plan_kernel").plan_into
        try:
            result["baseline_us"] = graph_us(load, inner, repeats)
            plan.buffer.zero_()
            load()
            result["same_lists_as_baseline"] = bool(torch.equal(plan.buffer, current))
        finally:
            paged_attention.plan_into = current_into
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,128", help="argmax rows, comma-separated")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--padded-vocab", type=int, default=152064)
    p.add_argument("--rows", default="64,319", help="plan rows, comma-separated")
    p.add_argument("--verify-frac", type=float, default=0.17, help="rows that verify")
    p.add_argument("--context", type=int, default=32000)
    p.add_argument("--draft-pages", type=int, default=140)
    p.add_argument("--baseline-plan-kernel", default=None, help="another plan_kernel.py")
    p.add_argument("--inner", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "argmax": [], "plan": []}  # fmt: skip
    for t in map(int, a.tokens.split(",")):
        result["argmax"].append(bench_argmax(t, a.vocab, a.padded_vocab, a.inner, a.repeats))
        print(result["argmax"][-1], flush=True)
    for r in map(int, a.rows.split(",")):
        v = max(1, round(r * a.verify_frac))
        result["plan"].append(bench_plan(r, v, a.context, a.draft_pages,
                                         a.baseline_plan_kernel, a.inner, a.repeats))  # fmt: skip
        print(result["plan"][-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
