"""GEMMs with a fused epilogue (``kernels.qkv_rope``, ``kernels.gate_up_silu``) against the
unfused paths they replace: F.linear + RoPE + the KV store, F.linear + SiLU-and-mul; and their
batch invariance (a row's output the same bits whatever the other rows), as ``kernels.linear``'s.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from aspire_ray.kernels.activation import silu_and_mul
from aspire_ray.kernels.gate_up_silu import gate_up_silu, gate_up_silu_config
from aspire_ray.kernels.linear import LinearConfig, invariant_config, triton_linear
from aspire_ray.kernels.qkv_rope import qkv_rope, qkv_rope_config
from aspire_ray.kernels.reference import rotary_ref, silu_and_mul_ref, store_kv_ref
from aspire_ray.kernels.rope import rotary_embedding
from aspire_ray.model.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's pace. qkv_rope's block_n = 32: two halves of 16 columns (tl.dot's minimum
# width on a GPU), so head_dim 16 overhangs a half and 48 takes a partial second tile.
QKV_SMALL = LinearConfig(block_m=16, block_n=32, block_k=32)
GU_SMALL = LinearConfig(block_m=16, block_n=16, block_k=32)
# float32 against F.linear: tl.dot takes float32 as float32 ("ieee", linear.dot_precision).
F32_TOL = 1e-4
PAGE_SIZE, PAGES, MAX_POS = 4, 24, 300
# The bitwise comparisons with the unfused Triton path: fp16, and bf16 on a GPU only (Triton
# 3.9's interpreter returns garbage from a bf16 tl.dot: triton_linear's ~1e10 for ~8 too).
_NO_BF16 = pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter's bf16 tl.dot is wrong")
LOW = {"fp16": torch.float16, "bf16": pytest.param(torch.bfloat16, marks=_NO_BF16)}
requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _rope_tables(d):
    freqs = torch.outer(torch.arange(float(MAX_POS)), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def _slots(t, gen):
    """int64 [T]: distinct slots, the first across page boundaries (3|4, 7|8), every fourth
    from the third on -1 (padding)."""
    fixed = torch.tensor([3, 4, 7, 8, PAGES * PAGE_SIZE - 1])
    perm = torch.randperm(PAGES * PAGE_SIZE, generator=gen)
    slots = torch.cat([fixed, perm[~torch.isin(perm, fixed)]])[:t].clone()
    slots[2::4] = -1
    return slots.to(DEVICE)


def _problem(t, hq, hk, d, k, bias, dtype=torch.float32, seed=0, exact=False):
    """x [t, k], w, bias, positions, a random cache, slots. exact: x integers in [-8, 8], w and
    bias multiples of 1/256 in (-1, 1) (exact in bf16), so that every fp32 sum is exact (< 2^24
    units of 1/256) and the projection the same bits in any summation order (a BLAS's or an
    MMA's), yet rounded in fp16 / bf16: bitwise tests of the rounding steps on any backend."""
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hk) * d
    if exact:
        ints = lambda bound, *s: torch.randint(-bound, bound + 1, s, generator=gen).to(dtype)
        x, w, b = ints(8, t, k), ints(255, n, k) / 256, ints(255, n) / 256
        x, w, b = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if bias else None
    else:
        x, w = _randn(t, k, gen=gen, dtype=dtype), _randn(n, k, gen=gen, dtype=dtype)
        b = _randn(n, gen=gen, dtype=dtype) if bias else None
    pos = torch.randint(0, MAX_POS, (t,), generator=gen).to(DEVICE)
    cache = _randn(PAGES, 2, PAGE_SIZE, hk, d, gen=gen, dtype=dtype)
    return x, w, b, pos, cache, _slots(t, gen)


