"""The whole MLP of a decode step in one launch: gate/up, SiLU-and-multiply and down, the down
projection's sum over the intermediate left as per-slice partials for the next norm to add.

Meaning: ``down(silu_and_mul(gate_up(x)))`` = ``mlp_partials(x, w_gu, w_d).sum(0)``, rounded.
Shapes (M rows, H hidden, I intermediate, S = ceil(I / BLOCK_I) slices):
    x:    [M, H]     bf16 / fp16 / fp32, last dim contiguous
    w_gu: [2I, H]    x's dtype: gate rows, then up rows (``MergedColumnParallelLinear``)
    w_d:  [H, I]     x's dtype (``RowParallelLinear``'s nn.Linear layout)
    out:  [S, M, H]  float32: slice s's product a[:, s] @ w_d[:, s]^T, where
                     a = silu(x @ gate^T) * (x @ up^T) rounded as ``gate_up_silu`` rounds it

Why: a small model's decode step is ~9 latency-bound launches a layer (SmolLM2-135M at 8k,
batch 64, on an H200: a draft step 43 us a layer for ~9 us of bytes, docs/benchmarks.md §8.36).
A program here owns BLOCK_I columns of the intermediate for BLOCK_M rows: it computes them
(``gate_up_silu``'s product and epilogue), keeps them in registers, and multiplies them by the
matching BLOCK_I columns of w_d, writing a [BLOCK_M, H] float32 partial. The partials' sum, in
slice order, is the next RMSNorm's (``fused_norm.rms_norm_parts``): the down projection's own
launch and cuBLAS's split-K reduce are gone, and no [M, I] intermediate is written or read.
The partials cost S x M x H x 4 bytes of writes and reads (SmolLM2's 24 x 64 x 576: 3.5 MB,
L2-resident); for wide hidden sizes a wider BLOCK_I keeps them small.

Not batch-invariant across paths (the unfused path rounds the down projection's cuBLAS sum):
the deterministic mode keeps the separate kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gate_up_silu import silu_mul
from .linear import check_xw, dot_precision, dot_two


@dataclass(frozen=True)
class MLPConfig:
    block_m: int = 64  # rows a program owns
    block_i: int = 64  # intermediate columns a program owns (a slice: one partial)
    block_k: int = 64  # hidden chunk of the gate/up product
    block_n: int = 64  # hidden chunk of the down product (the partial's columns)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_i", "block_k", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


DEFAULT_MLP_CONFIG = MLPConfig()


@triton.jit
def _mlp_partials_kernel(
    x_ptr, gu_ptr, d_ptr, p_ptr, M, N_I, H, stride_xm, stride_gu, stride_d, stride_ps, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_i = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ri = (pid_i * BLOCK_I + tl.arange(0, BLOCK_I)).to(tl.int64)
    m_ok, i_ok = rm < M, ri < N_I  # N_I: the intermediate size
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    w_gate = gu_ptr + ri[None, :] * stride_gu  # [1, BI]
    w_up = w_gate + N_I * stride_gu  # up's row j: w_gu's row I + j
    acc_g, acc_u = dot_two(x_rows, m_ok, w_gate, w_up, i_ok, H, BLOCK_M, BLOCK_I, BLOCK_K,
                           PRECISION)  # fmt: skip
    # [BM, BI]; columns past I are 0 (their weights loaded as 0)
    a = silu_mul(acc_g, acc_u, x_ptr.dtype.element_ty)
    part = p_ptr + pid_i * stride_ps + rm[:, None] * stride_pm  # [BM, 1]
    for n0 in range(0, H, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < H
        # w_d[n, i] for the slice's i: [BI, BN], so that a @ it is [BM, BN]
        wd = tl.load(d_ptr + rn[None, :].to(tl.int64) * stride_d + ri[:, None],
                     mask=i_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        out = tl.dot(a, wd, input_precision=PRECISION)
        tl.store(part + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def mlp_partials(x: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor,
                 cfg: MLPConfig | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, H], w_gu [2I, H], w_d [H, I] -> float32 [S, M, H]: each BLOCK_I slice of the
    intermediate's share of the down projection (their sum is the MLP's output). cfg: None,
    ``DEFAULT_MLP_CONFIG``."""
    cfg = cfg or DEFAULT_MLP_CONFIG
    check_xw(x, w_gu, "2I")
    if w_gu.shape[0] % 2:
        raise ValueError(f"w_gu needs an even row count (gate rows, then up), got "
                         f"{w_gu.shape[0]}")  # fmt: skip
    m, h = x.shape
    i = w_gu.shape[0] // 2
    if w_d.shape != (h, i) or w_d.stride(1) != 1 or w_d.dtype != x.dtype:
        raise ValueError(f"w_d must be [{h}, {i}] {x.dtype} with a contiguous last dim, got "
                         f"{tuple(w_d.shape)} {w_d.dtype}")  # fmt: skip
    slices = triton.cdiv(i, cfg.block_i)
    out = torch.empty(slices, m, h, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    _mlp_partials_kernel[(slices, triton.cdiv(m, cfg.block_m))](
        x, w_gu, w_d, out, m, i, h, x.stride(0), w_gu.stride(0), w_d.stride(0), out.stride(0),
        out.stride(1), BLOCK_M=cfg.block_m, BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k,
        BLOCK_N=cfg.block_n, PRECISION=dot_precision(x), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
