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


def test_invalid_utf8_output_keeps_the_work_per_step_bounded(detok):
    # tokens that each decode to a lone continuation byte: the text never completes
    lone = [i for i in range(400) if detok.decode([i]) == "\ufffd"][:1]
    assert lone, "no single-byte token decodes to U+FFFD"
    windows = []
    decode = detok.decode

    def recording(ids):
        windows.append(len(ids))
        return decode(ids)

    detok.decode = recording
    try:
        state, ids = DecodeState(), []
        for _ in range(200):
            ids.append(lone[0])
            text = detok.update(state, ids)
        ids += detok.tokenizer.encode(" ok", add_special_tokens=False)
        text = detok.update(state, ids)
    finally:
        del detok.decode
    assert max(windows) <= 16  # not the whole output, re-decoded every step
    assert text.endswith(" ok") and text.count("\ufffd") >= 190  # settled as it decodes
