"""The split-K few-token linear against its reference (under the Triton interpreter on CPU)."""

import pytest
import torch

from aspire_ray.kernels.reference import linear_ref
from aspire_ray.kernels.skinny_linear import (
    MAX_M,
    SkinnyConfig,
    counters,
    fits,
    skinny_linear,
    split_k,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol): both sides accumulate in fp32 and round once; the order of the K sums differs
TOLERANCES = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (M, N, K): one split and many, K and N not multiples of the tiles, one row, MAX_M rows
SHAPES = [(1, 64, 128), (5, 100, 1000), (16, 192, 256), (MAX_M, 72, 384), (33, 130, 200),
          (3, 40, 2100)]


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"m{m}-n{n}-k{k}" for m, n, k in SHAPES])
def test_matches_reference(shape, bias, dtype):
    m, n, k = shape
    x = _randn(m, k, dtype=dtype, seed=0)
    w = _randn(n, k, dtype=dtype, seed=1) / k**0.5
    b = _randn(n, dtype=dtype, seed=2) if bias else None
    got = skinny_linear(x, w, b)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, linear_ref(x, w, b), atol=atol, rtol=rtol)
    assert torch.equal(skinny_linear(x, w, b), got)  # fixed split order: same bits again
    assert not counters(DEVICE).any()  # every tile's counter back at zero


def test_strided_rows_and_splits():
    # x as a view with a row stride wider than K (a slice of a larger buffer)
    base = _randn(8, 600, dtype=torch.bfloat16, seed=3)
    x = base[:, :500]
    w = _randn(64, 500, dtype=torch.bfloat16, seed=4)
    cfg = SkinnyConfig(min_k_blocks=1)
    splits, per = split_k(64, 500, 4, cfg)
    assert splits > 1 and per % 128 == 0 and splits * per >= 500 > (splits - 1) * per
    got = skinny_linear(x, w, config=cfg)
    torch.testing.assert_close(got, linear_ref(x, w, None), atol=0.1, rtol=1.6e-2)


def test_fits_and_bad_input():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert fits(torch.zeros(4, 16, dtype=torch.bfloat16), w)
    assert not fits(torch.zeros(MAX_M + 1, 16, dtype=torch.bfloat16), w)  # cuBLAS's batch
    assert not fits(torch.zeros(4, 16), w.float())  # fp32 keeps cuBLAS (exact fp32 runs)
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.zeros(MAX_M + 1, 16, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(torch.zeros(4, 15, dtype=torch.bfloat16), w)
