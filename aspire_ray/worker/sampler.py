"""Sampling with counter-based randomness.

The uniform noise for a token is a hash of (seed, position, stream, vocab id), so a request's
samples do not depend on which other requests share the batch, on preemption, or on the
tensor-parallel rank (every rank draws the same numbers). A token is drawn from probs p by the
exponential race argmax_v p_v / E_v with E_v = -log(u_v) ~ Exp(1), which picks v with
probability exactly p_v.
"""

from __future__ import annotations

import numpy as np
import torch

from aspire_ray.kernels.host import upload

_MASK32 = 0xFFFFFFFF
# Logit rows whose sampling distributions a host-planned step holds at once (``Worker._sample``
# takes a larger step's rows in runs of whole rows up to this many): [2048, V] float32 is
# 1.2 GB at Qwen2.5's vocabulary, where a step of 16,384 logit rows held 10 GB of them and as
# much again of its verified drafts' q (``kv_budget.py`` reserves what one run holds)
HOST_SAMPLE_ROWS = 2048


def row_runs(offsets: list[int], limit: int) -> list[tuple[int, int, list[int]]]:
    """Consecutive rows [a, b) whose logit rows (offsets [n + 1]) number at most ``limit``
    (a row of more alone), covering every row in order, each with its rows' offsets from its
    first logit row (its logits: [offsets[a], offsets[b]))."""
    bounds, start = [], 0
    for r in range(1, len(offsets)):
        if r - 1 > start and offsets[r] - offsets[start] > limit:
            bounds.append((start, r - 1))
            start = r - 1
    if len(offsets) > 1:
        bounds.append((start, len(offsets) - 1))
    return [(a, b, [o - offsets[a] for o in offsets[a : b + 1]]) for a, b in bounds]


def i64(xs: list[int], device) -> torch.Tensor:
    """A host list of ints as an int64 tensor on device (seeds, positions, row indices), copied
    through pinned memory: ``torch.tensor(xs, device=cuda)`` copies from pageable memory and
    waits for the stream, so a sampled step's dozen small uploads would each stall the host
    until the GPU drained."""
    return upload(np.asarray(xs, dtype=np.int64), torch.device(device))


def f32(xs: list[float], device) -> torch.Tensor:
    """A host list of floats as a float32 tensor on device (temperatures, top_p), as ``i64``."""
    return upload(np.asarray(xs, dtype=np.float32), torch.device(device))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32  # product < 2^59: no int64 overflow
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor,
             stream: int | torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One 32-bit key per row from (seed [N] int64, position [N] int64, stream: one for all
    rows or int64 [N])."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    k = _mix32(lo ^ 0x2545F491)
    k = _mix32(k ^ hi)
    k = _mix32(k ^ (positions & _MASK32))
    return _mix32(k ^ (stream * 0x9E3779B1 & _MASK32))


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor,
            n: int) -> torch.Tensor:  # fmt: skip
    """Uniforms in (0, 1), float64 [N, n]; entry (i, v) depends only on
    (seed_i, pos_i, stream (stream_i if a tensor), v)."""
    keys = row_keys(seeds, positions, stream)[:, None]
    v = torch.arange(n, device=seeds.device, dtype=torch.int64)[None, :]
    a = _mix32(keys ^ _mix32(v * 2 + 1))
    b = _mix32(a ^ 0x68E31DA4)
    bits = (a >> 5) * 67108864 + (b >> 6)  # 53 random bits
    return (bits.double() + 0.5) / 9007199254740992.0


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      stream: int | torch.Tensor) -> torch.Tensor:  # fmt: skip
    """probs [N, V] (rows of non-negative weights; their sums need not be 1) -> token ids [N]
    int64, by the exponential race. On a GPU: ``kernels.race.race_rows``, the same draws
    in one pass over the rows."""
    if probs.is_cuda:
        from aspire_ray.kernels.race import race_rows

        return race_rows(probs, seeds, positions, stream)
    return race_ref(probs, seeds, positions, stream)


