"""The attention backend interface and its registry.

A backend implements three operations over the shared KV layout
``kv_cache: [num_pages, 2, page_size, kv_heads, head_dim]`` (see ``aspire_ray.kernels``):
storing new K/V by slot, ragged paged attention (optionally returning the log-sum-exp), and
the refresh layer's per-token max attention probability (or its sum per page). Metadata is
planned once per step by the caller and passed to every layer; backends that need a per-step
plan (Triton, flashinfer) build it lazily from the metadata object and cache it there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from aspire_ray.kernels import reference as ref
from aspire_ray.kernels.metadata import PagedKVMeta


class AttentionBackend:
    """Base class; also the pure-torch reference backend that runs anywhere."""

    name = "torch"

    def __init__(self, deterministic: bool = False) -> None:
        """deterministic: every query attended alone (``paged_attention_ref``'s per_query)."""
        self.deterministic = deterministic

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
        return ref.paged_attention_ref(q, kv_cache, meta, scale, return_lse, self.deterministic)

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

    def page_scores(
        self,
        q: torch.Tensor,
        lse: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedKVMeta,
        scale: float,
    ) -> torch.Tensor:
        """``token_max_probs`` summed over each page: float32 [nnz_pages] (one rank's heads, so
        only where the heads are not sharded)."""
        return ref.page_scores_ref(q, lse, kv_cache, meta, scale)

    def query_tile_tokens(self, group: int) -> int | None:
        """Query tokens of one row that share a KV read (``group`` q heads per KV head); a row
        of more queries reads its KV once per such tile. None: one read whatever the count
        (this reference attends to a row's whole KV at once)."""
        return None


class BackendUnavailableError(ValueError):
    """An attention backend that cannot run here: a missing package (``package``, its pip name)
    or a device it does not support. A ValueError, as any bad ``attention_backend`` setting."""

    def __init__(self, message: str, package: str | None = None) -> None:
        super().__init__(message)
        self.package = package


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {"torch": AttentionBackend}

# Backends whose module is imported only when selected: a CPU install has neither triton nor
# flashinfer, and the CPU default ("torch") needs neither.
_OPTIONAL = {"triton": "triton_backend", "flashinfer": "flashinfer_backend"}
# Their dependencies (top-level module -> pip name); flashinfer's backend builds on Triton's.
_PACKAGES = {"triton": "triton", "flashinfer": "flashinfer-python"}
_CUDA_ONLY = frozenset({"flashinfer"})
_missing: dict[str, tuple[str, ImportError]] = {}  # backend -> (pip name, the import's error)


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _REGISTRY[name] = factory


def _load_optional_backend(name: str) -> None:
    if name not in _OPTIONAL or name in _REGISTRY or name in _missing:
        return
    try:
        importlib.import_module(f"aspire_ray.attention.{_OPTIONAL[name]}")
    except ImportError as e:
        root = (e.name or "").split(".")[0]
        if root not in _PACKAGES:
            raise  # not a missing dependency: a bug, which must not read as "not installed"
        _missing[name] = (_PACKAGES[root], e)


def get_backend(name: str, device: torch.device | str, options: dict | None = None,
                deterministic: bool = False) -> AttentionBackend:  # fmt: skip
    """Resolve a backend by name; "auto" is "torch" off CUDA and "triton" on CUDA. options:
    the triton backend's kernel settings (``AttentionConfig`` fields); other backends take none.
    deterministic: a query's output does not depend on its row's query count or on the other
    rows (``EngineConfig.deterministic``; the torch and triton backends).

    On CUDA "auto" never falls back to the torch reference: without triton (which CUDA torch
    wheels bring) it raises ``BackendUnavailableError`` naming the package, rather than serve
    many times slower; ``attention_backend="torch"`` chooses the reference explicitly.
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if deterministic and name not in ("torch", "triton"):
        raise ValueError(f"deterministic needs the 'triton' or 'torch' attention backend, "
                         f"got {name!r}")
    if name in _CUDA_ONLY and device.type != "cuda":
        raise BackendUnavailableError(
            f"attention backend {name!r} is not available on {device.type}: "
            f"it needs a CUDA GPU (use 'triton' or 'torch')"
        )
    _load_optional_backend(name)
    if name in _missing:
        package, error = _missing[name]
        raise BackendUnavailableError(
            f"attention backend {name!r} is not available: it needs the package {package!r} "
            f"({error}); install it with: pip install {package}, "
            f"or choose attention_backend='torch' (the pure-torch reference, slow)",
            package,
        )
    if name not in _REGISTRY:
        for other in _OPTIONAL:  # so that the message lists every backend that would load
            _load_optional_backend(other)
        raise BackendUnavailableError(
            f"attention backend {name!r} is not available (available: {sorted(_REGISTRY)})"
        )
    if options and name != "triton":
        raise ValueError(f"attention_options {sorted(options)} are settings of the 'triton' "
                         f"backend, not of {name!r}")
    kwargs = dict(options or {})
    if deterministic:
        kwargs["deterministic"] = True
    return _REGISTRY[name](**kwargs)
