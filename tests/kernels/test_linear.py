"""Triton linear (``kernels.linear``) against ``F.linear``, and its batch invariance: a row's
output is bitwise the same whatever the other rows and their count (one fixed tiling, one
accumulation order over K), the property the deterministic mode needs (issue 18)."""

import pytest
import torch
import torch.nn.functional as F

from aspire_ray.kernels.linear import LinearConfig, triton_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = LinearConfig(block_m=16, block_n=16, block_k=32)  # the interpreter's pace


@pytest.mark.parametrize("m,n,k,bias", [(5, 40, 70, True), (16, 96, 128, False),
                                        (33, 17, 45, True)])  # fmt: skip
def test_matches_f_linear(m, n, k, bias):
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x, w, b = (t.to(DEVICE) if t is not None else None for t in (x, w, b))
    got = triton_linear(x, w, b, SMALL)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_a_row_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 72, generator=gen).to(DEVICE)
    row = torch.randn(1, 72, generator=gen).to(DEVICE)
    alone = triton_linear(row, w, cfg=SMALL)
    # other rows around it, more tiles of rows; at the same place in its tile of rows (the
    # interpreter's numpy matmul may round a row by its place in the block; a GPU's MMA not)
    for m, at in ((3, 0), (17, 16), (40, 32)):
        batch = torch.randn(m, 72, generator=gen).to(DEVICE)
        batch[at] = row[0]
        assert torch.equal(triton_linear(batch, w, cfg=SMALL)[at], alone[0]), (m, at)


def test_bad_shapes_are_refused():
    x, w = torch.randn(4, 8), torch.randn(6, 9)
    with pytest.raises(ValueError, match="need x"):
        triton_linear(x, w)
    with pytest.raises(ValueError, match="bias"):
        triton_linear(x, torch.randn(6, 8), torch.randn(5))


@pytest.mark.parametrize("n", [40, 2100], ids=["narrow", "wide"])
def test_the_deterministic_tiling_depends_on_the_weight_only(n):
    from aspire_ray.kernels.linear import invariant_config

    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, 48, generator=gen).to(DEVICE)
    rows = torch.randn(70, 48, generator=gen).to(DEVICE)
    cfg = invariant_config(*w.shape)
    full = triton_linear(rows, w, cfg=cfg)
    # rows 0 and 64 keep their place in a 64-row tile in a batch of 1 (and of 6)
    assert torch.equal(triton_linear(rows[:1], w, cfg=cfg)[0], full[0])
    assert torch.equal(triton_linear(rows[64:], w, cfg=cfg)[0], full[64])
    torch.testing.assert_close(full, F.linear(rows, w), atol=1e-4, rtol=1e-4)
