"""Triton argmax over rows of logits (``kernels.argmax``) against ``torch.argmax``: the first
index of the largest value, whether the ties fall in one chunk or in several."""

import pytest
import torch

from aspire_ray.kernels.argmax import BLOCK, argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [7, BLOCK, 2 * BLOCK + 333])
def test_matches_torch_argmax(dtype, v):
    gen = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=gen).to(dtype)
    x[1] = 0.0  # every column tied: the first
    x[2, v // 2] = x[2, v - 1] = 50.0  # a tie in the row's last chunk and an earlier one
    x[3, -1] = 60.0  # the last column
    x = x.to(DEVICE)
    assert torch.equal(argmax_rows(x).cpu(), x.argmax(dim=-1).cpu())


def test_strided_rows_and_an_out_buffer():
    gen = torch.Generator().manual_seed(1)
    padded = torch.randn(5, BLOCK + 100, generator=gen).to(DEVICE)
    x = padded[:, : BLOCK + 37]  # the LM head's padded vocabulary, cut
    padded[:, BLOCK + 37 :] = 1e9  # past the view: never read
    out = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(x, out) is out
    assert torch.equal(out.cpu(), x.argmax(dim=-1).cpu())


def test_no_rows_and_bad_input():
    assert argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="contiguous last dim"):
        argmax_rows(torch.zeros(10, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="out must be"):
        argmax_rows(torch.zeros(3, 4, device=DEVICE), torch.zeros(3, device=DEVICE))
