"""Verification of a draft block against the target model (DESIGN.md §1.3).

Row notation: drafts d_1..d_d were proposed for sequence positions pos0 .. pos0+d-1; the verify
forward gives target distributions p_0..p_d, where p_j predicts position pos0 + j.
"""

from __future__ import annotations

import torch

from aspire_ray.plan import Stream

from .sampler import sample_from_probs, uniform


def verify_greedy(target: list[int], drafts: list[int]) -> tuple[int, list[int]]:
    """target: argmax of p_0..p_d (d+1 ids). Accept the longest prefix with d_j == argmax
    p_{j-1}, then add the target's own argmax at the first mismatch (or after the last draft)."""
    accepted = 0
    for j, token in enumerate(drafts):
        if token != target[j]:
            break
        accepted += 1
    return accepted, drafts[:accepted] + [target[accepted]]


def verify_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int],
                   seed: int, pos0: int) -> tuple[int, list[int]]:
    """Speculative rejection sampling; keeps the target distribution exactly.

    target_probs [d+1, V], draft_probs [d, V] (the q each draft was sampled from).
    """
    d = len(drafts)
    device = target_probs.device
    seeds = torch.full((d + 1,), seed, dtype=torch.int64, device=device)
    positions = torch.arange(pos0, pos0 + d + 1, dtype=torch.int64, device=device)
    if d:
        idx = torch.tensor(drafts, device=device)
        j = torch.arange(d, device=device)
        p = target_probs[j, idx].double()
        q = draft_probs[j, idx].double()
        u = uniform(seeds[:d], positions[:d], Stream.ACCEPT, 1)[:, 0]
        # accept d_j with probability min(1, p/q)  <=>  u * q <= p
        rejected = (u * q > p).nonzero()
        accepted = int(rejected[0, 0]) if rejected.numel() else d
    else:
        accepted = 0
    if accepted < d:
        # resample from the residual max(p - q, 0), normalised
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0).double()
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[accepted].double()
        token = sample_from_probs(dist[None], seeds[accepted : accepted + 1],
                                  positions[accepted : accepted + 1], Stream.RESIDUAL)
    else:
        token = sample_from_probs(target_probs[d][None], seeds[d : d + 1], positions[d : d + 1],
                                  Stream.TARGET)
    return accepted, drafts[:accepted] + [int(token[0])]
