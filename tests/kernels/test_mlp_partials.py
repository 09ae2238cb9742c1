"""The one-launch MLP (``kernels.mlp_partials``) and the norm that sums its partials
(``fused_norm.rms_norm_parts``) against their references, and the pair against the unfused MLP
+ RMSNorm they replace (CPU: Triton's interpreter, float32; bf16 on a GPU)."""

import pytest
import torch
import torch.nn.functional as F

from aspire_ray.kernels.fused_norm import rms_norm, rms_norm_parts
from aspire_ray.kernels.mlp_partials import MLPConfig, mlp_partials
from aspire_ray.kernels.reference import (
    mlp_partials_ref,
    rms_norm_parts_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = MLPConfig(block_m=16, block_i=16, block_k=16, block_n=16)  # the interpreter's pace
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def _mlp(m, h, i, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen).to(dtype).to(DEVICE)
    w_gu = (torch.randn(2 * i, h, generator=gen) / h**0.5).to(dtype).to(DEVICE)
    w_d = (torch.randn(h, i, generator=gen) / i**0.5).to(dtype).to(DEVICE)
    return x, w_gu, w_d


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,h,i", [(5, 48, 40), (16, 32, 32), (33, 24, 70)])
def test_partials_match_the_reference(m, h, i, dtype):
    # rows past a tile (33), an intermediate past a slice (40, 70), hidden past a chunk (24, 48)
    x, w_gu, w_d = _mlp(m, h, i, dtype)
    cfg = SMALL if DEVICE == "cpu" else MLPConfig()
    got = mlp_partials(x, w_gu, w_d, cfg)
    want = mlp_partials_ref(x, w_gu, w_d, cfg.block_i)
    assert got.shape == (-(-i // cfg.block_i), m, h) and got.dtype == torch.float32
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partials_sum_to_the_unfused_mlp_and_norm(dtype):
    # what the decoder replaces: x -> down(silu_and_mul(gate_up(x))) -> residual add + norm
    m, h, i = 12, 40, 56
    x, w_gu, w_d = _mlp(m, h, i, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    residual = torch.randn(m, h, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).to(DEVICE)
    mlp_out = F.linear(silu_and_mul_ref(F.linear(x, w_gu)), w_d)
    res_want = residual.clone()
    want = rms_norm_ref(mlp_out, weight, 1e-6, res_want)
    cfg = SMALL if DEVICE == "cpu" else MLPConfig()
    res_got = residual.clone()
    got = rms_norm_parts(mlp_partials(x, w_gu, w_d, cfg), weight, 1e-6, res_got)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(res_got, res_want, atol=atol, rtol=rtol)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def _norm_case(s, m, n, seed):
    """parts float32 [s, m, n], residual [m, n], weight [n]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(s, m, n, generator=gen).to(DEVICE),
            torch.randn(m, n, generator=gen).to(DEVICE), torch.randn(n, generator=gen).to(DEVICE))


# (slices, rows, features, seed, the residual's tolerance): 3 slices in one load; 1,000
# features, 8 slices a load: 20 slices in three loads (the last one partial)
@pytest.mark.parametrize("s,m,n,seed,res_tol", [(3, 7, 24, 3, 1e-6), (20, 3, 1000, 4, 1e-5)],
                         ids=["one-load", "three-loads"])
def test_norm_of_parts_matches_its_reference(s, m, n, seed, res_tol):
    parts, residual, weight = _norm_case(s, m, n, seed)
    r_got, r_want = residual.clone(), residual.clone()
    got = rms_norm_parts(parts, weight, 1e-5, r_got)
    want = rms_norm_parts_ref(parts, weight, 1e-5, r_want)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_got, r_want, atol=res_tol, rtol=res_tol)


def test_norm_of_one_part_is_the_plain_norm():
    # one slice: the fused add + norm of that slice's values (kernels.fused_norm.rms_norm)
    parts, residual, weight = _norm_case(3, 7, 24, 3)
    r_one, r_plain = residual.clone(), residual.clone()
    torch.testing.assert_close(rms_norm_parts(parts[:1], weight, 1e-5, r_one),
                               rms_norm(parts[0].clone(), weight, 1e-5, r_plain))
    assert torch.equal(r_one, r_plain)


def test_bad_shapes_are_refused():
    x, w_gu, w_d = _mlp(4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="w_d must be"):
        mlp_partials(x, w_gu, w_d.t().contiguous())
    with pytest.raises(ValueError, match="even row count"):
        mlp_partials(x, w_gu[:-1], w_d)
    with pytest.raises(ValueError, match="parts must be"):
        rms_norm_parts(torch.zeros(4, 16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6,
                       torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm_parts(torch.zeros(1, 4, 16, device=DEVICE), torch.ones(16, device=DEVICE),
                       1e-6, torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="block_i"):
        MLPConfig(block_i=24)
