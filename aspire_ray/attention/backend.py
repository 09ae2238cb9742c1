"""The attention backend interface and its registry.

A backend implements three operations over the shared KV layout
``kv_cache: [num_pages, 2, page_size, kv_heads, head_dim]`` (see ``aspire_ray.kernels``):
storing new K/V by slot, ragged paged attention (optionally returning the log-sum-exp), and
the refresh layer's per-token max attention probability. Metadata is planned once per step by
the caller and passed to every layer; backends that need a per-step plan (Triton, flashinfer)
build it lazily from the metadata object and cache it there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from aspire_ray.kernels import PagedKVMeta
from aspire_ray.kernels import reference as ref


class AttentionBackend:
    """Base class; also the pure-torch reference backend that runs anywhere."""

    name = "torch"

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """k, v: [T, Hkv, D]; slot_mapping: int64 [T] (page_id * page_size + offset)."""
        ref.store_kv_ref(k, v, kv_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedKVMeta,
        scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D] -> out [T, Hq, D] (and lse [T, Hq] float32 when return_lse)."""
        return ref.paged_attention_ref(q, kv_cache, meta, scale, return_lse)

    def token_max_probs(
        self,
        q: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedKVMeta,
        scale: float,
    ) -> torch.Tensor:
        """q: [R, Hq, D], lse: [R, Hq] -> float32 [nnz_pages, page_size] (0 past kv_len)."""
        return ref.token_max_probs_ref(q, lse, kv_cache, meta, scale)


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {"torch": AttentionBackend}

# Backends whose module registers them only when its dependency imports, and how to install it.
_OPTIONAL = {
    "triton": ("triton_backend", "pip install triton"),
    "flashinfer": ("flashinfer_backend", "pip install flashinfer-python"),
}
_CUDA_ONLY = frozenset({"flashinfer"})


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def _load_optional_backend(name: str) -> None:
    # Imported lazily, and only when asked for: the GPU backends need triton or flashinfer,
    # which CPU installs may lack.
    if name in _OPTIONAL and name not in _REGISTRY:
        try:
            importlib.import_module(f"aspire_ray.attention.{_OPTIONAL[name][0]}")
        except ImportError:
            pass


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Resolve a backend by name; "auto" picks the fastest one available for the device.

    "auto" prefers Triton on CUDA: it runs every dtype (fp32 too) and inside the worker's CUDA
    graphs; flashinfer is chosen by name only.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        else:
            _load_optional_backend("triton")
            name = next(n for n in ("triton", "torch") if n in _REGISTRY)
    if name in _CUDA_ONLY and device.type != "cuda":
        raise ValueError(
            f"attention backend {name!r} is not available on {device.type}: "
            f"it needs a CUDA GPU (use 'triton' or 'torch')"
        )
    _load_optional_backend(name)
    if name not in _REGISTRY:
        for other in _OPTIONAL:  # so that the message lists every backend that would load
            _load_optional_backend(other)
        hint = f"; install it with: {_OPTIONAL[name][1]}" if name in _OPTIONAL else ""
        raise ValueError(
            f"attention backend {name!r} is not available (available: {sorted(_REGISTRY)}){hint}"
        )
    return _REGISTRY[name]()