def sample_residual(p: torch.Tensor, q: torch.Tensor, use_q: torch.Tensor,
                    seeds: torch.Tensor, positions: torch.Tensor,
                    stream: int | torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The draws of speculative rejection sampling's last token: rows where use_q [N] holds
    (a rejected draft) from the residual max(p - q, 0) (from p where the residual is all zero:
    q >= p everywhere), the others from p. p, q [N, V] float32; -> int64 [N]."""
    if p.is_cuda:
        from aspire_ray.kernels.race import race_rows

        return race_rows(p, seeds, positions, stream, q, use_q)
    residual = (p - q).clamp_min(0)  # subtracted in p's dtype, as the kernel subtracts
    use = use_q & (residual > 0).any(dim=-1)
    return race_ref(torch.where(use[:, None], residual, p), seeds, positions, stream)


def race_ref(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
             stream: int | torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The exponential race in torch: argmax_v w_v / E_v over float64 [N, V] temporaries."""
    expo = -torch.log(uniform(seeds, positions, stream, weights.shape[1]))
    return torch.argmax(weights.double() / expo, dim=-1)


def need_flags(specs) -> tuple[bool, bool]:
    """(need_k, need_p) of ``probs_from_logits`` for rows of these SamplingSpecs: whether any
    has top_k > 0, top_p < 1 (known on the host: no device sync)."""
    return any(s.top_k > 0 for s in specs), any(s.top_p < 1.0 for s in specs)


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, need_k: bool | None = None,
                      need_p: bool | None = None) -> torch.Tensor:  # fmt: skip
    """logits [N, V] float32; temperature/top_p [N] float32; top_k [N] int64 (0: off).

    Returns the float32 distribution the request samples from: softmax(logits / T) restricted
    to the top-k tokens, then to the top tokens holding top_p of that mass. Both cuts are
    thresholds, so tokens tied with the last one kept are kept too: a token stays if fewer than
    top_k tokens are larger, and if the tokens larger than it hold less than top_p of the
    top-k mass (the top token always stays).
    need_k / need_p: whether any row has top_k > 0 / top_p < 1, if the caller knows
    (``need_flags``; None: read from the tensors, a device sync each; CUDA graphs pass them).
    On a GPU: ``kernels.top_k_top_p.filter_probs``, with no sort.
    """
    need_k = bool((top_k > 0).any()) if need_k is None else need_k
    need_p = bool((top_p < 1.0).any()) if need_p is None else need_p
    if logits.is_cuda:
        from aspire_ray.kernels.top_k_top_p import filter_probs

        return filter_probs(logits, temperature, top_k, top_p, need_k, need_p)
    return probs_from_logits_ref(logits, temperature, top_k, top_p, need_k, need_p)


def probs_from_logits_ref(logits: torch.Tensor, temperature: torch.Tensor,
                          top_k: torch.Tensor, top_p: torch.Tensor, need_k: bool,
                          need_p: bool) -> torch.Tensor:  # fmt: skip
    """``probs_from_logits`` in torch, by a sort of each row (the kernel's reference)."""
    scaled = logits / temperature[:, None]
    e = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))  # [N, V] in (0, 1]
    if need_k or need_p:
        vocab = e.shape[1]
        desc = torch.sort(e, dim=-1, descending=True).values
        floor = torch.zeros_like(e[:, :1])  # [N, 1]: keep e >= floor
        if need_k:
            cut = ((top_k > 0) & (top_k < vocab))[:, None]
            kth = desc.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])  # the k-th largest
            floor = torch.where(cut, kth, floor)
        if need_p:
            kept = desc * (desc >= floor)
            goal = top_p[:, None] * kept.sum(dim=-1, keepdim=True)
            # the sorted prefix whose mass before each token is below the goal; its last value
            # (at least the top token: a graph's unused padding rows may hold NaN)
            n = ((torch.cumsum(kept, dim=-1) - kept) < goal).sum(dim=-1, keepdim=True)
            top_p_floor = torch.maximum(desc.gather(1, (n - 1).clamp_min(0)), floor)
            floor = torch.where((top_p < 1.0)[:, None], top_p_floor, floor)
        e = torch.where(e >= floor, e, 0.0)
    return e / e.sum(dim=-1, keepdim=True)
