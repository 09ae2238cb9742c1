"""Sampled rows of an asynchronous run's step, decided on the device (issue 15: ``aspire`` at
temperature > 0 on its self-planning graphs).

A step of a run holds draft rows (one query) and verify rows (d + 1 queries [x_n, d_1..d_d]).
Greedy rows move on by the argmax of their queries (``step_rows.accept_rows``: a verify row
accepts the longest prefix of drafts equal to the argmax, then takes the argmax after it).
``sampled_choices`` turns a step's argmax into each query's *choice*, so that the same
acceptance moves sampled rows on exactly as speculative rejection sampling does
(``rejection_sampler.verify_sampled_batch``, its reference and the host-planned steps' code):

    draft row    choice = its draw from q = probs_from_logits(its logits), on the DRAFT
                 stream at the position it predicts; q is kept, q_store[drafts held, row]
    verify row   a = the first j whose draft d_{j+1} fails u_j * q_j(d) <= p_j(d) (u on the
                 ACCEPT stream at position x_pos + 1 + j), or d; choices d_1..d_a, then at
                 query a the draw from the residual max(p_a - q_a, 0) (RESIDUAL stream) if a
                 < d, else from p_d (TARGET stream), at position x_pos + 1 + a

The drawn token after a rejection is never the rejected draft (its residual weight is 0: p <
q there), so the acceptance stops at it. Where the residual is all zero in float32 (p <= q
everywhere: impossible in exact arithmetic) the draw falls back to p without the rejected
draft, here and in the reference alike.

Every operation is a tensor op over fixed shapes (capturable): the step's [t, V] probabilities
once, one draw a row (``kernels/race.py``'s ``race_gathered`` on a GPU, which reads each row's
distribution where it lies and keeps a draft row's q, ``draw_rows_ref`` elsewhere), the
acceptance test (``kernels/accept.py`` on a GPU, ``rejected_at_ref`` elsewhere), and the small
per-query and per-row tensors around them in three launches on a GPU
(``kernels/choice_rows.py``; ``query_layout_ref``, ``row_draws_ref`` and ``choose_ref`` here).
"""

from __future__ import annotations

import numpy as np
import torch

from aspire_ray.kernels.host import upload
from aspire_ray.model.rotary import fused_ops
from aspire_ray.plan import Stream

from . import sampler
from .rejection_sampler import without_rejected


