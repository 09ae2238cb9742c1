"""Attention and KV kernels over the paged KV cache (installed as ``aspire_ray.kernels``).

Every kernel has a pure-torch reference in ``reference.py`` that defines its meaning; the
Triton versions are tested against it. Nothing here imports the engine, model or serving code.
"""

from .metadata import PagedKVMeta

__all__ = ["PagedKVMeta"]
