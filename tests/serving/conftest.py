"""Serving fixtures (helpers live in server_utils.py: a module named conftest is ambiguous)."""

from __future__ import annotations

import pytest

from .server_utils import make_tiny_chat_model


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
