"""Incremental detokenizing equals decoding the whole output, token by token."""

from __future__ import annotations

import random

import pytest
from helpers import needs_smollm2

from aspire_ray.config import EngineConfig
from aspire_ray.engine.detokenizer import DecodeState, Detokenizer
from aspire_ray.engine.engine import load_tokenizer

pytestmark = needs_smollm2

TEXT = ("Paris is the capital of France. ¿Qué tal? 日本語のテキスト, emoji 🙂🚀 and "
        "naïve café — «quotes» 1234.5\n\tdef f(x): return x ** 2  # code")


@pytest.fixture(scope="module")
def detok():
    return Detokenizer(load_tokenizer(EngineConfig()))


def _check_stream(detok: Detokenizer, ids: list[int]) -> None:
    state = DecodeState()
    for k in range(1, len(ids) + 1):
        text = detok.update(state, ids[:k])
        full = detok.decode(ids[:k])
        # the incremental text is the full text, less the window that ends in an incomplete
        # character (held back until it completes)
        assert full.startswith(text), (k, text, full)
        held = full[len(text):]
        assert not held or held.endswith("\ufffd"), (k, text, full)
    assert text == detok.decode(ids)


def test_incremental_equals_full_decode_on_text(detok):
    tok = detok.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    ids += [tok.eos_token_id] + tok.encode(" after the special token", add_special_tokens=False)
    _check_stream(detok, ids)


def test_incremental_on_byte_tokens_split_characters(detok):
    # byte-level tokens that split multi-byte characters, ending in complete ones
    rng = random.Random(0)
    vocab = detok.tokenizer.vocab_size
    for _ in range(5):
        ids = [rng.randrange(vocab) for _ in range(40)]
        ids += detok.tokenizer.encode(" done.", add_special_tokens=False)
        state = DecodeState()
        for k in range(1, len(ids) + 1):
            text = detok.update(state, ids[:k])
            assert detok.decode(ids[:k]).startswith(text)
        assert text == detok.decode(ids)


def test_no_tokenizer_gives_empty_text():
    assert Detokenizer(None).update(DecodeState(), [1, 2, 3]) == ""
