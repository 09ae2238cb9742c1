"""Triton linear layer for decode-sized batches: y = x @ W^T (+ bias).

Meaning: ``torch.nn.functional.linear``. Shapes (M rows, K in features, N out features):
    x:    [M, K]  bf16 / fp16 / fp32, last dim contiguous
    w:    [N, K]  x's dtype, last dim contiguous (nn.Linear's layout)
    bias: [N]     x's dtype (optional)
    out:  [M, N]  x's dtype

Why: a decode step's GEMMs are skinny (M = the step's tokens, 64 in a batch-64 draft step) and
memory-bound; cuBLAS runs Qwen2.5-0.5B's qkv and o projections (2 MB and 1.6 MB of weights) in
~4.5 us each, ~10x their bytes (docs/benchmarks.md §8.28). Here every program owns BLOCK_N
output columns of BLOCK_M rows and streams its slice of W once, accumulating in float32 over K
in BLOCK_K chunks in one fixed order: a row's output does not depend on M or on the other rows
(for one LinearConfig), which the deterministic mode wants too (issue 18).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl


@dataclass(frozen=True)
class LinearConfig:
    block_m: int = 64
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def invariant_config(n: int, k: int) -> LinearConfig:
    """The deterministic mode's tiling of a [n, k] weight (issue 18): chosen by the weight's
    shape only, never by the row count, so every row of any batch accumulates over K in one
    fixed sequence of BLOCK_K chunks (tests/kernels/test_linear.py). Narrow weights take narrow
    column tiles so that a 64-row step still spreads over the SMs (qkv and o of Qwen2.5-0.5B:
    28-36 programs; scripts/bench_linear.py's best at 64 rows, docs/benchmarks.md §8.28)."""
    if n <= 2048:
        return LinearConfig(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=4)
    return LinearConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)


def dot_precision(x: torch.Tensor) -> str:
    """tl.dot's input precision for x's dtype: float32 as float32 ("ieee"; the default, tf32,
    rounds float32 inputs to 10 mantissa bits on a GPU), 16-bit types as they are."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def check_xw(x: torch.Tensor, w: torch.Tensor, w_rows: str = "N") -> None:
    """A GEMM's operands: x [M, K], w [w_rows, K] (nn.Linear's layout), both with a contiguous
    last dim, of one dtype on one device."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K] and w [{w_rows}, K], got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")  # fmt: skip
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need a contiguous last dim")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w must be {x.dtype} on {x.device}, got {w.dtype} on {w.device}")


@triton.jit
def dot_two(x_rows, m_ok, w_a, w_b, col_ok, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Two [BLOCK_M, BLOCK_N] float32 products of one x tile, K in BLOCK_K chunks in
    ``_linear_kernel``'s order: x_rows [BM, 1] row pointers, w_a / w_b [1, BN] weight-row
    pointers (the epilogue's two operands: RoPE's halves of a head, SiLU's gate and up)."""
    rk = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wa = tl.load(w_a + k[:, None], mask=w_mask, other=0.0)
        wb = tl.load(w_b + k[:, None], mask=w_mask, other=0.0)
        acc_a = tl.dot(x, wa, acc_a, input_precision=PRECISION)  # [BM, BK] @ [BK, BN]
        acc_b = tl.dot(x, wb, acc_b, input_precision=PRECISION)
    return acc_a, acc_b


@triton.jit
def dot_one(x_rows, m_ok, w_cols, n_ok, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """x_rows [BM, 1] row pointers times w_cols [1, BN] weight-row pointers over K, in BLOCK_K
    chunks in one fixed order -> [BLOCK_M, BLOCK_N] float32 (``dot_two``: two products)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [BM, BK] @ [BK, BN]
    return acc


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + rn[None, :] * stride_wn  # [1, BN]
    if USE_GDC:  # kernels/pdl.py: this program's weight rows asked of L2, then the step's data
        pdl.prefetch_rows(w_ptr + tl.minimum(rn, N - 1) * stride_wn, K)
        tl.extra.cuda.gdc_wait()
    acc = dot_one(x_rows, m_ok, w_cols, n_ok, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def triton_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  cfg: LinearConfig = LinearConfig(), out: torch.Tensor | None = None,
                  ) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (written into out if given)."""
    check_xw(x, w)
    m, k = x.shape
    n = w.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be {x.dtype} [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be {x.dtype} [{m}, {n}] with a contiguous last dim")
    if m == 0:
        return out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _linear_kernel[grid](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, PRECISION=dot_precision(x), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_options(x.device),
    )  # fmt: skip
    return out
