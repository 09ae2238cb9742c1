"""No two threads use one fast tokenizer at once: the HTTP side tokenizes prompts and chat
templates in a thread pool while the engine thread detokenizes every step (issue 16, item 3)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from contextlib import contextmanager

import pytest

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.sampling_params import InvalidRequestError
from aspire_ray.serving.async_engine import AsyncLLMEngine
from aspire_ray.serving.tokenizer_pool import TokenizerPool

ENGINE_KW = dict(spec_mode="aspire", num_pages=256, max_num_batched_tokens=256, d_max=4,
                 calibrate="off")
HAMMER_S = 3.0


class ExclusiveTokenizer:
    """A tokenizer that raises "Already borrowed" when a thread calls it while another thread's
    call is still running: PyO3's borrow check made deterministic (the real one fires only when
    one of the colliding calls mutates the Rust object, e.g. ``encode`` resetting truncation;
    tokenizers 0.23.3 makes it wait instead). Copies are new, independent tokenizers."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._lock = threading.Lock()
        self._user: int | None = None  # the thread inside a call

    @contextmanager
    def _using(self, what: str):
        me = threading.get_ident()
        with self._lock:
            if self._user not in (None, me):
                raise RuntimeError(f"Already borrowed: {what} while another thread uses the "
                                   f"tokenizer")
            outer, self._user = self._user, me
        try:
            yield
        finally:
            with self._lock:
                self._user = outer

    def __getattr__(self, name: str):
        attr = getattr(self._tok, name)
        if not callable(attr):
            return attr

        def guarded(*args, **kwargs):
            with self._using(name):
                return attr(*args, **kwargs)

        return guarded

    def __deepcopy__(self, memo) -> ExclusiveTokenizer:
        with self._using("deepcopy"):
            return ExclusiveTokenizer(copy.deepcopy(self._tok, memo))


def _texts() -> list[str]:
    # multi-byte characters: a byte-level tokenizer splits them over several tokens
    return [f"{i}: naïve café, 漢字 and emoji 🙂 — the quick brown fox. " * (40 + 20 * i)
            for i in range(4)]


def test_tokenize_and_chat_templates_race_the_engine_threads_detokenizing(tiny_chat_model):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_chat_model)  # expected values, this thread only
    texts = _texts()
    want_ids = [ref.encode(t, add_special_tokens=False) for t in texts]
    chats = [[{"role": "user", "content": t[:500]}] for t in texts]
    want_chats = [ref.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                  for c in chats]
    engine = LLMEngine(build_engine_config(tiny_chat_model, **ENGINE_KW),
                       tokenizer=ExclusiveTokenizer(AutoTokenizer.from_pretrained(tiny_chat_model)))
    aengine = AsyncLLMEngine(engine)
    deadline = time.monotonic() + HAMMER_S
    errors: list[BaseException] = []
    counts = {"encode": 0, "chat": 0}

    def hammer(first: int) -> None:
        i = first
        try:
            while time.monotonic() < deadline:
                k = i % len(texts)
                assert aengine.tokenize(texts[k]) == want_ids[k]
                assert aengine.apply_chat_template(chats[k]) == want_chats[k]
                counts["encode"] += 1
                counts["chat"] += 1
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    async def generate_until_deadline() -> list:
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        finals, n = [], 0
        while time.monotonic() < deadline:
            async def one(rid: str, prompt: list[int]):
                return [o async for o in aengine.generate(rid, prompt, params)][-1]

            batch = [one(f"r{n + j}", want_ids[j][: 20 + 10 * j]) for j in range(4)]
            n += len(batch)
            finals += await asyncio.gather(*batch)
        return finals

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        finals = asyncio.run(generate_until_deadline())
        for t in threads:
            t.join(30)
    finally:
        aengine.shutdown()
    assert not errors, f"a tokenizing thread failed: {errors[0]!r}"
    assert counts["encode"] >= 3 and len(finals) >= 4  # the race really ran, both sides
    for out in finals:  # the engine thread's detokenizing stayed correct
        assert out.finished and len(out.token_ids) == 48
        assert out.text == ref.decode(out.token_ids, skip_special_tokens=True)


def test_pool_hands_each_copy_to_one_thread(tiny_chat_model):
    from transformers import AutoTokenizer

    tok = ExclusiveTokenizer(AutoTokenizer.from_pretrained(tiny_chat_model))
    pool = TokenizerPool(tok, copies=2)
    with pool._borrow() as a, pool._borrow() as b:  # both copies out at once: no error
        assert a is not b and a is not tok and b is not tok
        assert a.encode("hi") == b.encode("hi") == tok.encode("hi")
    assert pool.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert pool.has_chat_template


def test_pool_without_a_tokenizer():
    pool = TokenizerPool(None)
    assert not pool.has_chat_template
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        pool.encode("text")
