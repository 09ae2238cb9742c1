"""The flashinfer attention backend: ragged paged attention by flashinfer's batch prefill wrapper.

Importing this module registers it as "flashinfer"; it needs flashinfer-python (0.6.x), a CUDA
GPU, and fp16 / bf16 activations. The KV store and the refresh layer's page scoring have no
flashinfer counterpart: they stay the Triton kernels (inherited from ``TritonBackend``).

How ``PagedKVMeta`` maps onto ``BatchPrefillWithPagedKVCacheWrapper`` (one call serves decode,
verify and prefill rows alike):
- qo_indptr / kv_indptr / kv_indices / kv_last_page_len are flashinfer's qo_indptr /
  paged_kv_indptr / paged_kv_indices / paged_kv_last_page_len, with the same meaning.
- kv_cache [P, 2, ps, Hkv, D] is flashinfer's single-tensor "NHD" layout (K at [:, 0], V at
  [:, 1]).
- causal=True: flashinfer aligns a row's qo_len queries to the END of its kv_len KV tokens
  (query i sees KV tokens j <= kv_len - qo_len + i), as PagedKVMeta does. kv_len counts the
  tokens of the listed pages only, so a sparse page subset is attended exactly as the reference
  attends it (its KV tokens renumbered 0..kv_len-1 in list order).
- flashinfer's lse is base 2: its kernels fold log2(e) into the softmax scale and store
  ``m + log2(sum(exp2(s * scale * log2(e) - m)))`` (csrc prefill.cuh, hopper
  attention_updater.cuh), i.e. log2(e) times the natural lse; it is scaled by ln(2) here.

The wrapper runs flashinfer's FA2 kernels (``BACKEND``): rows of 1 to 9 queries over pages of
16 tokens are decode-shaped, and the Hopper (FA3) path that "auto" picks is built for long
query tiles.

Plans: ``plan`` copies the step's metadata to the device and schedules the work; it is built once
per (metadata, head shape, dtype, scale) and shared by every layer of the step. A plan lives in
a wrapper (the wrapper holds it, not the metadata), so the backend keeps a small ring of
wrappers, one per plan in use (a step has up to three metadata objects: before, at and after
the refresh layer), and the metadata object remembers which wrapper holds its plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import flashinfer
import torch

from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.kernels.paged_attention import check_cache, check_meta, check_q

from .backend import register_backend
from .triton_backend import TritonBackend

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace (split-KV partials)
NUM_WRAPPERS = 4  # plans alive at once; a step needs at most three
BACKEND = "fa2"  # flashinfer's prefill kernels for every row (see the module doc)
_LN2 = math.log(2.0)


@dataclass
class _Wrapper:
    """One flashinfer wrapper and the plan it holds now."""

    wrapper: flashinfer.BatchPrefillWithPagedKVCacheWrapper
    # identity of the plan held now (compared with `is`), None before the first plan
    owner: object | None = None
    # recorded after each plan: plan() leaves an async copy from the wrapper's pinned buffer
    # in flight, which must finish before the next plan rewrites that buffer
    planned: torch.cuda.Event = field(default_factory=torch.cuda.Event)


def _host(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


class FlashInferBackend(TritonBackend):
    """flashinfer's paged prefill kernels for attention; Triton kernels for the rest."""

    name = "flashinfer"

    def __init__(self) -> None:
        super().__init__()
        self._workspace: torch.Tensor | None = None  # uint8 [WORKSPACE_BYTES], on first use
        self._wrappers: list[_Wrapper] = []
        self._next = 0  # ring position of the wrapper the next plan takes

    def query_tile_tokens(self, group: int) -> int | None:
        return None  # flashinfer chooses its own query tiles (not modelled)

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedKVMeta,
        scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] over kv_cache [P, 2, ps, Hkv, D] -> out [T, Hq, D] (, lse [T, Hq] f32)."""
        check_q(q, kv_cache)
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend needs fp16 or bf16, got {q.dtype}")
        if q.device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA device, got {q.device}")
        check_cache(kv_cache, meta.page_size, q.shape[2], q.dtype)
        check_meta(meta, q.device)
        t = q.shape[0]
        if t != meta.qo_indptr_host[-1]:
            raise ValueError(
                f"q has {t} tokens but meta.qo_indptr ends at {meta.qo_indptr_host[-1]}"
            )
        if t == 0:
            out = torch.empty_like(q)
            lse = torch.empty(0, q.shape[1], dtype=torch.float32, device=q.device)
            return (out, lse) if return_lse else out
        wrapper = self._planned(q, kv_cache, meta, scale)
        # contiguous: a no-op for the usual q, and the kernels then need no stride assumptions
        if not return_lse:
            return wrapper.run(q.contiguous(), kv_cache)
        out, lse2 = wrapper.run(q.contiguous(), kv_cache, return_lse=True)
        return out, lse2.mul_(_LN2)  # base 2 -> natural log

    def _planned(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: PagedKVMeta, scale: float
    ) -> flashinfer.BatchPrefillWithPagedKVCacheWrapper:
        """The wrapper holding this step's plan for these shapes, planning it on first use."""
        hq, d, hkv = q.shape[1], q.shape[2], kv_cache.shape[3]
        key = (hq, hkv, d, q.dtype, kv_cache.dtype, scale)
        # Cached on the metadata object: it is built once per step and never mutated.
        plans = meta.__dict__.setdefault("_flashinfer_plans", {})
        held = plans.get(key)  # (wrapper, plan identity)
        if held is not None and held[0].owner is held[1]:
            return held[0].wrapper
        slot = self._take_wrapper(q.device)
        slot.planned.synchronize()  # the previous plan's pinned-buffer copy has finished
        # Host copies for the indptrs and last-page lengths: plan() reads them on the host and
        # would otherwise copy device tensors back (a sync). The page list stays on the device.
        slot.wrapper.plan(
            _host(meta.qo_indptr_host),
            _host(meta.kv_indptr_host),
            meta.kv_indices,
            _host(meta.kv_last_page_len_host),
            hq,
            hkv,
            d,
            meta.page_size,
            causal=True,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=kv_cache.dtype,
        )
        slot.planned.record(torch.cuda.current_stream(q.device))
        slot.owner = token = object()
        plans[key] = (slot, token)
        return slot.wrapper

    def _take_wrapper(self, device: torch.device) -> _Wrapper:
        """The next wrapper of the ring (the one planned longest ago), created on first use."""
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        elif self._workspace.device != device:
            raise ValueError(f"backend set up on {self._workspace.device}, called on {device}")
        i = self._next
        self._next = (i + 1) % NUM_WRAPPERS
        if i == len(self._wrappers):
            # every wrapper shares the float workspace: runs are ordered on one stream. fa2, not
            # "auto": on an H100 auto's Hopper kernel took 6-8x fa2's time on decode, verify and
            # mixed rows over pages of 16 (docs/benchmarks.md §8.43)
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                     backend=BACKEND)
            self._wrappers.append(_Wrapper(wrapper))
        return self._wrappers[i]


register_backend("flashinfer", FlashInferBackend)