def _reference(x, w, b, pos, cache, slots, hq, hk, d):
    """F.linear, rotary_ref, store_kv_ref of the non-negative slots: (q, k, v, cache)."""
    t = x.shape[0]
    q, k, v = F.linear(x, w, b).split([hq * d, hk * d, hk * d], dim=-1)
    cos, sin = _rope_tables(d)
    q = rotary_ref(pos, q.reshape(t, hq, d), cos, sin)
    k = rotary_ref(pos, k.reshape(t, hk, d), cos, sin)
    v = v.reshape(t, hk, d)
    cache = cache.clone()
    keep = slots >= 0
    store_kv_ref(k[keep], v[keep], cache, slots[keep])
    return q, k, v, cache


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("hq,hk,d,k,bias", [(4, 2, 32, 64, True), (3, 1, 16, 48, False),
                                            (2, 2, 48, 96, True)],
                         ids=["d32-bias", "d16-overhang", "d48-partial-tile"])  # fmt: skip
def test_qkv_rope_matches_linear_rope_store(t, hq, hk, d, k, bias):
    x, w, b, pos, cache, slots = _problem(t, hq, hk, d, k, bias, seed=t)
    q_exp, k_exp, v_exp, cache_exp = _reference(x, w, b, pos, cache, slots, hq, hk, d)
    q_out = torch.full((t + 3, hq, d), 7.0, device=DEVICE)  # a larger static buffer
    cos, sin = _rope_tables(d)
    q, k_, v = qkv_rope(x, w, b, pos, cos, sin, q_out, cache, slots, hq, hk, d, QKV_SMALL)
    assert q.shape == (t, hq, d) and q.data_ptr() == q_out.data_ptr()
    assert k_.shape == v.shape == (t, hk, d) and k_.is_contiguous() and v.is_contiguous()
    for got, exp in ((q, q_exp), (k_, k_exp), (v, v_exp), (cache, cache_exp)):
        torch.testing.assert_close(got, exp, atol=F32_TOL, rtol=F32_TOL)
    assert (q_out[t:] == 7.0).all()  # past T untouched
    # the slots no token stores (padding's -1 among them) keep their bits
    by_slot = lambda c: c.transpose(1, 2).reshape(PAGES * PAGE_SIZE, -1)  # noqa: E731
    stored = torch.zeros(PAGES * PAGE_SIZE, dtype=torch.bool, device=DEVICE)
    stored[slots[slots >= 0]] = True
    assert torch.equal(by_slot(cache)[~stored], by_slot(cache_exp)[~stored])


def test_qkv_rope_without_cache_or_q_out():
    hq, hk, d = 2, 1, 32
    x, w, b, pos, _, _ = _problem(6, hq, hk, d, 64, True, seed=1)
    no_cache, no_slots = torch.zeros(1, 2, 1, hk, d, device=DEVICE), torch.full((6,), -1)
    q_exp, k_exp, v_exp, _ = _reference(x, w, b, pos, no_cache, no_slots.to(DEVICE), hq, hk, d)
    cos, sin = _rope_tables(d)
    q, k, v = qkv_rope(x, w, b, pos, cos, sin, None, None, None, hq, hk, d, QKV_SMALL)
    for got, exp in ((q, q_exp), (k, k_exp), (v, v_exp)):
        torch.testing.assert_close(got, exp, atol=F32_TOL, rtol=F32_TOL)
    q0, k0, v0 = qkv_rope(x[:0], w, b, pos[:0], cos, sin, None, None, None, hq, hk, d, QKV_SMALL)
    assert q0.shape == (0, hq, d) and k0.shape == v0.shape == (0, hk, d)


