"""Triton acceptance test of sampled verify rows (``worker/sampled_rows.py``): for every query
j of a verify row, whether its draft d_{j+1} is rejected, u_j * q_j(d) > p_j(d), with u_j the
counter-based uniform of (seed, x_pos + 1 + j, Stream.ACCEPT) (``sampler.uniform``'s bits and
float64), in one launch where the torch code (``sampled_rows.rejected_at_ref``, its reference)
takes ~50 small ones, most of them the uniform's hash.

rejected_at: probs float32 [t, V] (each query's p), q_store float32 [D, n, V] (the q of each
    held draft), chain int64 [D, n] (the drafts), row / j int64 [t] (each query's row and index
    in it), checks bool [t] (the query tests a draft), seed / x_pos / held int64 [n] ->
    (int64 [t]: j where the query rejects its draft, else held[row]; int64 [t]: the draft it
    tests, chain[min(j, D - 1), row]). One program a BLOCK of queries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .race import STREAM_ACCEPT, key_of, uniform_of

BLOCK = 128


@triton.jit
def _rejected_at_kernel(p_ptr, q_ptr, chain_ptr, row_ptr, j_ptr, check_ptr, seed_ptr,
                        xpos_ptr, held_ptr, out_ptr, tok_ptr, t, depth, stride_p, stride_qd,
                        stride_qn, stride_c, STREAM: tl.constexpr,
                        BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < t
    row = tl.load(row_ptr + i, mask=ok, other=0)
    j = tl.load(j_ptr + i, mask=ok, other=0)
    jc = tl.minimum(j, depth - 1)
    check = ok & (tl.load(check_ptr + i, mask=ok, other=0) != 0)
    tok = tl.load(chain_ptr + jc * stride_c + row, mask=ok, other=0)
    p = tl.load(p_ptr + i.to(tl.int64) * stride_p + tok, mask=check, other=0.0)
    # int64 offsets: a store of 512 rows x 16 drafts of a 152k vocabulary is past 2^31 floats
    q = tl.load(q_ptr + jc.to(tl.int64) * stride_qd + row.to(tl.int64) * stride_qn + tok,
                mask=check, other=0.0)  # fmt: skip
    pos = tl.load(xpos_ptr + row, mask=ok, other=0) + 1 + j
    key = key_of(tl.load(seed_ptr + row, mask=ok, other=0), pos, tl.full([BLOCK], STREAM,
                                                                      tl.int64))  # fmt: skip
    u = uniform_of(key, tl.zeros([BLOCK], tl.int32))  # the uniform's column 0
    rejected = check & (u * q.to(tl.float64) > p.to(tl.float64))
    held = tl.load(held_ptr + row, mask=ok, other=0)
    tl.store(out_ptr + i, tl.where(rejected, j, held), mask=ok)
    tl.store(tok_ptr + i, tok, mask=ok)


def rejected_at(probs: torch.Tensor, q_store: torch.Tensor, chain: torch.Tensor,
                row: torch.Tensor, j: torch.Tensor, checks: torch.Tensor, seed: torch.Tensor,
                x_pos: torch.Tensor,
                held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The module docstring's ``rejected_at``; capturable (one launch, no host sync)."""
    t, v = probs.shape
    depth, n = chain.shape
    if probs.stride(1) != 1 or q_store.shape != (depth, n, v) or q_store.stride(2) != 1:
        raise ValueError(f"probs [t, V] and q_store [D, n, V] with contiguous last dims, got "
                         f"{tuple(probs.shape)} and {tuple(q_store.shape)}")  # fmt: skip
    out = torch.empty(t, dtype=torch.int64, device=probs.device)
    tok = torch.empty(t, dtype=torch.int64, device=probs.device)
    if t:
        _rejected_at_kernel[(triton.cdiv(t, BLOCK),)](
            probs, q_store, chain.contiguous(), row, j, checks, seed, x_pos,
            held, out, tok, t, depth, probs.stride(0), q_store.stride(0), q_store.stride(1),
            n, STREAM=STREAM_ACCEPT, BLOCK=BLOCK)  # fmt: skip
    return out, tok
