"""Triton rotary position embedding (neox / HF rotate-half layout) for q and k in one launch.

Meaning: ``reference.rotary_ref``. Shapes (T tokens, Hq/Hkv heads, D head dim):
    positions: int64 [T]
    q:         [T, Hq, D]    bf16 / fp16 / fp32, last dim contiguous (may be a view of a fused
                             qkv projection); rotated in place, or into q_out
    k:         [T, Hkv, D]   q's dtype, last dim contiguous; rotated in place
    cos, sin:  float32 [max_positions, D/2], contiguous
    q_out:     [T', Hq, D] with T' >= T, q's dtype, last dim contiguous (optional)

Computed in float32 and rounded once to the input dtype, like ``RotaryEmbedding``'s torch path.

With ``kv = (v, kv_cache, slot_mapping)`` the same launch also stores the rotated k and v at
their slots (``kv_store.store_kv``'s layout and meaning, a negative slot skipped): one kernel a
layer fewer in the CUDA-graph steps, whose layers are latency-bound small kernels
(docs/benchmarks.md §8.28). The stored bits are those of RoPE then ``store_kv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _rotated(src, stride_sh, cos, sin, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
             HALF: tl.constexpr, HALF_PAD: tl.constexpr):  # fmt: skip
    """A token's heads [HEADS_PAD, HALF_PAD] twice (the two halves), rotated, in src's dtype."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (j < HALF)
    s = src + h * stride_sh + j
    x1 = tl.load(s, mask=mask, other=0.0)
    x2 = tl.load(s + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype), h, j, mask


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, qo_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_ot, stride_oh, v_ptr, kv_ptr, slot_ptr, stride_vt, stride_vh, stride_cp, stride_ckv,
    stride_cs, stride_ch,
    HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, STORE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    if USE_GDC:  # kernels/pdl.py: a row's cos / sin are found through its position, step data
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    j = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + pos * HALF + j, mask=j < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + j, mask=j < HALF, other=0.0)
    q1, q2, h, j, mask = _rotated(q_ptr + t * stride_qt, stride_qh, cos, sin, HQ, HQ_PAD, HALF,
                                  HALF_PAD)  # fmt: skip
    d = qo_ptr + t * stride_ot + h * stride_oh + j
    tl.store(d, q1, mask=mask)
    tl.store(d + HALF, q2, mask=mask)
    k1, k2, h, j, mask = _rotated(k_ptr + t * stride_kt, stride_kh, cos, sin, HK, HK_PAD, HALF,
                                  HALF_PAD)  # fmt: skip
    d = k_ptr + t * stride_kt + h * stride_kh + j
    tl.store(d, k1, mask=mask)
    tl.store(d + HALF, k2, mask=mask)
    if STORE:  # the rotated k (from registers: no read-back of the stores above) and v
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            dst = kv_ptr + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
            dst += h * stride_ch + j
            cdt = kv_ptr.dtype.element_ty
            tl.store(dst, k1.to(cdt), mask=mask)
            tl.store(dst + HALF, k2.to(cdt), mask=mask)
            v = v_ptr + t * stride_vt + h * stride_vh + j
            tl.store(dst + stride_ckv, tl.load(v, mask=mask).to(cdt), mask=mask)
            tl.store(dst + stride_ckv + HALF, tl.load(v + HALF, mask=mask).to(cdt), mask=mask)


def _check(name: str, x: torch.Tensor, t: int, d: int, dtype: torch.dtype, device) -> None:
    if x.dim() != 3 or x.shape[0] < t or x.shape[2] != d or x.stride(2) != 1:
        raise ValueError(f"{name} must be [{t}, H, {d}] with a contiguous last dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if x.dtype != dtype or x.device != device:
        raise ValueError(f"{name} must be {dtype} on {device}, got {x.dtype} on {x.device}")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, q_out: torch.Tensor | None = None,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rotate k in place and q in place (or into q_out[:T]); returns the rotated q. kv:
    (v [T, Hkv, D], kv_cache [P, 2, ps, Hkv, D], slot_mapping int64 [T]): also store the
    rotated k and v there (module docstring)."""
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
    hk = k.shape[1]
    if kv is not None:
        v, cache, slots = kv
        if (v.shape != k.shape or v.dtype != k.dtype or v.stride(2) != 1 or cache.dim() != 5
                or cache.shape[1:] != (2, cache.shape[2], hk, d) or cache.stride(4) != 1
                or slots.shape != (t,) or slots.dtype != torch.int64):  # fmt: skip
            raise ValueError(f"kv must be v {tuple(k.shape)} {k.dtype}, a [P, 2, ps, {hk}, {d}] "
                             f"cache and int64 [{t}] slots, got {tuple(v.shape)} {v.dtype}, "
                             f"{tuple(cache.shape)}, {slots.dtype} {tuple(slots.shape)}")
    if t == 0:
        return out[:0]
    v, cache, slots = kv if kv is not None else (k, k, positions)
    cs = cache.stride() if kv is not None else (0, 0, 0, 0, 0)
    _rope_kernel[(t,)](
        positions, q, k, out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out.stride(0), out.stride(1), v, cache, slots, v.stride(0), v.stride(1), cs[0], cs[1],
        cs[2], cs[3], HQ=hq, HK=hk, HQ_PAD=triton.next_power_of_2(hq),
        HK_PAD=triton.next_power_of_2(hk), HALF=half, HALF_PAD=triton.next_power_of_2(half),
        STORE=kv is not None, PAGE_SIZE=cache.shape[2] if kv is not None else 1, num_warps=4,
        **pdl.launch_options(q.device),
    )  # fmt: skip
    return out[:t]
