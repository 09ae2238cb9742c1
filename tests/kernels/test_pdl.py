"""The programmatic-dependent-launch switch (``kernels/pdl.py``): what a launch gets, never PDL
under Triton's interpreter, and each taking-part kernel compiled for sm_90 both ways (no GPU
needed: Triton compiles ahead of time for a named target), its PTX checked against pdl.py's
rules. Same tokens on a GPU with it on and off: tests/test_gpu_engine.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from aspire_ray.kernels import pdl

CUDA90 = torch.device("cuda", 0)  # a device name only: no GPU is touched where it is refused


@pytest.fixture
def hopper(monkeypatch):
    """The device checks as on an H100 / H200, outside the interpreter."""
    pdl._capable.cache_clear()
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    yield
    pdl._capable.cache_clear()


def test_on_by_default_and_off_with_zero(monkeypatch, hopper):
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.enabled(CUDA90)
    assert pdl.launch_options(CUDA90) == {"USE_GDC": True, "launch_pdl": True}
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.enabled(CUDA90)
    assert pdl.launch_options(CUDA90) == {"USE_GDC": False}


def test_on_with_the_variable_on_hopper(monkeypatch, hopper):
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.enabled(CUDA90)
    assert pdl.launch_options(CUDA90) == {"USE_GDC": True, "launch_pdl": True}
    assert not pdl.enabled(torch.device("cpu"))


def test_never_before_compute_capability_9(monkeypatch, hopper):
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not pdl.enabled(CUDA90)


def test_never_under_the_interpreter(monkeypatch):
    # this process: the interpreter on a CPU test host (conftest), on a GPU host forced on
    pdl._capable.cache_clear()
    monkeypatch.setattr(pdl, "interpreting", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(pdl.ENV, "1")
    try:
        assert not pdl.enabled(CUDA90)
        assert pdl.launch_options(CUDA90) == {"USE_GDC": False}
    finally:
        pdl._capable.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's kernels are interpreted")
def test_a_kernel_runs_with_the_variable_set_under_the_interpreter(monkeypatch):
    from aspire_ray.kernels.fused_norm import rms_norm
    from aspire_ray.kernels.reference import rms_norm_ref

    monkeypatch.setenv(pdl.ENV, "1")
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


# Each taking-part kernel's compile for sm_90: argument types (pointers bf16 unless named;
# other runtime arguments i32 unless named) and constexprs at SmolLM2-135M's decode shapes.
F32, I32, I64 = "*fp32", "*i32", "*i64"
ATTN_INTS = ("work_ptr", "count_ptr", "qo_indptr_ptr", "kv_indptr_ptr", "kv_indices_ptr",
             "last_len_ptr")  # fmt: skip
GEMM = dict(BLOCK_M=64, BLOCK_K=128, PRECISION="tf32")
KERNELS = {
    "fused_norm._rms_norm_kernel": (
        {"eps": "fp32"}, dict(HEADS=1, N=576, BLOCK=1024, ADD_RESIDUAL=True)),
    "fused_norm._rms_norm_parts_kernel": (
        {"p_ptr": F32, "eps": "fp32"}, dict(N=576, BLOCK=1024, S_CHUNK=8)),
    "activation._silu_and_mul_kernel": ({}, dict(N=1536, BLOCK=1024)),
    "rope._rope_kernel": (
        {"pos_ptr": I64, "cos_ptr": F32, "sin_ptr": F32, "slot_ptr": I64},
        dict(HQ=9, HK=3, HQ_PAD=16, HK_PAD=4, HALF=32, HALF_PAD=32, STORE=True, PAGE_SIZE=16)),
    "qkv_rope._qkv_rope_kernel": (
        {"pos_ptr": I64, "cos_ptr": F32, "sin_ptr": F32, "slot_ptr": I64},
        dict(HQ=9, HK=3, HEAD_DIM=64, TILES=2, HAS_BIAS=False, STORE=True, PAGE_SIZE=16,
             BLOCK_H=16, **GEMM)),
    "gate_up_silu._gate_up_silu_kernel": ({}, dict(BLOCK_N=16, **GEMM)),
    "linear._linear_kernel": ({}, dict(HAS_BIAS=True, BLOCK_N=32, **GEMM)),
    "paged_attention._attn_kernel": (
        {"lse_ptr": F32, "opart_ptr": F32, "lpart_ptr": F32, "scale_log2": "fp32",
         **dict.fromkeys(ATTN_INTS, I32)},
        dict(GROUP=3, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_M=16, BLOCK_N=64, RETURN_LSE=False,
             DOT_PRECISION="tf32", UPCAST=False, FUSED_MERGE=False, MERGE_SPLITS=1,
             counter_ptr=None)),
    # the split-KV merge in the attention launch (AttentionConfig.fused_merge): its counter's
    # atomic and the merge's loads and stores come after the wait too
    "paged_attention._attn_kernel:fused-merge": (
        {"lse_ptr": F32, "opart_ptr": F32, "lpart_ptr": F32, "scale_log2": "fp32",
         "counter_ptr": I32, **dict.fromkeys(ATTN_INTS, I32)},
        dict(GROUP=3, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_M=16, BLOCK_N=64, RETURN_LSE=True,
             DOT_PRECISION="tf32", UPCAST=False, FUSED_MERGE=True, MERGE_SPLITS=2)),
    "paged_attention._merge_kernel": (
        {"lse_ptr": F32, "opart_ptr": F32, "lpart_ptr": F32, "merge_ptr": I32, "count_ptr": I32},
        dict(HEAD_DIM=64, HEAD_BLOCK=4, SPLIT_BLOCK=16, RETURN_LSE=True)),
}
# kernels whose pre-wait part loads (the norms' weights) or prefetches (the GEMMs' weights)
LOADS_BEFORE_WAIT = {"fused_norm._rms_norm_kernel", "fused_norm._rms_norm_parts_kernel"}
PREFETCHES = {"qkv_rope._qkv_rope_kernel", "gate_up_silu._gate_up_silu_kernel",
              "linear._linear_kernel"}  # fmt: skip

# Run without the interpreter (the kernels must be JITFunctions): each kernel's PTX for sm_90
# with USE_GDC off and on -> what the rules are checked on (in the text's order: each kernel's
# part before the wait is straight-line code).
COMPILE = r"""
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget

