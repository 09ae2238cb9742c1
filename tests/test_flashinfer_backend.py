"""The flashinfer backend: attention against ``paged_attention_ref``, and the engine's greedy
output against the Triton backend's (both need a CUDA GPU and flashinfer; skipped otherwise).

The CPU tests check that asking for flashinfer where it cannot run is a clear error.
"""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import paged_case, random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.attention import backend as backend_registry
from aspire_ray.attention import get_backend
from aspire_ray.kernels.reference import paged_attention_ref

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (atol, rtol) per dtype: like the Triton kernel, flashinfer feeds 16-bit probabilities to the
# PV product, so outputs differ from the fp32 reference by about two output ulps.
TOLERANCES = {torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
LSE_TOLERANCE = (1e-3, 1e-4)  # float32 in both; flashinfer uses approximate exp2 / log2
DTYPES, DTYPE_IDS = [torch.float16, torch.bfloat16], ["fp16", "bf16"]
# (q heads, kv heads, head dim): GQA groups 1, 3, 4 and 8; head dims 64 and 128.
HEADS = [(4, 4, 64), (12, 4, 64), (32, 8, 128), (8, 1, 128)]
HEAD_IDS = ["g1-d64", "g3-d64", "g4-d128", "g8-d128"]
PAGE_SIZE = 16
# decode (1), verify (5, 9) and 40-query prefill chunks: one from an empty cache (40 of 40), one
# continuing a prompt (40 of 131); partial last pages (37 = 2 pages + 5, 131 = 8 pages + 3).
MIXED_Q = [1, 5, 9, 40, 40, 1]
MIXED_KV = [37, 70, 16, 40, 131, 300]


# ---- CPU: clear errors ------------------------------------------------------------------------
def test_flashinfer_missing_is_a_clear_error(monkeypatch):
    # Holds whether or not flashinfer is installed here: hide it, and forget any earlier load.
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` -> ImportError
    monkeypatch.delitem(sys.modules, "aspire_ray.attention.flashinfer_backend", raising=False)
    monkeypatch.delitem(backend_registry._REGISTRY, "flashinfer", raising=False)
    with pytest.raises(ValueError, match=r"'flashinfer' is not available.*pip install flashinfer"):
        get_backend("flashinfer", "cuda")  # a device name only: no GPU is touched


def test_flashinfer_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="not available on cpu.*needs a CUDA GPU"):
        get_backend("flashinfer", "cpu")


# ---- GPU: against the reference ---------------------------------------------------------------
@pytest.fixture(scope="module")
def flashinfer_backend():
    pytest.importorskip("flashinfer")
    backend = get_backend("flashinfer", "cuda")
    assert backend.name == "flashinfer"
    return backend


def make_case(q_lens, kv_lens, heads, dtype, sparse, seed=0):
    return paged_case(q_lens, kv_lens, heads, dtype, "cuda", PAGE_SIZE, sparse, seed)


def check(backend, q, kv, meta, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = backend.attention(q, kv, meta, scale, return_lse=True)
    ref_out, ref_lse = paged_attention_ref(q, kv, meta, scale, return_lse=True)
    atol, rtol = TOLERANCES[q.dtype]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
    out_only = backend.attention(q, kv, meta, scale)  # the same plan, without lse
    torch.testing.assert_close(out_only, out, atol=atol, rtol=rtol)


@gpu
@requires_cuda
@pytest.mark.parametrize("sparse", [False, True], ids=["full", "sparse"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mixed_rows(flashinfer_backend, dtype, heads, sparse):
    q, kv, meta = make_case(MIXED_Q, MIXED_KV, heads, dtype, sparse)
    check(flashinfer_backend, q, kv, meta)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_long_decode_rows(flashinfer_backend, dtype):
    # one query per row over up to 4000 tokens: flashinfer splits the long rows over the KV and
    # merges the partial states (and their lse)
    kv_lens = [1, 16, 17, 33, 500, 1024, 2047, 4000]
    q, kv, meta = make_case([1] * len(kv_lens), kv_lens, (32, 8, 128), dtype, sparse=True)
    check(flashinfer_backend, q, kv, meta, scale=0.1)


@gpu
@requires_cuda
def test_plans_are_cached_per_meta(flashinfer_backend):
    # A step's layers alternate between up to three metas; every meta keeps its own plan, and a
    # meta whose wrapper was since taken by newer plans is planned again, still correctly.
    from aspire_ray.attention.flashinfer_backend import NUM_WRAPPERS

    heads, dtype = (8, 2, 64), torch.bfloat16
    cases = [make_case(MIXED_Q, MIXED_KV, heads, dtype, sparse=s, seed=i)
             for i, s in enumerate([False, True, True])]  # fmt: skip
    for _layer in range(2):
        for q, kv, meta in cases:
            check(flashinfer_backend, q, kv, meta)
    for _, _, meta in cases:
        assert len(meta.__dict__["_flashinfer_plans"]) == 1
    for i in range(NUM_WRAPPERS):  # newer plans take every wrapper of the ring
        check(flashinfer_backend, *make_case([3], [50], heads, dtype, sparse=True, seed=10 + i))
    check(flashinfer_backend, *cases[0])


@gpu
@requires_cuda
def test_rejects_fp32(flashinfer_backend):
    q, kv, meta = make_case([1], [20], (4, 4, 64), torch.float32, sparse=False)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        flashinfer_backend.attention(q, kv, meta, 0.125)


# ---- GPU: the engine ----------------------------------------------------------------------------
def save_tiny_llama(path) -> str:
    """A 2-layer Llama with head_dim 64 (a size flashinfer's kernels are built for) and weights
    scaled up so that logits are peaked: a 16-bit greedy choice then rests on no near-tie."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(path))
    return str(path)


@gpu
@requires_cuda
@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_engine_greedy_equals_triton(flashinfer_backend, tmp_path, mode):
    # "aspire" drafts over sparse page subsets and scores pages from flashinfer's lse at the
    # refresh layer; prompts up to 300 tokens make k_min=4 pages a real subset.
    from aspire_ray.engine.engine import LLMEngine
    from aspire_ray.llm import build_engine_config

    model_dir = save_tiny_llama(tmp_path / "tiny-llama-d64")
    prompts = random_prompts(6, [1, 40, 300], vocab=256, seed=3)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    outputs = {}
    for backend in ("triton", "flashinfer"):
        cfg = build_engine_config(model_dir, device="cuda", dtype="bfloat16", spec_mode=mode,
                                  attention_backend=backend, num_pages=512,
                                  max_num_batched_tokens=512, k_min=4, recent_pages=1,
                                  calibrate="off")  # fmt: skip
        engine = LLMEngine(cfg)
        assert engine.executor.worker.backend.name == backend
        outputs[backend] = run_staggered(engine, prompts, params, arrive_every=2)
        del engine
        torch.cuda.empty_cache()
    assert outputs["flashinfer"] == outputs["triton"]
