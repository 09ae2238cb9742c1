"""Triton row planning against ``plan_rows_ref`` (exact: token ids, positions, slots, page ids):
ragged rows of an asynchronous run (draft and verify rows, padding rows), uniform draft rows
and uniform verify rows, under each page policy's layout."""

import numpy as np
import pytest
import torch

from aspire_ray.config import SpecConfig
from aspire_ray.kernels.reference import (
    accept_rows_ref,
    plan_rows_ref,
    score_lists_ref,
    store_row_scores_ref,
)
from aspire_ray.kernels.row_plan import accept_rows, plan_rows, score_lists, store_row_scores
from aspire_ray.worker.page_policies import FullPages, StreamingWindow, TopKPages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PS, WIDTH, DRAFTS = 4, 40, 6
POLICIES = {"window": StreamingWindow, "topk": TopKPages, "full": FullPages}


def _layout(policy: str) -> torch.Tensor:
    cfg = SpecConfig(k_min=3, recent_pages=2, rho=0.2)
    head, top, tail = POLICIES[policy](cfg).layout(np.arange(WIDTH + 1))
    return torch.from_numpy(np.stack([head, top, tail]).astype(np.int32))


def _case(n: int, live: int, seed: int, ragged: bool):
    gen = torch.Generator().manual_seed(seed)
    slots = n + 3
    table = torch.randperm(slots * WIDTH, generator=gen).view(slots, WIDTH).int() + 1
    flags = torch.zeros(n, dtype=torch.long)
    flags[torch.randperm(n, generator=gen)[:live]] = 1 | 2  # a scored row's bits
    held = torch.randint(0, DRAFTS + 1, (n,), generator=gen)
    state = {
        "slot": torch.randperm(slots, generator=gen)[:n],
        "flags": flags,
        "x_id": torch.randint(0, 1000, (n,), generator=gen),
        # the last query stays inside the table: x_pos + held < WIDTH * PS
        "x_pos": torch.randint(0, WIDTH * PS - DRAFTS - 1, (n,), generator=gen),
    }
    if ragged:
        state["held"] = held
        state["gamma"] = torch.randint(0, DRAFTS + 1, (n,), generator=gen)
    chain = torch.randint(0, 1000, (DRAFTS, n), generator=gen)
    return state, chain, table


def _check(state, chain, table, policy, tokens, **kw):
    to = lambda x: x.to(DEVICE)  # noqa: E731
    state = {k: to(v) for k, v in state.items()}
    chain, table, layout = to(chain), to(table), to(_layout(policy))
    n = state["slot"].shape[0]
    caps = dict(sparse_capacity=n * WIDTH + 5, full_capacity=n * WIDTH + 3)
    want_inputs = torch.full((3, tokens + 4), 77, dtype=torch.long, device=DEVICE)
    inputs = want_inputs.clone()
    want = plan_rows_ref(state, chain, table, layout, PS, tokens, want_inputs, **caps, **kw)
    got = plan_rows(state, chain, table, layout, PS, tokens, inputs, **caps, **kw)
    assert torch.equal(inputs, want_inputs)  # columns past ``tokens`` untouched
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    return want


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("n,live", [(1, 1), (5, 3), (19, 19)])
def test_ragged_rows(policy, n, live):
    state, chain, table = _case(n, live, seed=n + live, ragged=True)
    tokens = n * (DRAFTS + 1) + 3  # room for every row verifying, and padding tokens
    want = _check(state, chain, table, policy, tokens)
    rows = want["rows"]
    assert int(rows[0].sum()) == int(want["qo"][-1]) <= tokens
    if live == n and n > 1:  # both kinds of row were planned
        assert 0 < int(rows[3].sum()) < n


@pytest.mark.parametrize("policy", ["window", "topk"])
@pytest.mark.parametrize("queries,verify_all", [(1, False), (5, True)])
def test_uniform_rows(policy, queries, verify_all):
    state, chain, table = _case(9, 6, seed=queries, ragged=False)
    want = _check(state, chain, table, policy, 9 * queries + 2, queries=queries,
                  verify_all=verify_all)  # fmt: skip
    assert want["qo"].tolist() == [r * queries for r in range(10)]


