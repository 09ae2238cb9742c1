"""Backend selection by name."""

from __future__ import annotations

import pytest


def test_unknown_attention_backend_is_a_clear_error():
    from aspire_ray.attention import get_backend

    with pytest.raises(ValueError, match="not available"):
        get_backend("flashinfer", "cpu")
    assert get_backend("auto", "cpu").name == "torch"
