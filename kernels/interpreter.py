"""Whether Triton kernels run in its CPU interpreter: a module of its own, since
paged_attention and pdl (which paged_attention imports) both ask."""

from __future__ import annotations

import functools
import os


@functools.cache
def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests); read once, as triton.jit reads it at import."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