def facts(ptx):
    lines = [ln.strip() for ln in ptx.splitlines()]
    wait = next((i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")), None)
    before = lines[:wait] if wait is not None else []
    return {
        "wait": wait is not None,
        "launch_dependents": any(ln.startswith("griddepcontrol.launch_dependents") for ln in lines),
        "prefetch": sum(ln.startswith("prefetch.global.L2") for ln in lines),
        "loads_before_wait": sum(bool(re.match(r"(@%p\d+ )?(ld\.global|cp\.async)", ln))
                                 for ln in before),
        "stores_before_wait": sum(bool(re.match(r"(@%p\d+ )?(st\.global|red\.|atom\.)", ln))
                                  for ln in before),
        "prefetch_before_wait": sum(ln.startswith("prefetch.global.L2") for ln in before),
    }

out = {}
for name, (types, constexprs) in json.loads(sys.argv[1]).items():
    module, kernel = name.split(":")[0].split(".")  # "module.kernel[:variant]"
    fn = getattr(importlib.import_module("aspire_ray.kernels." + module), kernel)
    out[name] = {}
    for gdc in (False, True):
        consts = dict(constexprs, USE_GDC=gdc)
        sig, attrs = {}, {}
        for i, p in enumerate(fn.params):
            if p.name in consts:
                sig[p.name] = "constexpr"
                continue
            sig[p.name] = types.get(p.name, "*bf16" if p.name.endswith("_ptr") else "i32")
            if p.name.endswith("_ptr") or p.name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # as a launch specialises them
        src = triton.compiler.ASTSource(fn, sig, consts, attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 3})
        out[name]["on" if gdc else "off"] = facts(k.asm["ptx"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sm90_ptx():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(KERNELS)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", KERNELS)
def test_compiles_for_sm90_and_keeps_the_rules(sm90_ptx, name):
    off, on = sm90_ptx[name]["off"], sm90_ptx[name]["on"]
    # off: the kernel as it was, no grid dependency control, no prefetch
    assert not off["wait"] and not off["launch_dependents"] and off["prefetch"] == 0
    # on: a wait and a trigger; nothing stored before the wait (rule 1)
    assert on["wait"] and on["launch_dependents"] and on["stores_before_wait"] == 0
    # before the wait only the weights: the norms load theirs, the GEMMs ask L2 for theirs
    if name in LOADS_BEFORE_WAIT:
        assert on["loads_before_wait"] > 0
    else:
        assert on["loads_before_wait"] == 0
    assert (on["prefetch_before_wait"] > 0) == (name in PREFETCHES), on
