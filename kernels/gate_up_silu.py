"""The MLP's gate/up projection with SiLU-and-multiply in its epilogue: one launch for two.

Meaning: ``activation.silu_and_mul(F.linear(x, w))``. Shapes (M rows, K hidden, I intermediate):
    x:   [M, K]   bf16 / fp16 / fp32, last dim contiguous
    w:   [2I, K]  x's dtype, last dim contiguous: gate rows, then up rows
                  (``MergedColumnParallelLinear``'s layout)
    out: [M, I]   x's dtype: silu(gate) * up

Rounding is the unfused path's: gate and up each rounded to x's dtype, silu computed in float32
from the rounded gate and rounded to x's dtype, the product in float32 rounded once.

Why: a CUDA-graph decode step's layers are latency-bound small kernels (~2-3 us each on an
H100 whatever their bytes, docs/benchmarks.md §8.28); this drops the activation's launch and
the [M, 2I] intermediate's write and read. A program owns BLOCK_N columns j of gate and the
same j of up, as two accumulators (two tl.dot per K chunk), so it holds both operands of its
products. The K loop is ``kernels.linear``'s (one fixed order of BLOCK_K chunks, tiling by the
weight's shape): a row's output does not depend on M or the other rows, and with
``gate_up_silu_config`` it streams K as ``invariant_config`` does.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import pdl
from .linear import LinearConfig, check_xw, dot_precision, dot_two, invariant_config


def gate_up_silu_config(n: int, k: int) -> LinearConfig:
    """The tiling of a [n = 2I, k] gate/up weight, by its shape only (batch invariance): the
    deterministic mode's ``invariant_config`` with BLOCK_N halved, so that a program streams
    as many weight rows (BLOCK_N of gate + BLOCK_N of up) in the same K chunks. Qwen2.5-0.5B's
    [9728, 896]: BLOCK_N 32, 152 programs a 64-row tile."""
    cfg = invariant_config(n, k)
    return replace(cfg, block_n=cfg.block_n // 2)


@triton.jit
def silu_mul(acc_g, acc_u, dt: tl.constexpr):
    """silu(gate) * up of float32 products, rounded as the unfused path rounds: gate and up to
    dt (as F.linear), silu in float32 from the rounded gate, rounded, the product once."""
    g = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # kernels.activation's op order
    return (silu * up).to(dt)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok, n_ok = rm < M, rn < N  # N = I: gate's (and up's) columns
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    w_gate = w_ptr + rn[None, :] * stride_wn  # [1, BN]
    w_up = w_gate + N * stride_wn  # up's row j: w's row I + j
    if USE_GDC:  # kernels/pdl.py: this program's gate and up rows asked of L2, then step data
        gate_rows = w_ptr + tl.minimum(rn, N - 1) * stride_wn
        pdl.prefetch_rows(gate_rows, K)
        pdl.prefetch_rows(gate_rows + N * stride_wn, K)
        tl.extra.cuda.gdc_wait()
    acc_g, acc_u = dot_two(x_rows, m_ok, w_gate, w_up, n_ok, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           PRECISION)  # fmt: skip
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, silu_mul(acc_g, acc_u, y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, cfg: LinearConfig | None = None,
                 ) -> torch.Tensor:  # fmt: skip
    """x [M, K], w [2I, K] -> silu(x @ w[:I]^T) * (x @ w[I:]^T) as a new [M, I] tensor. cfg:
    block_n = output columns a program owns (of gate and of up); None: ``gate_up_silu_config``."""
    check_xw(x, w, "2I")
    if w.shape[0] % 2:
        raise ValueError(f"need x [M, K] and w [2I, K] (gate rows, then up), got "
                         f"{tuple(w.shape[0:1])} rows")  # fmt: skip
    m, k = x.shape
    n = w.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = cfg or gate_up_silu_config(*w.shape)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _gate_up_silu_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, PRECISION=dot_precision(x), **pdl.launch_options(x.device),
    )  # fmt: skip
    return out
