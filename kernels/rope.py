"""Triton rotary position embedding (neox / HF rotate-half layout) for q and k in one launch.

Meaning: ``reference.rotary_ref``. Shapes (T tokens, Hq/Hkv heads, D head dim):
    positions: int64 [T]
    q:         [T, Hq, D]    bf16 / fp16 / fp32, last dim contiguous (may be a view of a fused
                             qkv projection); rotated in place, or into q_out
    k:         [T, Hkv, D]   q's dtype, last dim contiguous; rotated in place
    cos, sin:  float32 [max_positions, D/2], contiguous
    q_out:     [T', Hq, D] with T' >= T, q's dtype, last dim contiguous (optional)

Computed in float32 and rounded once to the input dtype, like ``RotaryEmbedding``'s torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src, dst, stride_sh, stride_dh, cos, sin,
                  HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):  # fmt: skip
    h = tl.arange(0, HEADS_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (j < HALF)
    s = src + h * stride_sh + j
    x1 = tl.load(s, mask=mask, other=0.0)
    x2 = tl.load(s + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    d = dst + h * stride_dh + j
    tl.store(d, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(d + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, qo_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_ot, stride_oh,
    HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    j = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + pos * HALF + j, mask=j < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + j, mask=j < HALF, other=0.0)
    _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_ot, stride_qh, stride_oh, cos, sin,
                  HQ, HQ_PAD, HALF, HALF_PAD)  # fmt: skip
    _rotate_heads(k_ptr + t * stride_kt, k_ptr + t * stride_kt, stride_kh, stride_kh, cos, sin,
                  HK, HK_PAD, HALF, HALF_PAD)  # fmt: skip


def _check(name: str, x: torch.Tensor, t: int, d: int, dtype: torch.dtype, device) -> None:
    if x.dim() != 3 or x.shape[0] < t or x.shape[2] != d or x.stride(2) != 1:
        raise ValueError(f"{name} must be [{t}, H, {d}] with a contiguous last dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if x.dtype != dtype or x.device != device:
        raise ValueError(f"{name} must be {dtype} on {device}, got {x.dtype} on {x.device}")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, q_out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rotate k in place and q in place (or into q_out[:T]); returns the rotated q."""
    t, hq, d = q.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if positions.shape != (t,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{t}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")  # fmt: skip
    _check("q", q, t, d, q.dtype, q.device)
    _check("k", k, t, d, q.dtype, q.device)
    if k.shape[0] != t:
        raise ValueError(f"k has {k.shape[0]} tokens, q has {t}")
    out = q if q_out is None else q_out
    _check("q_out", out, t, d, q.dtype, q.device)
    if out.shape[1] != hq:
        raise ValueError(f"q_out has {out.shape[1]} heads, q has {hq}")
    half = d // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.shape[1:] != (half,) or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [P, {half}] table, got "
                             f"{table.dtype} {tuple(table.shape)}")  # fmt: skip
    if t == 0:
        return out[:0]
    hk = k.shape[1]
    _rope_kernel[(t,)](
        positions, q, k, out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out.stride(0), out.stride(1), HQ=hq, HK=hk, HQ_PAD=triton.next_power_of_2(hq),
        HK_PAD=triton.next_power_of_2(hk), HALF=half, HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )  # fmt: skip
    return out[:t]
