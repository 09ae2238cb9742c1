"""Reliability fixtures: the tiny chat model of the serving tests (byte-level tokenizer)."""

from __future__ import annotations

import pytest
from serving.server_utils import make_tiny_chat_model


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