@pytest.mark.parametrize("ragged", [True, False], ids=["async", "uniform"])
def test_acceptance(ragged):
    n = 13
    state, chain, table = _case(n, 10, seed=7, ragged=ragged)
    kw = {} if ragged else dict(queries=4, verify_all=True)
    tokens = n * (DRAFTS + 1) + 2
    inputs = torch.zeros(3, tokens, dtype=torch.long)
    plan = plan_rows_ref(state, chain, table, _layout("topk"), PS, tokens, inputs, n * WIDTH,
                         **kw)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    # the target agrees with a random prefix of each row's drafts
    argmax = torch.randint(0, 1000, (tokens,), generator=gen)
    agree = torch.rand(tokens, generator=gen) < 0.7
    argmax[:-1] = torch.where(agree[:-1], inputs[0, 1:], argmax[:-1])
    args = [x.to(DEVICE) for x in (argmax, inputs[0], plan["qo"], plan["rows"])]
    start_pos = state["x_pos"] + 100
    outs = {}
    for name, fn in (("ref", accept_rows_ref), ("kernel", accept_rows)):
        x_id, x_pos, c = (t.clone().to(DEVICE) for t in (state["x_id"], state["x_pos"], chain))
        held = state["held"].clone().to(DEVICE) if ragged else None
        fn(*args, x_id, x_pos, start_pos.to(DEVICE), c, held)
        outs[name] = (x_id, x_pos, c, held)
    for got, want in zip(outs["kernel"], outs["ref"], strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    x_id, x_pos, c, held = outs["ref"]
    verified = (plan["rows"][3] > 0) & (plan["rows"][5] > 0)
    moved = x_pos.cpu() - start_pos
    assert bool(((moved >= 1) | ~verified).all())  # a verify row commits at least one token
    assert int(moved[verified].max()) > 1  # and some accept drafts
    assert torch.equal(x_id.cpu()[~verified], state["x_id"][~verified])
    if ragged:  # draft rows held one more, verify rows none
        drafted = (plan["rows"][5] > 0) & ~verified
        assert torch.equal(held.cpu()[drafted], state["held"][drafted] + 1)
        assert bool((held.cpu()[verified] == 0).all())


def test_queries_past_the_token_bucket_are_dropped():
    # a bucket smaller than the rows' queries: the tokens that fit are written, no column past
    # it (the graphs size their bucket from the host's layout; this guards a stale one)
    state, chain, table = _case(7, 7, seed=11, ragged=True)
    state["gamma"].zero_()  # every row verifies its drafts
    want = plan_rows_ref(state, chain, table, _layout("window"), PS, 1000,
                         torch.zeros(3, 1000, dtype=torch.long), 7 * WIDTH)  # fmt: skip
    total = int(want["qo"][-1])
    assert total > 8
    _check(state, chain, table, "window", total - 5)


def _scoring_case(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    slots = n + 3
    table = torch.randperm(slots * WIDTH, generator=gen).view(slots, WIDTH).int() + 1
    live = torch.rand(n, generator=gen) < 0.8
    single = torch.rand(n, generator=gen) < 0.5
    seen_last = torch.randint(1, WIDTH * PS + 1, (n,), generator=gen)
    seen_first = (seen_last - torch.randint(0, 7, (n,), generator=gen)).clamp(min=1)
    first = torch.randint(0, 50, (n,), generator=gen)
    last = first + torch.randint(0, 7, (n,), generator=gen)
    row_slot = torch.where(live, torch.randperm(slots, generator=gen)[:n], 0)
    return first, last, seen_first, seen_last, live, single, row_slot, table


@pytest.mark.parametrize("mode", ["first_last", "single", "identity"])
@pytest.mark.parametrize("n", [1, 6, 21])
def test_score_lists(mode, n):
    first, last, seen_first, seen_last, live, single, row_slot, table = _scoring_case(n, n)
    if mode == "identity":
        first = last = None
        seen_first = seen_last
    kw = dict(single=single if mode == "single" else None)
    args = [first, last, seen_first, seen_last, live]
    rest = [row_slot, table, PS, 2 * n * WIDTH + 3, 4 * PS, 2 * n * WIDTH // 4 + 2 * n]
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    want = score_lists_ref(*args, kw["single"], *rest)
    got = score_lists(*[to(x) for x in args], to(kw["single"]), to(row_slot), to(table),
                      *rest[2:])  # fmt: skip
    count = int(want["count"])
    for key in want:
        w, g = want[key], got[key].cpu()
        if key == "work":
            w, g = w[:, :count], g[:, :count]
        assert torch.equal(g, w), key
    assert count > 0 and int(want["pages"][1::2].sum()) >= 0
    if mode == "identity":
        assert int(want["pages"][1::2].sum()) == 0  # one query a row


@pytest.mark.parametrize("single", ["rows", "every", "none"])
def test_store_row_scores(single):
    n = 9
    first, last, seen_first, seen_last, live, single_rows, row_slot, table = _scoring_case(n, 5)
    which = {"rows": single_rows, "every": True, "none": None}[single]
    lists = score_lists_ref(first, last, seen_first, seen_last, live, None, row_slot, table, PS,
                            2 * n * WIDTH, 4 * PS, 2 * n * WIDTH)  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    page_scores = torch.rand(2 * n * WIDTH, generator=gen)
    slot = torch.randperm(n + 3, generator=gen)[:n]
    base = torch.rand(n + 4, WIDTH + 6, generator=gen)  # wider than a page table row
    want = base.clone()
    store_row_scores_ref(page_scores, lists["indptr"], lists["pages"], live, which, slot, want)
    got = base.clone().to(DEVICE)
    to = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
    store_row_scores(to(page_scores), to(lists["indptr"]), to(lists["pages"]), to(live),
                     to(which), to(slot), got)  # fmt: skip
    # every row but the scratch row (padding rows all write it: any of them may win)
    assert torch.equal(got.cpu()[:-1], want[:-1])
    assert not torch.equal(want[:-1], base[:-1])