@pytest.mark.parametrize("dtype", LOW.values(), ids=LOW.keys())
def test_qkv_rope_is_the_unfused_triton_path_bitwise(dtype):
    # triton_linear, then rotary_embedding with its KV store: the same rounding steps, so the
    # same bits. Exact sums (_problem) and tables of 8 significant bits, so that x cos and
    # y sin are exact too and the bits do not depend on which the compiler fuses into an fma
    # (the interpreter's rope fuses none): the model shape's tables are test_gpu_bitwise's.
    hq, hk, d, t = 4, 2, 32, 9
    x, w, b, pos, cache, slots = _problem(t, hq, hk, d, 64, True, dtype, seed=3, exact=True)
    cos, sin = (table.bfloat16().float() for table in _rope_tables(d))
    got, expected = _fused_and_unfused(x, w, b, pos, cos, sin, cache, slots, hq, hk, d,
                                       QKV_SMALL)  # fmt: skip
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def _fused_and_unfused(x, w, b, pos, cos, sin, cache, slots, hq, hk, d, cfg):
    """(q, k, v, cache) of qkv_rope, and of triton_linear + rotary_embedding (cache copies)."""
    t = x.shape[0]
    qkv = triton_linear(x, w, b, cfg)
    q, k, v = (s.view(t, -1, d) for s in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    cache_exp = cache.clone()
    q = rotary_embedding(pos, q, k, cos, sin, kv=(v, cache_exp, slots))
    cache = cache.clone()
    got = qkv_rope(x, w, b, pos, cos, sin, None, cache, slots, hq, hk, d, cfg)
    return got + (cache,), (q, k, v, cache_exp)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("t", [64, 256])
def test_gpu_bitwise_at_the_model_shape(t):
    # Qwen2.5-0.5B's qkv in bf16, random values and its rope tables, the default tilings: the
    # unfused Triton path's bits, fmas included (kernels/qkv_rope.py; before they were written
    # out, ~1 value in 30k differed by an ulp: 2-5 a call at these sizes)
    hq, hk, d, k = 14, 2, 64, 896
    gen = torch.Generator().manual_seed(t)
    rnd = lambda *shape: _randn(*shape, gen=gen, dtype=torch.bfloat16)
    n = (hq + 2 * hk) * d
    x, w, b, cache = rnd(t, k), 0.05 * rnd(n, k), 0.05 * rnd(n), rnd(32, 2, 16, hk, d)
    pos = torch.randint(0, 32768, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(32 * 16, generator=gen)[:t].to(DEVICE)
    rope = RotaryEmbedding(d, 1e6, 32768, None)
    got, expected = _fused_and_unfused(x, w, b, pos, rope.cos.to(DEVICE), rope.sin.to(DEVICE),
                                       cache, slots, hq, hk, d, qkv_rope_config(n, k))  # fmt: skip
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    w = 0.05 * rnd(2 * 4864, k)  # gate_up
    unfused = silu_and_mul(triton_linear(x, w, cfg=invariant_config(*w.shape)))
    assert torch.equal(gate_up_silu(x, w), unfused)


def test_qkv_rope_row_does_not_depend_on_the_batch():
    hq, hk, d = 2, 1, 32
    x, w, b, pos, _, _ = _problem(40, hq, hk, d, 72, True, seed=4)
    cos, sin = _rope_tables(d)

    def rows(xs, ps):
        return qkv_rope(xs, w, b, ps, cos, sin, None, None, None, hq, hk, d, QKV_SMALL)

    alone = rows(x[:1], pos[:1])
    # other rows around it, more tiles of rows; at the same place in its tile of rows (the
    # interpreter's numpy matmul may round a row by its place in the block; a GPU's MMA not)
    for m, at in ((3, 0), (17, 16), (40, 32)):
        xs, ps = x[:m].clone(), pos[:m].clone()
        xs[at], ps[at] = x[0], pos[0]
        for got, exp in zip(rows(xs, ps), alone, strict=True):
            assert torch.equal(got[at], exp[0]), (m, at)


@pytest.mark.parametrize("m,i,k", [(1, 40, 48), (5, 64, 96), (33, 40, 72)])
def test_gate_up_silu_matches_linear_silu_and_mul(m, i, k):
    gen = torch.Generator().manual_seed(m)
    x, w = _randn(m, k, gen=gen), _randn(2 * i, k, gen=gen)
    got = gate_up_silu(x, w, GU_SMALL)
    assert got.shape == (m, i)
    torch.testing.assert_close(got, silu_and_mul_ref(F.linear(x, w)), atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("dtype", LOW.values(), ids=LOW.keys())
def test_gate_up_silu_is_the_unfused_triton_path_bitwise(dtype):
    x, w = _problem(9, 2, 1, 20, 64, False, dtype, seed=7, exact=True)[:2]  # w [80, 64]
    # the unfused GEMM tiles gate and up columns alike: twice the fused program's block_n
    expected = silu_and_mul(triton_linear(x, w, cfg=replace(GU_SMALL, block_n=32)))
    assert torch.equal(gate_up_silu(x, w, GU_SMALL), expected)


def test_gate_up_silu_row_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    w = _randn(48, 72, gen=gen)
    row = _randn(1, 72, gen=gen)
    alone = gate_up_silu(row, w, GU_SMALL)
    for m, at in ((3, 0), (17, 16), (40, 32)):
        batch = _randn(m, 72, gen=gen)
        batch[at] = row[0]
        assert torch.equal(gate_up_silu(batch, w, GU_SMALL)[at], alone[0]), (m, at)


def test_default_tilings_depend_on_the_weight_only():
    # Qwen2.5-0.5B: qkv [1152, 896] in 18 heads x 2 tiles = 36 programs a 64-row tile, gate_up
    # [9728, 896] in 152; the K chunks of invariant_config (the deterministic mode's linear)
    q_cfg, gu_cfg = qkv_rope_config(1152, 896), gate_up_silu_config(9728, 896)
    assert (q_cfg.block_m, q_cfg.block_n, q_cfg.block_k) == (64, 32, 128)
    assert (gu_cfg.block_m, gu_cfg.block_n, gu_cfg.block_k) == (64, 32, 64)
    assert 18 * (64 // 2) // (q_cfg.block_n // 2) == 36 and 4864 // gu_cfg.block_n == 152
    gen = torch.Generator().manual_seed(1)
    w, rows = _randn(64, 48, gen=gen), _randn(70, 48, gen=gen)
    full = gate_up_silu(rows, w)  # rows 0 and 64 keep their place in a 64-row tile
    assert torch.equal(gate_up_silu(rows[:1], w)[0], full[0])
    assert torch.equal(gate_up_silu(rows[64:], w)[0], full[64])


def test_bad_shapes_are_refused():
    hq, hk, d = 2, 1, 16
    x, w, b, pos, cache, slots = _problem(4, hq, hk, d, 32, True)
    cos, sin = _rope_tables(d)

    def call(**kw):
        args = dict(x=x, w=w, bias=b, positions=pos, cos=cos, sin=sin, q_out=None,
                    kv_cache=cache, slot_mapping=slots, num_q_heads=hq, num_kv_heads=hk,
                    head_dim=d, cfg=QKV_SMALL)  # fmt: skip
        return qkv_rope(**{**args, **kw})

    cases = [
        (dict(w=w[:-1]), "rows"),
        (dict(x=x[:, :-1]), "need x"),
        (dict(bias=b[:-1]), "bias"),
        (dict(positions=pos.int()), "positions"),
        (dict(cos=cos[:, :-1]), "cos"),
        (dict(head_dim=15, num_q_heads=4), "even head_dim"),
        (dict(q_out=torch.empty(3, hq, d, device=DEVICE)), "q_out"),
        (dict(kv_cache=cache[:, :, :, :, :-1]), "kv_cache"),
        (dict(slot_mapping=None), "slot_mapping"),
        (dict(cfg=LinearConfig(block_n=15)), "block_n"),
        (dict(w=w.double()), "w must be"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**kw)
    xg = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="need x"):
        gate_up_silu(xg, torch.randn(5, 8, device=DEVICE))  # odd rows: not gate + up
    with pytest.raises(ValueError, match="need x"):
        gate_up_silu(xg, torch.randn(6, 9, device=DEVICE))
    with pytest.raises(ValueError, match="w must be"):
        gate_up_silu(xg, torch.randn(6, 8, device=DEVICE).half())
