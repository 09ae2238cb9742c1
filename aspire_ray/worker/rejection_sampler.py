"""Verification of a draft block against the target model (DESIGN.md §1.3).

Row notation: drafts d_1..d_d were proposed for sequence positions pos0 .. pos0+d-1; the verify
forward gives target distributions p_0..p_d, where p_j predicts position pos0 + j.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from aspire_ray.plan import Stream

from .sampler import i64, sample_from_probs, uniform


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
    """Speculative rejection sampling of one row; keeps the target distribution exactly.

    The meaning of ``verify_sampled_batch`` (which the worker runs), kept as its reference.

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


class SampledVerify(NamedTuple):
    """One sampled verify row of a step, for ``verify_sampled_batch``."""

    logit_row: int  # index of its p_0 in the step's target_probs (p_0..p_d follow)
    drafts: list[int]
    seed: int
    pos0: int


def verify_sampled_batch(target_probs: torch.Tensor, rows: list[SampledVerify],
                         draft_probs: torch.Tensor | None) -> list[tuple[int, list[int]]]:
    """``verify_sampled`` of many rows at once (the same draws), with three device syncs in
    all instead of two per row.

    target_probs: [N, V] the step's sampling distributions, one per logit row.
    draft_probs:  [sum d, V] every row's draft distributions q, in row order (None: no drafts).
    """
    device = target_probs.device
    first = [0]  # row i's drafts are entries first[i] .. first[i+1]-1 of the flat draft axis
    for row in rows:
        first.append(first[-1] + len(row.drafts))
    accepted = [len(row.drafts) for row in rows]
    if first[-1]:
        flat = [(i, jj) for i, row in enumerate(rows) for jj in range(len(row.drafts))]
        token = i64([t for row in rows for t in row.drafts], device)
        p = target_probs[i64([rows[i].logit_row + jj for i, jj in flat], device), token].double()
        q = draft_probs[torch.arange(first[-1], device=device), token].double()
        u = uniform(i64([rows[i].seed for i, _ in flat], device),
                    i64([rows[i].pos0 + jj for i, jj in flat], device), Stream.ACCEPT, 1)[:, 0]
        # accept d_j with probability min(1, p/q)  <=>  u * q <= p
        rejected = (u * q > p).tolist()
        for i, row in enumerate(rows):
            accepted[i] = next((jj for jj in range(len(row.drafts))
                                if rejected[first[i] + jj]), len(row.drafts))
    final: dict[int, int] = {}
    # rows with a rejection: resample from the residual max(p - q, 0), normalised
    res = [i for i, row in enumerate(rows) if accepted[i] < len(row.drafts)]
    if res:
        p_at = target_probs[i64([rows[i].logit_row + accepted[i] for i in res], device)]
        q_at = draft_probs[i64([first[i] + accepted[i] for i in res], device)]
        residual = (p_at - q_at).clamp_min(0).double()
        total = residual.sum(dim=-1, keepdim=True)
        dist = torch.where(total > 0, residual / total.clamp_min(1e-300), p_at.double())
        final.update(zip(res, _draw(dist, rows, res, accepted, Stream.RESIDUAL), strict=True))
    # rows whose drafts all passed: the target's own token from p_d
    full = [i for i, row in enumerate(rows) if accepted[i] == len(row.drafts)]
    if full:
        p_end = target_probs[i64([rows[i].logit_row + accepted[i] for i in full], device)]
        final.update(zip(full, _draw(p_end, rows, full, accepted, Stream.TARGET), strict=True))
    return [(accepted[i], row.drafts[: accepted[i]] + [final[i]]) for i, row in enumerate(rows)]


def _draw(dist: torch.Tensor, rows: list[SampledVerify], which: list[int], accepted: list[int],
          stream: Stream) -> list[int]:
    """One token per listed row from dist [len(which), V], at position pos0 + accepted."""
    device = dist.device
    seeds = i64([rows[i].seed for i in which], device)
    positions = i64([rows[i].pos0 + accepted[i] for i in which], device)
    return sample_from_probs(dist, seeds, positions, stream).tolist()
