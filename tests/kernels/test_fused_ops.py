"""Fused RMSNorm (+ residual), RoPE and SiLU-and-mul against their references."""

import pytest
import torch

from aspire_ray.kernels.activation import silu_and_mul
from aspire_ray.kernels.fused_norm import rms_norm
from aspire_ray.kernels.kv_store import store_kv
from aspire_ray.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref
from aspire_ray.kernels.rope import rotary_embedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol) per dtype: bf16/fp16 allow one output ulp (the interpreter rounds bf16 by
# truncation; on the GPU rsqrt/exp are approximate and products may be fused).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _randn(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _close(got, expected):
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n", [64, 96], ids=["n64", "n96-padded"])
def test_rms_norm(dtype, n):
    x = _randn(7, n, dtype=dtype)
    w = (1 + 0.1 * _randn(n, dtype=torch.float32, seed=1)).to(dtype)
    _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rms_norm_with_residual(dtype):
    x, res = _randn(5, 64, dtype=dtype), _randn(5, 64, dtype=dtype, seed=2)
    w = (1 + 0.1 * _randn(64, dtype=torch.float32, seed=1)).to(dtype)
    res_ref = res.clone()
    expected = rms_norm_ref(x, w, 1e-6, res_ref)
    got = rms_norm(x, w, 1e-6, res)
    if DEVICE == "cuda" or dtype != torch.bfloat16:  # the interpreter truncates bf16
        assert torch.equal(res, res_ref)  # one rounded add: exact
    _close(res, res_ref)
    _close(got, expected)


def test_rms_norm_per_head_on_strided_view():
    # q of a fused qkv projection: [T, H, D] with a token stride wider than H * D (Qwen3 q norm)
    qkv = _randn(6, 4 * 32 + 2 * 32, dtype=torch.float32)
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    w = _randn(32, dtype=torch.float32, seed=3)
    _close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("heads", [(3, 1, 64), (4, 4, 32)], ids=["g3-d64", "g1-d32"])
def test_rope_in_place_on_qkv_views(dtype, heads):
    hq, hk, d = heads
    t = 9
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    pos = torch.tensor([0, 1, 5, 17, 3, 200, 2, 9, 64], device=DEVICE)
    freqs = torch.outer(torch.arange(256.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    q_exp, k_exp = rotary_ref(pos, q, cos, sin), rotary_ref(pos, k, cos, sin)
    v_before = qkv[:, (hq + hk) * d :].clone()
    out = rotary_embedding(pos, q, k, cos, sin)
    assert out.data_ptr() == q.data_ptr()
    _close(q, q_exp)
    _close(k, k_exp)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("heads", [(3, 1, 64), (4, 2, 80)], ids=["g3-d64", "g2-d80"])
def test_rope_with_the_kv_store_is_rope_then_store_kv(dtype, heads):
    # one launch: the bits RoPE then store_kv give (the GPU steps' layers, one kernel fewer)
    hq, hk, d = heads
    t, ps = 7, 4
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    pos = torch.tensor([0, 1, 5, 17, 3, 200, 9], device=DEVICE)
    freqs = torch.outer(torch.arange(256.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    cache = _randn(6, 2 * ps * hk * d, dtype=dtype, seed=5).view(6, 2, ps, hk, d)
    slots = torch.tensor([3, 0, -1, 22, 9, 14, -1], device=DEVICE)  # -1: padding, skipped
    q2, k2, v2, expected = q.clone(), k.clone(), v.clone(), cache.clone()
    rotary_embedding(pos, q2, k2, cos, sin)
    store_kv(k2, v2, expected, slots)
    q_out = torch.empty(8, hq, d, dtype=dtype, device=DEVICE)
    got = rotary_embedding(pos, q, k, cos, sin, q_out=q_out, kv=(v, cache, slots))
    assert torch.equal(got, q2) and torch.equal(k, k2)
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="kv must be"):
        rotary_embedding(pos, q, k, cos, sin, kv=(v, cache, slots[:3]))


def test_rope_into_q_out_leaves_q():
    q, k = _randn(4, 2, 16, dtype=torch.float32), _randn(4, 1, 16, dtype=torch.float32, seed=1)
    q_before = q.clone()
    pos = torch.arange(4, device=DEVICE)
    cos, sin = _randn(8, 8, dtype=torch.float32, seed=2), _randn(8, 8, dtype=torch.float32, seed=3)
    q_out = torch.zeros(6, 2, 16, device=DEVICE)  # a larger static buffer
    got = rotary_embedding(pos, q, k, cos, sin, q_out=q_out)
    assert got.shape == (4, 2, 16) and got.data_ptr() == q_out.data_ptr()
    _close(got, rotary_ref(pos, q_before, cos, sin))
    assert torch.equal(q, q_before)
    assert not q_out[4:].any()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n", [64, 1536], ids=["i64", "i1536-two-blocks"])
def test_silu_and_mul(dtype, n):
    x = _randn(3, 2 * n, dtype=dtype)
    _close(silu_and_mul(x), silu_and_mul_ref(x))


def test_rejects_bad_inputs():
    x = _randn(4, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, _randn(32, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul(_randn(4, 63, dtype=torch.float32))
    q = _randn(2, 2, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.arange(2, device=DEVICE, dtype=torch.int32), q, q, x, x)
