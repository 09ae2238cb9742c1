"""The qkv projection with RoPE and the KV store in its epilogue: one launch for three kernels.

Meaning: ``q, k, v = F.linear(x, w, bias).split([Hq * D, Hkv * D, Hkv * D], -1)`` viewed as
heads, then ``rope.rotary_embedding(positions, q, k, cos, sin, q_out, kv=(v, kv_cache,
slot_mapping))``. Shapes (T tokens, K hidden, Hq / Hkv heads, D head dim, N = (Hq + 2 Hkv) D):
    x:            [T, K]              bf16 / fp16 / fp32, last dim contiguous
    w:            [N, K]              x's dtype, last dim contiguous (q rows, then k, then v)
    bias:         [N]                 x's dtype (optional)
    positions:    int64 [T]
    cos, sin:     float32 [max_positions, D/2], contiguous
    q_out:        [T', Hq, D], T' >= T, x's dtype, last dim contiguous (optional): rotated q
    kv_cache:     [P, 2, ps, Hkv, D]  last dim contiguous (optional): rotated k and v stored
    slot_mapping: int64 [T]           page_id * ps + offset; a negative slot is skipped
Returns q_out[:T] (a new [T, Hq, D] without q_out), k and v: new contiguous [T, Hkv, D] (k
rotated), the tensors ``Attention.qkv`` returns.

Rounding is the unfused path's: the projection (+ bias) rounded to x's dtype, rotated in
float32 from those bits and rounded once, cast to the cache's dtype for the store. With the
default tiling the bits are those of ``triton_linear(invariant_config)`` + ``rotary_embedding``
(bitwise on an H100, Triton 3.6; tests/kernels/test_fused_epilogues.py).

Why: a CUDA-graph decode step's layers are latency-bound small kernels (~2-3 us each on an
H100 whatever their bytes, docs/benchmarks.md §8.28); this drops the RoPE + store launch and
the [T, N] round trip. RoPE pairs column i of a head with column i + D/2, so a program owns
BLOCK_N / 2 columns of one head's first half and the matching BLOCK_N / 2 of its second half
as two accumulators (two tl.dot per K chunk): with BLOCK_N = 32 Qwen2.5-0.5B's [1152, 896]
weight still spreads over 36 programs at 64 rows. The K loop is ``kernels.linear``'s (one
fixed order of BLOCK_K chunks, tiling by the weight's shape): a row's output does not depend
on T or the other rows, and with ``qkv_rope_config`` it streams K as ``invariant_config``
does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .linear import LinearConfig, check_xw, dot_precision, dot_two, invariant_config


def qkv_rope_config(n: int, k: int) -> LinearConfig:
    """The tiling of a [n, k] qkv weight, by its shape only (batch invariance): the deterministic
    mode's ``invariant_config``, whose BLOCK_N columns a program here takes as two halves of
    BLOCK_N / 2 (so the same weight bytes per program and the same K chunks)."""
    return invariant_config(n, k)


@triton.jit
def _qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, kv_out_ptr, kv_ptr, slot_ptr,
    M, K, stride_xm, stride_wn, stride_qt, stride_qh, stride_cp, stride_ckv, stride_cs,
    stride_ch,
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, TILES: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HEAD_DIM // 2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    head = pid_n // TILES  # 0..Hq-1 q, then Hkv k heads, then Hkv v heads
    j = (pid_n % TILES) * BLOCK_H + tl.arange(0, BLOCK_H)  # columns within a half [BH]
    j_ok = j < HALF  # a last tile may overhang the half (D / 2 not a multiple of BLOCK_H)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (head * HEAD_DIM + j).to(tl.int64)  # weight rows of the first half; + HALF: second
    m_ok = rm < M
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    w1 = w_ptr + rn[None, :] * stride_wn  # [1, BH]
    w2 = w1 + HALF * stride_wn
    if USE_GDC:  # kernels/pdl.py: this program's weight rows asked of L2, then the step's data
        # (cos / sin wait too: a row's entries are found through its position)
        first = w_ptr + (head * HEAD_DIM + tl.minimum(j, HALF - 1)).to(tl.int64) * stride_wn
        pdl.prefetch_rows(first, K)
        pdl.prefetch_rows(first + HALF * stride_wn, K)
        tl.extra.cuda.gdc_wait()
    acc1, acc2 = dot_two(x_rows, m_ok, w1, w2, j_ok, K, BLOCK_M, BLOCK_H, BLOCK_K,
                         PRECISION)  # [BM, BH] each  # fmt: skip
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + rn, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + rn + HALF, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    dt = x_ptr.dtype.element_ty
    a = acc1.to(dt)  # the projection's bits, as F.linear rounds them
    b = acc2.to(dt)
    mask = m_ok[:, None] & j_ok[None, :]
    if head < HQ + HK:  # q or k: rotate-half RoPE in float32, rounded once (kernels.rope)
        pos = tl.load(pos_ptr + rm, mask=m_ok, other=0)
        t = pos[:, None] * HALF + j[None, :]
        cos = tl.load(cos_ptr + t, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + t, mask=mask, other=0.0)
        af, bf = a.to(tl.float32), b.to(tl.float32)
        # a cos - b sin, b cos + a sin with the fmas the compiler makes of kernels.rope's
        # expressions (Triton 3.6 on an H100): left to the compiler, the second contracted the
        # other way here, 1 bf16 ulp off in ~1 of 30k values (test_fused_epilogues' GPU test)
        a = tl.fma(af, cos, -(bf * sin)).to(dt)
        b = tl.fma(af, sin, bf * cos).to(dt)
    if head < HQ:
        d = q_ptr + rm[:, None] * stride_qt + head * stride_qh + j[None, :]
        tl.store(d, a, mask=mask)
        tl.store(d + HALF, b, mask=mask)
    else:
        which = (head - HQ) // HK  # 0: k, 1: v (kv_out's and the cache's index)
        hk = (head - HQ) % HK
        d = kv_out_ptr + ((which * M + rm[:, None]) * HK + hk) * HEAD_DIM + j[None, :]
        tl.store(d, a, mask=mask)
        tl.store(d + HALF, b, mask=mask)
        if STORE:
            slot = tl.load(slot_ptr + rm, mask=m_ok, other=-1)
            page, off = slot // PAGE_SIZE, slot % PAGE_SIZE
            dst = kv_ptr + page[:, None] * stride_cp + which * stride_ckv
            dst += off[:, None] * stride_cs + hk * stride_ch + j[None, :]
            ok = mask & (slot >= 0)[:, None]
            cdt = kv_ptr.dtype.element_ty
            tl.store(dst, a.to(cdt), mask=ok)
            tl.store(dst + HALF, b.to(cdt), mask=ok)


def _check_io(x, w, bias, positions, cos, sin, num_q_heads, num_kv_heads, head_dim):
    check_xw(x, w)
    if head_dim <= 0 or head_dim % 2 or num_q_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(f"need positive heads and an even head_dim, got {num_q_heads}, "
                         f"{num_kv_heads}, {head_dim}")  # fmt: skip
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    if w.shape[0] != n:
        raise ValueError(f"w must have (Hq + 2 Hkv) * D = {n} rows, got {w.shape[0]}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype
                             or bias.device != x.device):  # fmt: skip
        raise ValueError(f"bias must be {x.dtype} [{n}], got {bias.dtype} {tuple(bias.shape)}")
    t = x.shape[0]
    if positions.shape != (t,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{t}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")  # fmt: skip
    for name, table in (("cos", cos), ("sin", sin)):
        if (table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != head_dim // 2
                or not table.is_contiguous()):  # fmt: skip
            raise ValueError(f"{name} must be a contiguous float32 [P, {head_dim // 2}] table, "
                             f"got {table.dtype} {tuple(table.shape)}")  # fmt: skip
    for name, other in (("positions", positions), ("cos", cos), ("sin", sin)):
        if other.device != x.device:
            raise ValueError(f"{name} must be on {x.device}, got {other.device}")


def qkv_rope(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor | None,
    kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None, num_q_heads: int,
    num_kv_heads: int, head_dim: int, cfg: LinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [T, K] -> (q [T, Hq, D] in q_out[:T] if given, k, v [T, Hkv, D]) after RoPE, k and v
    stored at slot_mapping in kv_cache if given (module docstring). cfg: block_n = the columns
    a program owns, half of them in each half of one head (even); None: ``qkv_rope_config``."""
    _check_io(x, w, bias, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)
    t, hq, hk, d = x.shape[0], num_q_heads, num_kv_heads, head_dim
    if q_out is None:
        q_out = torch.empty(t, hq, d, dtype=x.dtype, device=x.device)
    elif (q_out.dim() != 3 or q_out.shape[0] < t or q_out.shape[1:] != (hq, d)
          or q_out.stride(2) != 1 or q_out.dtype != x.dtype
          or q_out.device != x.device):  # fmt: skip
        raise ValueError(f"q_out must be {x.dtype} [T' >= {t}, {hq}, {d}] with a contiguous last "
                         f"dim, got {q_out.dtype} {tuple(q_out.shape)}")  # fmt: skip
    if kv_cache is not None:
        if (kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[3:] != (hk, d)
                or kv_cache.stride(4) != 1 or kv_cache.device != x.device
                or not kv_cache.is_floating_point()):  # fmt: skip
            raise ValueError(f"kv_cache must be a float [P, 2, ps, {hk}, {d}] cache on {x.device} "
                             f"with a contiguous last dim, got {kv_cache.dtype} "
                             f"{tuple(kv_cache.shape)}")  # fmt: skip
        sm = slot_mapping
        if sm is None or (sm.shape, sm.dtype, sm.device) != ((t,), torch.int64, x.device):
            raise ValueError(f"slot_mapping must be int64 [{t}] on {x.device} with kv_cache")
    cfg = cfg or qkv_rope_config(*w.shape)
    if cfg.block_n < 2 or cfg.block_n % 2:
        raise ValueError(f"block_n must be even (two halves of a head), got {cfg.block_n}")
    kv_out = torch.empty(2, t, hk, d, dtype=x.dtype, device=x.device)  # k, v
    if t == 0:
        return q_out[:0], kv_out[0], kv_out[1]
    tiles = triton.cdiv(d // 2, cfg.block_n // 2)  # programs per head, per tile of rows
    store = kv_cache is not None
    cache, slots = (kv_cache, slot_mapping) if store else (kv_out, positions)
    cs = kv_cache.stride() if store else (0, 0, 0, 0, 0)
    grid = ((hq + 2 * hk) * tiles, triton.cdiv(t, cfg.block_m))
    _qkv_rope_kernel[grid](
        x, w, bias if bias is not None else w, positions, cos, sin, q_out, kv_out, cache, slots,
        t, x.shape[1], x.stride(0), w.stride(0), q_out.stride(0), q_out.stride(1), cs[0], cs[1],
        cs[2], cs[3], HQ=hq, HK=hk, HEAD_DIM=d, TILES=tiles, HAS_BIAS=bias is not None,
        STORE=store, PAGE_SIZE=kv_cache.shape[2] if store else 1, BLOCK_M=cfg.block_m,
        BLOCK_H=cfg.block_n // 2, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, PRECISION=dot_precision(x), **pdl.launch_options(x.device),
    )  # fmt: skip
    return q_out[:t], kv_out[0], kv_out[1]
