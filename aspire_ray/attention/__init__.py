"""Attention backends: one interface over the paged KV cache, chosen by name."""

from .backend import AttentionBackend, BackendUnavailableError, get_backend, register_backend

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "get_backend",
    "register_backend",
]
