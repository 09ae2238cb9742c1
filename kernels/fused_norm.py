"""Triton RMSNorm, optionally fused with the residual add before it (one launch instead of ~8).

Meaning: ``reference.rms_norm_ref``. Shapes (M rows, H heads, N features):
    x:        [M, N] or [M, H, N]  bf16 / fp16 / fp32, last dim contiguous ([M, H, N]: per-head
                                    norms such as Qwen3's q/k norm)
    weight:   [N]                   x's dtype
    residual: [M, N]                x's dtype, contiguous; updated in place to residual + x, and
                                    the norm is taken of that sum (vLLM's fused_add_rms_norm)
    out:      x's shape, contiguous

Rounding follows transformers' LlamaRMSNorm: the sum is rounded to x's dtype, statistics are
fp32, the normalised value is rounded to x's dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_xm, stride_xh, stride_rm, eps,
    HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    m = (pid // HEADS).to(tl.int64)
    h = pid % HEADS
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if USE_GDC:  # kernels/pdl.py: the weight (a parameter) before the wait, then the step's data
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + m * stride_xm + h * stride_xh + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r_ptrs = res_ptr + m * stride_rm + cols
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.math.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    if not USE_GDC:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * normed
    tl.store(out_ptr + pid.to(tl.int64) * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, N] or [M, H, N] -> RMSNorm(x (+ residual)) of x's shape; residual += x in place."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, N] or [M, H, N] with a contiguous last dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{n}] {x.dtype} on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")  # fmt: skip
    if residual is not None and (
        x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype
        or residual.stride(-1) != 1 or residual.device != x.device
    ):  # fmt: skip
        raise ValueError(f"residual must match x [M, N] {x.dtype} with a contiguous last dim, "
                         f"got {tuple(residual.shape)} {residual.dtype}")  # fmt: skip
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    if rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, x.stride(0),
        x.stride(1) if x.dim() == 3 else 0, residual.stride(0) if residual is not None else 0,
        eps, HEADS=heads, N=n, BLOCK=block, ADD_RESIDUAL=residual is not None,
        num_warps=min(8, max(1, block // 256)), **pdl.launch_options(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _rms_norm_parts_kernel(
    p_ptr, res_ptr, w_ptr, out_ptr, S, stride_ps, stride_pm, stride_rm, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, S_CHUNK: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if USE_GDC:  # kernels/pdl.py: the weight (a parameter) before the wait, then the step's data
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    # S_CHUNK slices a load, so that their L2 reads are in flight together (one slice a
    # dependent load would pay L2's latency S times); one fixed order for a given S
    for s0 in range(0, S, S_CHUNK):
        s = s0 + tl.arange(0, S_CHUNK)
        tile = tl.load(p_ptr + s[:, None] * stride_ps + m * stride_pm + cols[None, :],
                       mask=(s < S)[:, None] & mask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(tile, axis=0)
    r_ptrs = res_ptr + m * stride_rm + cols
    r = tl.load(r_ptrs, mask=mask, other=0.0)
    dt = r.dtype
    x = acc.to(dt)  # the MLP's output as its down projection would round it
    x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
    if not USE_GDC:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * N + cols, (w * normed).to(dt), mask=mask)


def rms_norm_parts(parts: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """parts float32 [S, M, N] (``mlp_partials``) -> RMSNorm(sum(parts) + residual) [M, N] in
    residual's dtype; residual += sum(parts) in place (the sum rounded to residual's dtype
    first, as the MLP's output would be). The sum's order is fixed for a given S (chunks of
    slices, each summed as a tree), not ``rms_norm_parts_ref``'s one by one."""
    if parts.dim() != 3 or parts.dtype != torch.float32 or parts.stride(-1) != 1:
        raise ValueError(f"parts must be float32 [S, M, N] with a contiguous last dim, got "
                         f"{tuple(parts.shape)} {parts.dtype}")  # fmt: skip
    s, m, n = parts.shape
    if residual.shape != (m, n) or residual.stride(-1) != 1 or residual.device != parts.device:
        raise ValueError(f"residual must be [{m}, {n}] with a contiguous last dim, got "
                         f"{tuple(residual.shape)}")  # fmt: skip
    if weight.shape != (n,) or weight.dtype != residual.dtype:
        raise ValueError(f"weight must be [{n}] {residual.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")  # fmt: skip
    out = torch.empty(m, n, dtype=residual.dtype, device=residual.device)
    if m == 0:
        return out
    block = triton.next_power_of_2(n)
    s_chunk = max(1, min(triton.next_power_of_2(s), 8192 // block))  # <= 8k floats a load
    _rms_norm_parts_kernel[(m,)](
        parts, residual, weight, out, s, parts.stride(0), parts.stride(1), residual.stride(0),
        eps, N=n, BLOCK=block, S_CHUNK=s_chunk, num_warps=min(8, max(1, block * s_chunk // 1024)),
        **pdl.launch_options(parts.device),
    )  # fmt: skip
    return out
