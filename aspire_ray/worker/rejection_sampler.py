"""Verification of a draft block against the target model (DESIGN.md §1.3).

Row notation: drafts d_1..d_d were proposed for sequence positions pos0 .. pos0+d-1; the verify
forward gives target distributions p_0..p_d, where p_j predicts position pos0 + j.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from aspire_ray.plan import Stream

from .sampler import i64, sample_from_probs, sample_residual, uniform


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
        # resample from the residual max(p - q, 0) (the race needs no normalising), or from p
        # where that is all zero
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        p = target_probs[accepted].clone()
        p[drafts[accepted]] = 0.0  # the rejected draft is never drawn again (``without_rejected``)
        dist = residual if bool((residual > 0).any()) else p
        token = sample_from_probs(dist[None], seeds[accepted : accepted + 1],
                                  positions[accepted : accepted + 1], Stream.RESIDUAL)
    else:
        token = sample_from_probs(target_probs[d][None], seeds[d : d + 1], positions[d : d + 1],
                                  Stream.TARGET)
    return accepted, drafts[:accepted] + [int(token[0])]


def without_rejected(p: torch.Tensor, rejected: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """p [N, V] with p[i, rejected[i]] set to 0 on rows where ``where`` [N] holds: the last
    token's distribution after a rejection, whose residual is already 0 there, so that the
    fallback from an all-zero residual to p never draws the rejected draft again."""
    at = rejected[:, None]
    return p.scatter(1, at, torch.where(where[:, None], 0.0, p.gather(1, at)))


class SampledVerify(NamedTuple):
    """One sampled verify row of a step, for ``verify_sampled_batch``."""

    logit_row: int  # index of its p_0 in the step's target_probs (p_0..p_d follow)
    drafts: list[int]
    seed: int
    pos0: int


def verify_sampled_batch(target_probs: torch.Tensor, rows: list[SampledVerify],
                         draft_probs: torch.Tensor | None) -> list[tuple[int, list[int]]]:
    """``verify_sampled`` of many rows at once (the same draws), computed on the device with
    one sync in all: the accepted counts, then each row's final draw, from the residual at its
    first rejection (stream RESIDUAL) or from its last target distribution (stream TARGET).

    target_probs: [N, V] the step's sampling distributions, one per logit row.
    draft_probs:  [sum d, V] every row's draft distributions q, in row order (None: no drafts).
    """
    device = target_probs.device
    lens = [len(row.drafts) for row in rows]
    first = [0]  # row i's drafts are entries first[i] .. first[i+1]-1 of the flat draft axis
    for n in lens:
        first.append(first[-1] + n)
    d = i64(lens, device)
    logit = i64([row.logit_row for row in rows], device)
    seeds = i64([row.seed for row in rows], device)
    pos0 = i64([row.pos0 for row in rows], device)
    accepted = d.clone()
    if first[-1]:
        of = i64([i for i, n in enumerate(lens) for _ in range(n)], device)  # [D] its row
        j = torch.arange(first[-1], device=device) - i64(first[:-1], device)[of]
        token = i64([t for row in rows for t in row.drafts], device)
        p = target_probs[logit[of] + j, token].double()
        q = draft_probs[torch.arange(first[-1], device=device), token].double()
        u = uniform(seeds[of], pos0[of] + j, Stream.ACCEPT, 1)[:, 0]
        # accept d_j with probability min(1, p/q)  <=>  u * q <= p; a row stops at its first
        rejected_at = torch.where(u * q > p, j, d[of])
        accepted = accepted.scatter_reduce(0, of, rejected_at, reduce="amin")
    residual_rows = accepted < d
    p_at = target_probs[logit + accepted]  # [R, V]: p_a, where the row's draw comes from
    stream = torch.where(residual_rows, int(Stream.RESIDUAL), int(Stream.TARGET))
    if first[-1]:  # rows with a rejection: the residual max(p - q, 0)
        at = (i64(first[:-1], device) + accepted).clamp(max=first[-1] - 1)
        q_at = draft_probs[at]
        p_at = without_rejected(p_at, token[at], residual_rows)
        final = sample_residual(p_at, q_at, residual_rows, seeds, pos0 + accepted, stream)
    else:
        final = sample_from_probs(p_at, seeds, pos0 + accepted, stream)
    counts, tokens = torch.stack([accepted, final]).tolist()  # the one device sync
    return [(a, row.drafts[:a] + [t]) for a, t, row in zip(counts, tokens, rows, strict=True)]


def verify_coupled_batch(target_probs: torch.Tensor,
                         rows: list[SampledVerify]) -> list[tuple[int, list[int]]]:  # fmt: skip
    """Coupled verification (``SpecConfig.coupled_sampling``) of many rows, one device sync:
    at every query j of a row the target's own draw w_j, the exponential race of p_j on the
    TARGET stream at pos0 + j (the draw ``ar`` makes at that position); a row accepts its
    drafts while d_{j+1} == w_j and then takes w_a at its first mismatch a (or w_d).

    The drafts were raced on the same noise (TARGET stream, the positions they fill) over q,
    so where q is near p they win where p wins (``tests/test_coupled_sampling.py`` measures
    how often). Every token committed is a target draw, whatever was drafted: the text is
    p's sample, the same as ``ar``'s for a seeded request, and independent of the draft
    lengths (which lets the scheduler move them; ``DraftPolicy.keeps_its_target``).

    target_probs: [N, V] the step's sampling distributions, one per logit row; no q is read.
    """
    device = target_probs.device
    lens = [len(row.drafts) for row in rows]
    of = [r for r, n in enumerate(lens) for _ in range(n + 1)]  # each query's row
    j = [i for n in lens for i in range(n + 1)]  # its index in the row
    logit = i64([rows[r].logit_row + i for r, i in zip(of, j, strict=True)], device)
    seeds = i64([rows[r].seed for r in of], device)
    positions = i64([rows[r].pos0 + i for r, i in zip(of, j, strict=True)], device)
    won = sample_from_probs(target_probs[logit], seeds, positions, Stream.TARGET).tolist()
    out, at = [], 0
    for row, n in zip(rows, lens, strict=True):
        w = won[at : at + n + 1]
        at += n + 1
        accepted, _ = verify_greedy(w, row.drafts)
        out.append((accepted, row.drafts[:accepted] + [w[accepted]]))
    return out
