"""Triton top-k page choice against ``choose_top_pages_ref`` (exact: page ids)."""

import pytest
import torch

from aspire_ray.kernels.reference import choose_top_pages_ref
from aspire_ray.kernels.top_pages import choose_top_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(n_rows: int, width: int, first: int, seed: int, ties: bool):
    """Rows over a page table of ``width`` pages: each its candidate count (up to width -
    first), n_top <= candidates (0 and all included), its middle's offset in a template."""
    gen = torch.Generator().manual_seed(seed)
    slots = n_rows + 3
    pages = torch.randperm(slots * width, generator=gen).view(slots, width).int()
    scores = torch.rand(slots + 1, width + 5, generator=gen)
    if ties:  # coarse values: many exact ties, zeros among them (and -0.0, which ties +0.0)
        scores = (scores * 4).floor() / 4
        scores[scores == 0.25] = -0.0
    max_cand = width - first
    n_cand = torch.randint(0, max_cand + 1, (n_rows,), generator=gen)
    n_cand[0] = max_cand
    n_top = (torch.rand(n_rows, generator=gen) * (n_cand + 1)).long().clamp(max=n_cand)
    n_top[0], n_top[-1] = n_cand[0], 0
    slot = torch.randperm(slots, generator=gen)[:n_rows]
    dst = torch.cumsum(torch.cat([torch.tensor([2]), n_top[:-1] + 3]), 0)
    template = torch.full((int(dst[-1] + n_top[-1] + 4),), -7, dtype=torch.int32)
    rows = torch.stack([slot, n_cand, n_top, dst]).int()
    has = torch.rand(n_rows, generator=gen) < 0.7
    return [x.to(DEVICE) for x in (template, pages, scores, rows, has)] + [first, max_cand]


@pytest.mark.parametrize("width", [1, 9, 64, 300])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("first", [0, 1])
def test_matches_reference(width, ties, first):
    if first >= width:
        pytest.skip("no candidates")
    for seed in range(3):
        case = make_case(7, width, first, seed, ties)
        got = choose_top_pages(*case)
        want = choose_top_pages_ref(*case)
        assert torch.equal(got, want), (seed, got, want)
        assert int((got != -7).sum()) == int(case[3][2].sum()) > 0  # n_top pages a row
        assert torch.equal(case[0], torch.full_like(case[0], -7))  # template unchanged


def test_no_rows_and_bad_inputs():
    template = torch.arange(5, dtype=torch.int32, device=DEVICE)
    pages = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    scores = torch.zeros(3, 4, device=DEVICE)
    rows = torch.zeros(4, 0, dtype=torch.int32, device=DEVICE)
    has = torch.zeros(0, dtype=torch.bool, device=DEVICE)
    assert torch.equal(choose_top_pages(template, pages, scores, rows, has, 0, 4), template)
    with pytest.raises(ValueError, match="int32"):
        choose_top_pages(template.long(), pages, scores, rows, has, 0, 4)
    with pytest.raises(ValueError, match="float32"):
        choose_top_pages(template, pages, scores.double(), rows, has, 0, 4)
