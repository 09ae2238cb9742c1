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
    held = _Cycle()  # alive when the engine is built: frozen with the start-up heap
    ref = weakref.ref(held)
    llm = LLM(model=tiny_model_dir("llama"), calibrate="off", num_pages=64)
    try:
        assert gc.get_freeze_count() > 1000  # the start-up heap: out of every collection
        del held
        gc.collect()
        assert ref() is not None  # frozen by the engine: no collection frees it
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


def test_a_frozen_heap_is_finalized_at_exit(tmp_path):
    # an engine never shut down leaves its heap frozen: the exit hook unfreezes it, so the
    # interpreter's exit finalizes Triton's objects as before (else nanobind prints every one
    # of them as leaked, hundreds of lines)
    import subprocess
    import sys

    script = tmp_path / "frozen.py"
    script.write_text(
        "import os\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import sys, torch, triton, triton.language as tl\n"
        "from aspire_ray.engine import heap\n"
        "heap._at_exit = len(sys.argv) > 1  # True: no hook, as before it\n"
        "@triton.jit\n"
        "def k(x_ptr):\n"
        "    tl.store(x_ptr, tl.load(x_ptr) + 1)\n"
        "x = torch.zeros(1)\n"
        "k[(1,)](x)\n"
        "heap.freeze()\n")
    runs = [subprocess.run([sys.executable, str(script), *extra], capture_output=True,
                           text=True, timeout=120) for extra in ([], ["no-hook"])]  # fmt: skip
    assert runs[0].returncode == 0 and "leaked" not in runs[0].stderr, runs[0].stderr[-500:]
    assert "leaked" in runs[1].stderr  # the check sees the failure it guards against


def test_a_running_prompt_costs_a_collection_nothing(tiny_model_dir):
    # a collection visits every element of a list it tracks; a request's prompt is a tuple of
    # ints, which the collector untracks when it first meets it: 160 prompts of 32k tokens as
    # lists made each generation-2 collection of a decode window ~50 ms (§8.60)
    llm = LLM(model=tiny_model_dir("llama"), calibrate="off", num_pages=64)
    try:
        engine = llm.engine
        prompt = list(range(5, 45))
        engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
        req = engine.requests["r"]
        gc.collect()
        assert not gc.is_tracked(req.prompt_token_ids)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        # a finished output's prompt is a list, as the caller gave it
        assert outs[-1].finished and outs[-1].prompt_token_ids == prompt
        assert isinstance(outs[-1].prompt_token_ids, list)
        assert all(tuple(o.prompt_token_ids) == tuple(prompt) for o in outs)
    finally:
        llm.shutdown()
