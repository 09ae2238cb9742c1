"""Sampling with counter-based randomness.

The uniform noise for a token is a hash of (seed, position, stream, vocab id), so a request's
samples do not depend on which other requests share the batch, on preemption, or on the
tensor-parallel rank (every rank draws the same numbers). A token is drawn from probs p by the
exponential race argmax_v p_v / E_v with E_v = -log(u_v) ~ Exp(1), which picks v with
probability exactly p_v.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def i64(xs: list[int], device) -> torch.Tensor:
    """A host list of ints as an int64 tensor on device (seeds, positions, row indices)."""
    return torch.tensor(xs, dtype=torch.int64, device=device)


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
    """probs [N, V] (rows sum to 1) -> token ids [N] int64, by the exponential race."""
    expo = -torch.log(uniform(seeds, positions, stream, probs.shape[1]))
    return torch.argmax(probs.double() / expo, dim=-1)


def need_flags(specs) -> tuple[bool, bool]:
    """(need_k, need_p) of ``probs_from_logits`` for rows of these SamplingSpecs: whether any
    has top_k > 0, top_p < 1 (known on the host: no device sync)."""
    return any(s.top_k > 0 for s in specs), any(s.top_p < 1.0 for s in specs)


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, need_k: bool | None = None,
                      need_p: bool | None = None) -> torch.Tensor:  # fmt: skip
    """logits [N, V] float32; temperature/top_p [N] float32; top_k [N] int64 (0: off).

    Returns the float32 distribution the request samples from: softmax(logits / T) restricted
    to the top-k tokens and to the smallest set of top tokens whose mass reaches top_p.
    need_k / need_p: whether any row has top_k > 0 / top_p < 1, if the caller knows
    (``need_flags``; None: read from the tensors, a device sync each; CUDA graphs pass them).
    """
    logits = logits / temperature[:, None]
    need_k = bool((top_k > 0).any()) if need_k is None else need_k
    need_p = bool((top_p < 1.0).any()) if need_p is None else need_p
    if need_k or need_p:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        vocab = logits.shape[1]
        rank = torch.arange(vocab, device=logits.device)[None, :]
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.where(top_k > 0, top_k, vocab)[:, None]
            drop |= rank >= k
        if need_p:
            sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop |= mass_before >= top_p[:, None]  # keeps at least the top token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)
