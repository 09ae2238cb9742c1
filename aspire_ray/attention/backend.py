"""The attention backend interface and its registry.

A backend implements three operations over the shared KV layout
``kv_cache: [num_pages, 2, page_size, kv_heads, head_dim]`` (see ``aspire_ray.kernels``):
storing new K/V by slot, ragged paged attention (optionally returning the log-sum-exp), and
the refresh layer's per-token max attention probability. Metadata is planned once per step by
the caller and passed to every layer; backends that need a per-step plan (the Triton one) build it
lazily from the metadata object and cache it there.
"""

from __future__ import annotations

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


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def _load_optional_backends() -> None:
    # Imported lazily: the GPU backend needs triton, which CPU installs may lack.
    for module in ("triton_backend",):
        try:
            __import__(f"aspire_ray.attention.{module}")
        except ImportError:
            pass


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Resolve a backend by name; "auto" picks the fastest one available for the device."""
    _load_optional_backends()
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        else:
            name = next(n for n in ("triton", "torch") if n in _REGISTRY)
    if name not in _REGISTRY:
        hint = {
            "triton": "; install it with: pip install triton",
            "flashinfer": "; a flashinfer backend is not implemented yet (use 'triton')",
        }.get(name, "")
        raise ValueError(f"attention backend {name!r} is not available "
                         f"(available: {sorted(_REGISTRY)}){hint}")
    return _REGISTRY[name]()
