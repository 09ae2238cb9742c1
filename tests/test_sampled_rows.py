"""Sampled rows of an asynchronous run's step (``worker/sampled_rows.py``): each query's choice
read by the greedy acceptance gives what speculative rejection sampling's reference gives
(``rejection_sampler.verify_sampled_batch`` and the draft draw), on the same random streams;
the rejected draft is never drawn again."""

from __future__ import annotations

import torch

from aspire_ray.plan import Stream
from aspire_ray.worker import rejection_sampler as rs
from aspire_ray.worker import sampled_rows, sampler
from aspire_ray.worker.sampled_rows import sampled_choices

V, DEPTH = 40, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (kind, sampled, held, x_pos): draft rows have one query, verify rows held + 1
ROWS = [("draft", True, 2, 10), ("verify", True, 3, 20), ("verify", False, 2, 30),
        ("verify", True, 0, 40), ("draft", False, 1, 50), ("verify", True, 2, 60)]


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = len(ROWS)
    queries = [1 if kind == "draft" else held + 1 for kind, _, held, _ in ROWS]
    qo = torch.tensor([0] + queries).cumsum(0)
    t = int(qo[-1]) + 2  # two padding queries
    # sharp logits and drafts drawn from q near p: both acceptances and rejections happen
    logits = torch.randn(t, V, generator=g) * 3
    q_store = torch.zeros(DEPTH, n, V)
    chain = torch.zeros(DEPTH, n, dtype=torch.int64)
    for r, (_, _, held, _) in enumerate(ROWS):
        for j in range(held):
            q = torch.softmax(logits[int(qo[r]) + min(j, queries[r] - 1)]
                              + torch.randn(V, generator=g), dim=-1)  # fmt: skip
            q_store[j, r] = q
            chain[j, r] = torch.multinomial(q, 1, generator=g)
    return n, qo, t, logits, q_store, chain


def _row_tensors() -> tuple[torch.Tensor, ...]:
    """ROWS' per-row tensors: temperature, top_k, top_p (each row's own), sampled, verify,
    held, x_pos."""
    return (torch.tensor([0.9, 0.7, 1.0, 1.3, 1.0, 0.8]), torch.tensor([0, 12, 0, 0, 0, 5]),
            torch.tensor([0.95, 1.0, 1.0, 0.9, 1.0, 1.0]),
            torch.tensor([s for _, s, _, _ in ROWS]),
            torch.tensor([int(kind == "verify") for kind, _, _, _ in ROWS]),
            torch.tensor([h for _, _, h, _ in ROWS]),
            torch.tensor([x for _, _, _, x in ROWS]))  # fmt: skip


def test_choices_are_rejection_sampling():
    outcomes = set()
    temperature = torch.tensor([0.9, 0.7, 1.0, 1.3, 1.0, 0.8])
    top_k = torch.tensor([0, 12, 0, 0, 0, 5])
    top_p = torch.tensor([0.95, 1.0, 1.0, 0.9, 1.0, 1.0])
    for case in range(40):
        n, qo, t, logits, q_store, chain = _case(case)
        sampled = torch.tensor([s for _, s, _, _ in ROWS])
        verify = torch.tensor([int(kind == "verify") for kind, _, _, _ in ROWS])
        held = torch.tensor([h for _, _, h, _ in ROWS])
        x_pos = torch.tensor([x for _, _, _, x in ROWS])
        seed = torch.arange(n, dtype=torch.int64) * 7919 + case
        argmax = logits.argmax(dim=-1)
        store = q_store.clone()
        choice = sampled_choices(logits, argmax, qo, verify, held, x_pos, chain, sampled, seed,
                                 top_k, temperature, top_p, (True, True), store)  # fmt: skip
        for r, (kind, is_sampled, h, x) in enumerate(ROWS):
            lo = int(qo[r])
            mine = choice[lo : lo + (1 if kind == "draft" else h + 1)].tolist()
            k = slice(lo, lo + len(mine))
            probs = sampler.probs_from_logits_ref(
                logits[k], temperature[r].expand(len(mine)), top_k[r].expand(len(mine)),
                top_p[r].expand(len(mine)), True, True)  # fmt: skip
            # a row's planes are left as they were (the held drafts' q), but for a sampled
            # draft row's [held]: its new q
            drafted = kind == "draft" and is_sampled
            kept = [j for j in range(DEPTH) if not drafted or j != min(h, DEPTH - 1)]
            assert torch.equal(store[kept, r], q_store[kept, r])
            if not is_sampled:
                assert mine == argmax[k].tolist()
            elif kind == "draft":
                want = sampler.race_ref(probs, seed[r : r + 1], x_pos[r : r + 1] + h + 1,
                                        int(Stream.DRAFT))  # fmt: skip
                assert mine == want.tolist()
                assert torch.equal(store[h, r], probs[0])  # its q, beside its draft
            else:
                drafts = chain[:h, r].tolist()
                ((a, tokens),) = rs.verify_sampled_batch(
                    probs, [rs.SampledVerify(0, drafts, int(seed[r]), int(x) + 1)],
                    q_store[:h, r] if h else None)  # fmt: skip
                assert rs.verify_greedy(mine, drafts) == (a, tokens), (case, r)
                outcomes.add((h, a == h))
    # the batch saw rows accept all their drafts and rows reject one
    assert {(3, True), (3, False), (2, False)} <= outcomes, outcomes


