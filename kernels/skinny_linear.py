"""Triton split-K linear for few-token batches (decode and draft steps): y = x W^T (+ b).

Meaning: ``reference.linear_ref`` (``torch.nn.functional.linear``, fp32 accumulation). Shapes:
    x:    [M, K]  bf16 / fp16 / fp32, M <= MAX_M, last dim contiguous
    w:    [N, K]  x's dtype, contiguous (a layer's weight)
    bias: [N] or None
    out:  [M, N]  x's dtype

Why: a decode step's GEMMs have M = the batch's rows (16-64) and read a small weight each
(Qwen2.5-0.5B: 1.6-17 MB). cuBLAS then launches few CTAs (the down projection of the 0.5B:
about ten 96-wide output tiles over K = 4,864), so each GEMM runs at 1-2 TB/s and takes
5-8 us where its bytes need 0.5-4 us (docs/benchmarks.md §8.14). Here the grid is output tiles
x K splits, sized to put a few programs on every SM, so the weight is streamed by all of them.

Each program multiplies x[:, K-chunk] by its [BLOCK_N, K-chunk] weight tile. With one split it
writes the output; otherwise it writes an fp32 partial, and the last program of an output tile
to finish (an atomic counter per tile) adds the partials in split order, adds the bias, writes
the output and resets the counter. One launch, no memset, and the sum's order is fixed, so
the output does not depend on which program finished first (deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_M = 64  # rows at most; larger batches keep cuBLAS (enough tiles of their own)
_CPU_SMS = 4  # stand-in off the GPU (interpreter runs), small so that tests split K

_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_hi
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if UPCAST:  # the interpreter multiplies 16-bit floats as raw bits; fp32 is exact for them
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        # partials: [SPLIT_K, BLOCK_M, N] fp32
        tile = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k * BLOCK_M * N + tile, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial stored before the count moves
        # acq_rel: this program's partial is visible before the count moves; the last one
        # sees every other program's partial
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):  # split order: the same sum whoever finishes last
                total += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=out_ok, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch (graph replay)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64  # output features per program
    block_k: int = 128  # K per loop iteration
    programs_per_sm: float = 2.0  # target grid size, in programs per SM
    min_k_blocks: int = 4  # a split holds at least this many BLOCK_K (bounds the serial sum)
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_CONFIG = SkinnyConfig()


def split_k(n: int, k: int, sms: int, cfg: SkinnyConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """(splits, K per split) putting about ``programs_per_sm`` programs on every SM: few
    output tiles get more K splits; a K chunk is a whole number of BLOCK_K and at least
    ``min_k_blocks`` of them."""
    tiles = triton.cdiv(n, cfg.block_n)
    k_blocks = triton.cdiv(k, cfg.block_k)
    most = max(1, k_blocks // cfg.min_k_blocks)
    want = max(1, min(most, round(cfg.programs_per_sm * sms / tiles)))
    per = triton.cdiv(k_blocks, want) * cfg.block_k
    return triton.cdiv(k, per), per


def counters(device: torch.device, tiles: int = 4096) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, shared by every launch on ``device``: a
    launch leaves them zero, and a worker's launches run one after another on one stream.
    Allocate them before a CUDA graph is captured (``tp.layers.use_skinny_gemm`` does), so
    that they do not live in the graph's private pool."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes this call (else use F.linear)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.stride(1) == 1
            and weight.is_contiguous() and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16))  # fmt: skip


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig = DEFAULT_CONFIG) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; M <= MAX_M."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] needed, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_M:
        raise ValueError(f"skinny_linear takes 1..{MAX_M} rows, got {m}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x needs a contiguous last dim and weight must be contiguous")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"dtypes {x.dtype}/{weight.dtype} differ or bias is not [{n}]")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = config
    splits, per = split_k(n, k, _num_sms(x.device), cfg)
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, cfg.block_n)
    part = (torch.empty(splits, block_m, n, dtype=torch.float32, device=x.device)
            if splits > 1 else out)  # fmt: skip
    counter = counters(x.device, tiles)
    _skinny_linear_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else out, out, part, counter, m, n, k, per, splits,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, UPCAST=x.device.type != "cuda", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
