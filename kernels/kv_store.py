"""Triton KV store by slot mapping.

Meaning: ``reference.store_kv_ref``. Shapes (T tokens, Hkv heads, D head dim):
    k, v:         [T, Hkv, D]         any float dtype, last dim contiguous (cast to the cache's)
    kv_cache:     [P, 2, ps, Hkv, D]  last dim contiguous
    slot_mapping: int64 [T]           page_id * ps + offset; a negative slot is skipped (padding)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_ckv, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, DIM_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        dst = kv_ptr + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
        dst += h * stride_ch + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v [T, Hkv, D] into kv_cache [P, 2, ps, Hkv, D] at slot_mapping [T] (int64)."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [P, 2, ps, Hkv, D], got {tuple(kv_cache.shape)}")
    _, _, ps, hkv, d = kv_cache.shape
    t = slot_mapping.shape[0]
    for name, x in (("k", k), ("v", v)):
        if x.shape != (t, hkv, d):
            raise ValueError(f"{name} must be [{t}, {hkv}, {d}], got {tuple(x.shape)}")
        if x.stride(2) != 1 or x.device != kv_cache.device or not x.is_floating_point():
            raise ValueError(
                f"{name} must be a float tensor on {kv_cache.device} with a contiguous last "
                f"dim, got {x.dtype} on {x.device} strides {x.stride()}"
            )
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [T], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")  # fmt: skip
    if slot_mapping.device != kv_cache.device or kv_cache.stride(4) != 1:
        raise ValueError("slot_mapping must be on the cache's device; cache last dim contiguous")
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, HEADS_PAD=triton.next_power_of_2(hkv),
        DIM_PAD=triton.next_power_of_2(d), PAGE_SIZE=ps, num_warps=4,
    )  # fmt: skip
