"""engine/heap.py: the engine freezes Python's heap once built (no collection visits it) and
unfreezes it at shutdown, so that what the engine held in reference cycles is collected."""

from __future__ import annotations

import gc
import weakref

from aspire_ray import LLM, SamplingParams


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_built_engine_is_frozen_and_released_at_shutdown(tiny_model_dir):
    gc.unfreeze()
    llm = LLM(model=tiny_model_dir("llama"), calibrate="off", num_pages=64)
    try:
        assert gc.get_freeze_count() > 1000  # the start-up heap: out of every collection
        # what the engine holds in a cycle is frozen with it
        held = _Cycle()
        gc.freeze()
        ref = weakref.ref(held)
        del held
        gc.collect()
        assert ref() is not None  # frozen: no collection frees it
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
        assert len(out[0].token_ids) == 4
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # released: collected again


def test_the_switch_leaves_the_heap_alone(tiny_model_dir):
    gc.unfreeze()
    llm = LLM(model=tiny_model_dir("llama"), calibrate="off", num_pages=64, gc_freeze=False)
    try:
        assert gc.get_freeze_count() == 0
    finally:
        llm.shutdown()