def test_the_kernels_choose_and_keep_as_the_torch_code():
    """The Triton path (the acceptance test and ``race_gathered``, run here by Triton's
    interpreter without a GPU) against the torch code: the same choices and the same q store
    after (on a GPU both from the same probabilities, ``filter_probs``')."""
    temperature, top_k, top_p, sampled, verify, held, x_pos = _row_tensors()
    for case in range(6):
        n, qo, t, logits, q_store, chain = _case(case)
        seed = torch.arange(n, dtype=torch.int64) * 7919 + case
        runs = []
        for kernels in (False, True):
            store = q_store.clone().to(DEVICE)
            args = [x.to(DEVICE) for x in (logits, logits.argmax(dim=-1), qo, verify, held,
                                           x_pos, chain, sampled, seed, top_k, temperature,
                                           top_p)]  # fmt: skip
            choice = sampled_rows.sampled_choices(*args, (True, True), store, kernels)
            runs.append((choice.cpu(), store.cpu()))
        (want, want_store), (got, got_store) = runs
        assert torch.equal(got, want), case
        assert torch.equal(got_store, want_store), case


def test_the_rejected_draft_is_never_drawn_again():
    # p <= q everywhere: after a rejection the residual is all zero and the draw falls back
    # to p, without the rejected draft (token 0); both references and the batched code
    p = torch.tensor([[0.2, 0.3], [0.5, 0.5]])
    q = torch.tensor([[0.5, 0.5]])
    rejected = 0
    for seed in range(60):
        a, tokens = rs.verify_sampled(p, q, [0], seed, 5)
        ((a2, tokens2),) = rs.verify_sampled_batch(p, [rs.SampledVerify(0, [0], seed, 5)], q)
        assert (a, tokens) == (a2, tokens2)
        if a == 0:
            rejected += 1
            assert tokens == [1]
    assert 10 < rejected < 60


def test_coupled_choices_are_the_targets_draws():
    """``coupled=True`` (``SpecConfig.coupled_sampling``): a sampled query's choice is its own
    race on the TARGET stream at the position it predicts (a draft row's x_pos + held + 1, a
    verify row's j-th x_pos + 1 + j), from the Triton kernels (the interpreter here) as from
    the torch code; greedy rows keep their argmax; the q store is not touched. The greedy
    acceptance then gives ``verify_coupled_batch``'s tokens."""
    temperature, top_k, top_p, sampled, verify, held, x_pos = _row_tensors()
    n, qo, t, logits, q_store, chain = _case(3)
    seed = torch.arange(n, dtype=torch.int64) * 7919 + 3
    argmax = logits.argmax(dim=-1)
    runs = []
    for kernels in (False, True):
        store = q_store.clone().to(DEVICE)
        args = [x.to(DEVICE) for x in (logits, argmax, qo, verify, held, x_pos, chain, sampled,
                                       seed, top_k, temperature, top_p)]  # fmt: skip
        choice = sampled_rows.sampled_choices(*args, (True, True), store, kernels, coupled=True)
        assert torch.equal(store.cpu(), q_store)
        runs.append(choice.cpu())
    assert torch.equal(runs[0], runs[1])
    choice = runs[0]
    for r, (kind, is_sampled, h, x) in enumerate(ROWS):
        lo = int(qo[r])
        width = 1 if kind == "draft" else h + 1
        mine = choice[lo : lo + width].tolist()
        if not is_sampled:
            assert mine == argmax[lo : lo + width].tolist()
            continue
        probs = sampler.probs_from_logits_ref(
            logits[lo : lo + width], temperature[r].expand(width), top_k[r].expand(width),
            top_p[r].expand(width), True, True)  # fmt: skip
        first = x + 1 + (h if kind == "draft" else 0)
        want = sampler.race_ref(probs, seed[r].expand(width), torch.arange(first, first + width),
                                int(Stream.TARGET))  # fmt: skip
        assert mine == want.tolist(), r
        if kind == "verify":
            drafts = chain[:h, r].tolist()
            got = rs.verify_coupled_batch(probs, [rs.SampledVerify(0, drafts, int(seed[r]), x + 1)])
            assert [rs.verify_greedy(mine, drafts)] == got
