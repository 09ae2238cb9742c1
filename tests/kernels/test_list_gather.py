"""Triton page-list gather against ``gather_lists_ref`` (exact: page ids)."""

import pytest
import torch

from aspire_ray.kernels.list_gather import gather_lists
from aspire_ray.kernels.reference import gather_lists_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("shared_logical", [False, True], ids=["per_row", "one_row"])
def test_matches_reference(rows, shared_logical):
    gen = torch.Generator().manual_seed(rows)
    slots, width = rows + 4, 40
    table = torch.randperm(slots * width, generator=gen).view(slots, width).int()
    counts = torch.randint(0, width + 1, (rows,), generator=gen)
    counts[0] = 0  # an empty row first
    if shared_logical:  # the identity, expanded (row stride 0), as the full lists use it
        logical = torch.arange(width)[None, :].expand(rows, -1)
    else:  # out-of-range columns are clamped into the table
        logical = torch.randint(-3, width + 3, (rows, width - 5), generator=gen)
    row_slot = torch.randperm(slots, generator=gen)[:rows]
    capacity = int(counts.sum()) + 7
    args = [x.to(DEVICE) for x in (table, counts, logical, row_slot)] + [capacity]
    indptr, indices = gather_lists(*args)
    want_indptr, want_indices = gather_lists_ref(*args)
    assert torch.equal(indptr, want_indptr)
    assert torch.equal(indices, want_indices)
    assert int((indices != 0).sum()) > 0 or int(counts.sum()) == 0


def test_no_rows_and_bad_table():
    table = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    indptr, indices = gather_lists(table, empty, empty.view(0, 4), empty, 5)
    assert indptr.tolist() == [0] and indices.tolist() == [0] * 5
    with pytest.raises(ValueError, match="int32"):
        gather_lists(table.long(), empty, empty.view(0, 4), empty, 5)
