"""Triton token_max_probs and page_scores against their references (CPU: Triton's interpreter)."""

import random

import pytest
import torch

from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.page_scores import (
    DEFAULT_SCORE_CONFIG,
    ScoreConfig,
    page_scores,
    token_max_probs,
    work_tokens,
)
from aspire_ray.kernels.paged_attention import paged_attention
from aspire_ray.kernels.reference import page_scores_ref, paged_attention_ref, token_max_probs_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (atol, rtol) per dtype. Logits of 16-bit inputs are exact products summed in fp32 by both the
# kernel and the reference, so the probabilities differ only by summation order.
TOLERANCES = {
    torch.float32: (1e-6, 1e-4),
    torch.float16: (1e-6, 1e-4),
    torch.bfloat16: (1e-6, 1e-4),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
HEADS = [(2, 2, 64), (6, 2, 64), (8, 2, 128)]
HEAD_IDS = ["g1-d64", "g3-d64", "g4-d128"]


def make_case(kv_lens, heads, dtype, page_size=16, seed=0, scale_up=3.0):
    """One query per row, shuffled sparse page lists; q scaled up so the softmax is peaked."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-n // page_size) for n in kv_lens]
    num_pages = 3 * sum(pages_per_row)
    pool = torch.randperm(num_pages, generator=gen).tolist()
    rng = random.Random(seed)
    page_lists = [rng.sample(pool, n) for n in pages_per_row]
    meta = PagedKVMeta.build([1] * len(kv_lens), page_lists, kv_lens, page_size, device=DEVICE)
    kv = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    q = (scale_up * torch.randn(len(kv_lens), hq, d, generator=gen)).to(dtype).to(DEVICE)
    return q, kv, meta


def check(q, kv, meta, dtype, config=DEFAULT_SCORE_CONFIG):
    scale = q.shape[-1] ** -0.5
    _, lse = paged_attention_ref(q, kv, meta, scale, return_lse=True)
    out = token_max_probs(q, lse, kv, meta, scale, config=config)
    ref = token_max_probs_ref(q, lse, kv, meta, scale)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert torch.equal(out == 0, ref == 0)  # slots past kv_len are exactly 0
    sums = page_scores(q, lse, kv, meta, scale, config=config)
    assert sums.dtype == torch.float32 and sums.shape == (ref.shape[0],)
    torch.testing.assert_close(sums, page_scores_ref(q, lse, kv, meta, scale), atol=atol,
                               rtol=rtol)  # fmt: skip
    return out


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_reference(dtype, heads):
    # a single-token row, a partial last page (37), a row spanning several programs (150)
    check(*make_case([1, 37, 150, 16], heads, dtype), dtype)


def test_more_work_items_than_programs():
    # CPU stand-in: 4 SMs x 8 programs; 12 rows of 1,000 tokens are 48 items of 256 tokens
    check(*make_case([1000] * 12, (2, 2, 64), torch.float32), torch.float32)


@pytest.mark.parametrize("config", [
    ScoreConfig(tile_tokens=128, tiles_per_item=2), ScoreConfig(tiles_per_item=1, num_warps=2),
    ScoreConfig(tile_tokens=32, tiles_per_item=8, programs_per_sm=1, num_stages=2),
], ids=["t128x2", "t64x1-w2", "t32x8-p1-s2"])
def test_program_shapes(config):
    # every program shape bench_scoring.py measures scores the same; one program per SM
    # (the CPU stand-in has 4) loops over many items
    assert work_tokens(16, config) == config.tile_tokens * config.tiles_per_item
    check(*make_case([1, 37, 300, 700], (6, 2, 64), torch.bfloat16), torch.bfloat16, config)
    with pytest.raises(ValueError, match="power of two"):
        ScoreConfig(tiles_per_item=3)


@pytest.mark.parametrize("page_size", [8, 32, 128], ids=["ps8", "ps32", "ps128"])
def test_other_page_sizes(page_size):
    check(*make_case([5, 70, 33], (4, 1, 64), torch.float32, page_size), torch.float32)


def test_with_triton_lse_sums_to_one_on_full_rows():
    # Single-head rows: summing the scores over all listed tokens gives the softmax mass, 1.
    q, kv, meta = make_case([40, 100], (1, 1, 64), torch.float32)
    _, lse = paged_attention(q, kv, meta, 0.125, return_lse=True)
    out = token_max_probs(q, lse, kv, meta, 0.125)
    torch.testing.assert_close(out[:3].sum(), torch.tensor(1.0, device=DEVICE))
    torch.testing.assert_close(out[3:].sum(), torch.tensor(1.0, device=DEVICE))


def test_rejects_bad_inputs():
    q, kv, meta = make_case([20, 30], (4, 2, 64), torch.float32)
    lse = torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="lse"):
        token_max_probs(q, lse.half(), kv, meta, 0.1)
    with pytest.raises(ValueError, match="one query per row"):
        token_max_probs(q[:1], lse[:1], kv, meta, 0.1)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)], ids=["g4-d128", "g3-d64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_grid(dtype, heads):
    kv_lens = [random.Random(i).randint(1, 8192) for i in range(48)] + [16384 + 5]
    check(*make_case(kv_lens, heads, dtype, seed=7), dtype)
