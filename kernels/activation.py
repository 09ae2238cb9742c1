"""Triton SiLU-and-multiply of the fused gate/up projection (one launch instead of three).

Meaning: ``reference.silu_and_mul_ref``. Shapes (M rows, I intermediate features):
    x:   [M, 2I]  bf16 / fp16 / fp32, last dim contiguous: gate = x[:, :I], up = x[:, I:]
    out: [M, I]   x's dtype, contiguous: silu(gate) * up, silu rounded to x's dtype first
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xm, N: tl.constexpr, BLOCK: tl.constexpr,
                         USE_GDC: tl.constexpr):  # fmt: skip
    if USE_GDC:  # kernels/pdl.py: everything here is the step's data
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + m * stride_xm + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + m * N + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] -> silu(x[:, :I]) * x[:, I:] as a new [M, I] tensor."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, 2I] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")  # fmt: skip
    m, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(m, triton.cdiv(n, block))](x, out, x.stride(0), N=n, BLOCK=block,
                                                      num_warps=4,
                                                      **pdl.launch_options(x.device))  # fmt: skip
    return out