def rejected_at_ref(probs: torch.Tensor, q_store: torch.Tensor, chain: torch.Tensor,
                    row: torch.Tensor, j: torch.Tensor, checks: torch.Tensor,
                    seed: torch.Tensor, x_pos: torch.Tensor,
                    held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each query's acceptance test (``kernels/accept.py``'s reference): probs [t, V], q_store
    [D, n, V], chain [D, n], row / j / checks [t], seed / x_pos / held [n] -> (j where query
    j of its row tests its draft d_{j+1} and rejects it, u * q(d) > p(d) with u on the ACCEPT
    stream at x_pos + 1 + j, else held[row]; the draft it tests, chain[min(j, D - 1), row])."""
    jc = j.clamp(max=chain.shape[0] - 1)
    token = chain[jc, row]
    p_tok = probs[torch.arange(len(j), device=j.device), token].double()
    q_tok = q_store[jc, row, token].double()
    u = sampler.uniform(seed[row], x_pos[row] + 1 + j, int(Stream.ACCEPT), 1)[:, 0]
    return torch.where(checks & (u * q_tok > p_tok), j, held[row]), token


def sampled_choices(logits: torch.Tensor, argmax: torch.Tensor, qo: torch.Tensor,
                    verify: torch.Tensor, held: torch.Tensor, x_pos: torch.Tensor,
                    chain: torch.Tensor, sampled: torch.Tensor, seed: torch.Tensor,
                    top_k: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    variant: tuple[bool, bool], q_store: torch.Tensor,
                    kernels: bool | None = None,
                    coupled: bool = False) -> torch.Tensor:  # fmt: skip
    """Each query's choice (module docstring); greedy rows keep their argmax. With
    ``coupled`` (``SpecConfig.coupled_sampling``) a sampled query's choice is its own draw on
    the TARGET stream at the position it predicts, a draft row's from q and a verify row's
    from p alike, and the greedy acceptance after this moves every row on: a verify row
    keeps its drafts while each equals the target's draw before it, then takes that draw
    (``rejection_sampler.verify_coupled_batch``); q_store is neither read nor written.

    logits [t, V] (float32; on a GPU the model's dtype, ``DecoderModel.sampling_logits``);
    argmax int64 [t]; qo [n + 1] the rows' query offsets (queries past
    qo[n]: padding); per row [n]: verify (> 0: the row verifies its drafts), held int64
    (drafts held before the step), x_pos int64 (position of x_n), sampled bool (padding rows
    False), seed, top_k int64, temperature, top_p float32; chain int64 [D, n] the drafts held;
    variant: (need_k, need_p) of ``sampler.probs_from_logits``; q_store float32 [D, n, V] the
    q of each held draft; a sampled draft row's new q is written in place at its plane
    [held]; kernels: the Triton launches (True; on the CPU under Triton's interpreter) or the
    torch references (False) for all but the probabilities (None: Triton on a GPU).
    -> int64 [t].
    """
    t = logits.shape[0]
    if fused_ops(logits) if kernels is None else kernels:
        from aspire_ray.kernels import accept, choice_rows, race

        layout, outcome, draw, choose = (choice_rows.query_layout, choice_rows.row_draws,
                                         race.race_gathered, choice_rows.choose)  # fmt: skip
        test = accept.rejected_at
    else:
        layout, outcome, draw, choose = query_layout_ref, row_draws_ref, draw_rows_ref, choose_ref
        test = rejected_at_ref
    row, j, live, q_temperature, q_top_k, q_top_p, checks, d = layout(
        qo, sampled, verify, held, temperature, top_k, top_p, t)
    probs = sampler.probs_from_logits(logits, q_temperature, q_top_k, q_top_p, *variant)
    if coupled:  # a draft row's query predicts x_pos + held + 1, a verify row's j-th x_pos + 1 + j
        position = x_pos[row] + 1 + torch.where(verify[row] > 0, j, held[row])
        won = sampler.sample_from_probs(probs, seed[row], position, int(Stream.TARGET))
        return torch.where(live, won, argmax)
    # verify rows: each query's test of its draft, then each row's first rejected draft a
    # (d where none is) and its one draw, in one race (its cost is per row): a draft row's
    # from q, its first query's distribution, on the DRAFT stream at the position it
    # predicts; a verify row's last token from the residual at its first rejection without
    # the rejected draft (RESIDUAL stream), else from p_d (TARGET), at x_pos + 1 + a. A
    # sampled draft row keeps its q at plane [held]; no other row's is read again.
    rejected_at, token = test(probs, q_store, chain, row, j, checks, seed, x_pos, d)
    a, rows, planes, keep, exclude, residual, position, stream = outcome(
        qo, rejected_at, d, verify, sampled, held, x_pos, chain)
    drawn = draw(probs, rows, q_store, planes, keep, exclude, residual, seed, position, stream)
    return choose(argmax, token, drawn, a, row, j, live, verify)


def query_layout_ref(qo: torch.Tensor, sampled: torch.Tensor, verify: torch.Tensor,
                     held: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, t: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``kernels.choice_rows.query_layout`` in torch: each query's row and index in it,
    whether it is a live sampled query, its sampling parameters (neutral elsewhere), whether
    it tests a draft; each row's drafts under test d."""
    n, dev = held.shape[0], held.device
    bounds, i = qo.long(), torch.arange(t, device=dev)
    row = _row_of(bounds, i, n)
    j = i - bounds[row]  # each query's index in its row
    live = (i < bounds[n]) & sampled[row]  # queries of sampled rows
    verifying = verify > 0
    d = torch.where(verifying, held, 0)
    checks = live & verifying[row] & (j < d[row])
    return (row, j, live, torch.where(live, temperature[row], 1.0),
            torch.where(live, top_k[row], 0), torch.where(live, top_p[row], 1.0), checks, d)


def _row_of(bounds: torch.Tensor, i: torch.Tensor, n: int) -> torch.Tensor:
    """Each query's row, int64 [t], from the rows' query offsets [n + 1] (padding queries
    past bounds[n] counted in the last row)."""
    return torch.searchsorted(bounds[1:].contiguous(), i, right=True).clamp(max=n - 1)


def row_draws_ref(qo: torch.Tensor, rejected_at: torch.Tensor, d: torch.Tensor,
                  verify: torch.Tensor, sampled: torch.Tensor, held: torch.Tensor,
                  x_pos: torch.Tensor,
                  chain: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``kernels.choice_rows.row_draws`` in torch: each row's first rejected draft a and
    the arguments of its draw (``draw_rows_ref``)."""
    n, t, depth = d.shape[0], rejected_at.shape[0], chain.shape[0]
    bounds = qo.long()
    row = _row_of(bounds, torch.arange(t, device=d.device), n)
    a = d.scatter_reduce(0, row, rejected_at, reduce="amin")
    verifying = verify > 0
    residual = sampled & verifying & (a < d)
    ac = a.clamp(max=depth - 1)
    rows = (bounds[:n].clamp(max=t - 1) + a).clamp(max=t - 1)
    keep = torch.where(sampled & ~verifying, held.clamp(max=depth - 1), -1)
    exclude = torch.where(residual, chain[ac, torch.arange(n, device=d.device)], -1)
    position = torch.where(verifying, x_pos + 1 + a, x_pos + held + 1)
    stream = torch.where(verifying, torch.where(residual, int(Stream.RESIDUAL),
                                                int(Stream.TARGET)), int(Stream.DRAFT))
    return a, rows, ac, keep, exclude, residual, position, stream


def choose_ref(argmax: torch.Tensor, token: torch.Tensor, drawn: torch.Tensor, a: torch.Tensor,
               row: torch.Tensor, j: torch.Tensor, live: torch.Tensor,
               verify: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``kernels.choice_rows.choose`` in torch: a live draft row's query takes its draw; a
    live verify row's queries its tested drafts before a, its draw at a; others the argmax."""
    verifying = verify[row] > 0
    choice = torch.where(live & ~verifying & (j == 0), drawn[row], argmax)
    in_verify = live & verifying
    choice = torch.where(in_verify & (j < a[row]), token, choice)
    return torch.where(in_verify & (j == a[row]), drawn[row], choice)


def draw_rows_ref(probs: torch.Tensor, rows: torch.Tensor, store: torch.Tensor,
                  planes: torch.Tensor, keep_planes: torch.Tensor, exclude: torch.Tensor,
                  use_minus: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  stream: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``kernels.race.race_gathered`` in torch (its reference; shapes there): draw i from
    probs[rows[i]] with column exclude[i] zeroed (-1: none), or from its residual against
    store[planes[i], i] where use_minus[i]; the weights drawn from kept at
    store[keep_planes[i], i] where that is >= 0 (read before the write, as the kernel
    never writes a plane it reads)."""
    cols = torch.arange(rows.shape[0], device=probs.device)
    excluded = exclude >= 0
    w = without_rejected(probs[rows], exclude.clamp(min=0), excluded)  # [N, V]
    drawn = sampler.sample_residual(w, store[planes, cols], use_minus, seeds, positions, stream)
    at = keep_planes.clamp(min=0)
    store[at, cols] = torch.where((keep_planes >= 0)[:, None], w, store[at, cols])
    return drawn


def chain_of(drafts: list[list[int]], device: torch.device) -> torch.Tensor:
    """Each row's drafts held (host lists) as ``sampled_choices``' chain, int64 [D, n] with D
    one more than the most any row holds (a draft row writes its q at [held]), one upload."""
    chain = np.zeros((max(map(len, drafts), default=0) + 1, len(drafts)), dtype=np.int64)
    for r, row in enumerate(drafts):
        chain[: len(row), r] = row
    return upload(chain, device)


def host_choices(logits: torch.Tensor, argmax: torch.Tensor, offsets: list[int],
                 verify: list[bool], held: list[int], x_pos: list[int], chain: torch.Tensor,
                 specs: list, qs: list[list[torch.Tensor]],
                 coupled: bool = False) -> tuple[torch.Tensor, list]:  # fmt: skip
    """``sampled_choices`` of a step planned on the host, from host lists: offsets [n + 1]
    its rows' logit rows; per row whether it verifies, the drafts it holds, x_pos, its
    SamplingSpec and the q of its drafts held (float32 [V] each); chain int64 [D, n] those
    drafts, D > every draft row's held. -> (the choices, each sampled draft row's new q, its
    own copy, None for the other rows; with ``coupled`` None for every row: no q is kept)."""
    n, dev = len(specs), logits.device
    # only the verify rows' q are read (a draft row's are written at [held]): the rest is
    # left unset, not zeroed (tens of MB a step on a CPU at 64 rows)
    depth, v = (1, 1) if coupled else (chain.shape[0], logits.shape[1])
    q_store = torch.empty(depth, n, v, dtype=torch.float32, device=dev)
    for r, q in enumerate([] if coupled else qs):
        if q and verify[r]:
            q_store[: len(q), r] = torch.stack(q)

    ints, floats = sampler.i64, sampler.f32  # through pinned memory: no sync each
    choices = sampled_choices(
        logits, argmax, ints(offsets, dev), ints([int(v) for v in verify], dev),
        ints(held, dev), ints(x_pos, dev), chain, ints([not s.greedy for s in specs], dev) > 0,
        ints([s.seed for s in specs], dev), ints([s.top_k for s in specs], dev),
        floats([1.0 if s.greedy else s.temperature for s in specs], dev),
        floats([s.top_p for s in specs], dev), sampler.need_flags(specs), q_store,
        coupled=coupled)
    new_q = [None if s.greedy or v or coupled else q_store[h, r].clone()
             for r, (s, v, h) in enumerate(zip(specs, verify, held, strict=True))]  # fmt: skip
    return choices, new_q
