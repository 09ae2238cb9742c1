"""Triton argmax over the vocabulary of a few rows of logits: the greedy tokens of a step.

Meaning: ``torch.argmax(x, dim=-1)`` (the first index of the largest value). Shapes:
    x:   [T, V]  bf16 / fp16 / fp32, last dim contiguous (rows may be strided: a view of the
                 LM head's padded output)
    out: int64 [T]

Why: a decode step takes the argmax of T = 64-128 rows of 152k logits. torch's reduction runs
a row per block of threads, so 64 rows keep 64 SMs streaming ~300 KB each: 21.8 us for ~20 MB
on an H100, 8.3 us here (docs/benchmarks.md §8.35). Here stage 1 cuts every row into BLOCK-wide
chunks, one program each (T x V / BLOCK programs over every SM), each writing its chunk's
largest value and the first index of it; stage 2 takes, per row, the largest of those, the
first chunk on a tie, so the index is the first of the row's largest values. NaN is taken as
+inf (torch ranks NaN above every number; logits hold none).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits a stage-1 program reads: 37 chunks a row of Qwen2.5's 151,936


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, V, stride_xt, n_chunks,
                      BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(x_ptr + t * stride_xt + cols, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN as +inf
    best = tl.max(x, 0)
    first = tl.min(tl.where((x == best) & ok, cols, 2147483647), 0)
    tl.store(val_ptr + t * n_chunks + c, best)
    tl.store(idx_ptr + t * n_chunks + c, first)


@triton.jit
def _row_max_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = c < n_chunks
    val = tl.load(val_ptr + t * n_chunks + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + t * n_chunks + c, mask=ok, other=2147483647)
    best = tl.max(val, 0)
    # chunks are in column order: the smallest index among the largest is the row's first
    tl.store(out_ptr + t, tl.min(tl.where((val == best) & ok, idx, 2147483647), 0).to(tl.int64))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, V] -> int64 [T], the first index of each row's largest value (into out if given)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, V] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")  # fmt: skip
    t, v = x.shape
    if v == 0 or v >= 2**31:
        raise ValueError(f"need 0 < V < 2**31 columns, got {v}")
    if out is None:
        out = torch.empty(t, dtype=torch.int64, device=x.device)
    elif out.shape != (t,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 [{t}], got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    if t == 0:
        return out
    n_chunks = triton.cdiv(v, BLOCK)
    val = torch.empty(t, n_chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(t, n_chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(t, n_chunks)](x, val, idx, v, x.stride(0), n_chunks, BLOCK=BLOCK,
                                     num_warps=8)  # fmt: skip
    _row_max_kernel[(t,)](val, idx, out, n_chunks, CHUNKS=triton.next_power_of_2(n_chunks),
                          num_warps=1)  # fmt: skip
    return out
