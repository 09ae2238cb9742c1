"""Triton KV store against ``store_kv_ref``: a copy, so results compare exactly."""

import pytest
import torch

from aspire_ray.kernels.kv_store import store_kv
from aspire_ray.kernels.reference import store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = {"h2-d64": (2, 64), "h3-d128": (3, 128), "h1-d80": (1, 80)}


def make_case(tokens, hkv, d, cache_dtype, src_dtype, num_pages=12, page_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(cache_dtype)
    k = torch.randn(tokens, hkv, d, generator=gen).to(src_dtype)
    v = torch.randn(tokens, hkv, d, generator=gen).to(src_dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    return [x.to(DEVICE) for x in (k, v, cache, slots)]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(dtype, shape):
    k, v, cache, slots = make_case(37, *shape, dtype, dtype)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_casts_to_cache_dtype():
    # fp32 -> fp16 rounds to nearest even on the GPU and in the interpreter alike
    k, v, cache, slots = make_case(20, 2, 64, torch.float16, torch.float32)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_strided_sources_and_negative_slots_skipped():
    # k and v as views of a fused [T, 2 * Hkv, D] projection; slot -1 marks padding tokens.
    _, _, cache, slots = make_case(10, 2, 64, torch.float32, torch.float32)
    kv = torch.randn(10, 4, 64, device=DEVICE)
    k, v = kv[:, :2], kv[:, 2:]
    slots[3] = -1
    keep = slots >= 0
    expected = cache.clone()
    store_kv_ref(k[keep], v[keep], expected, slots[keep])
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_rejects_bad_inputs():
    k, v, cache, slots = make_case(4, 2, 64, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, v, cache, slots.int())
    with pytest.raises(ValueError, match="k must be"):
        store_kv(k[:, :1], v, cache, slots)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("src", ["fp32", "bf16"])
def test_gpu_large(src):
    k, v, cache, slots = make_case(4096, 8, 128, torch.bfloat16, DTYPES[src], num_pages=512)
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)
