"""Attention backends: one interface over the paged KV cache, chosen by name."""

from .backend import AttentionBackend, get_backend, register_backend

__all__ = ["AttentionBackend", "get_backend", "register_backend"]
