"""The default model (SmolLM2-135M-Instruct from its GGUF): exact against transformers, every
speculation mode exact against `ar` on real long text, stop conditions, the CLI."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import needs_smollm2

from aspire_ray import LLM, SamplingParams
from aspire_ray.config import SPEC_MODES

pytestmark = needs_smollm2


@functools.cache
def _real_text_ids(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """Real English text available offline: CPython's pydoc topics (PSF licence)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[offset : offset + n_tokens]


@pytest.fixture(scope="module", autouse=True)
def two_torch_threads():
    # a 135M model's matmuls do split over 2 cores (conftest keeps the tiny models' tests on 1)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ar_llm():
    llm = LLM(spec_mode="ar", num_pages=400, max_num_batched_tokens=512)
    yield llm
    llm.shutdown()


def test_greedy_matches_transformers_on_default_model(ar_llm):
    from transformers import AutoModelForCausalLM

    from aspire_ray.model import registry

    hf_dir = registry.resolve("smollm2-135m-instruct").hf_dir
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                              attn_implementation="eager")
    tok = ar_llm.tokenizer
    prompts = [[tok.bos_token_id or 1], tok.encode("The capital of France is"),
               _real_text_ids(tok, 300, offset=1000)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    got = ar_llm.generate(prompts, params)
    for prompt, out in zip(prompts, got, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                          do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_every_mode_matches_ar_on_real_text(ar_llm):
    """384-token prompts of real text (24 pages; the prefills are most of the test's time,
    640 tokens took 8 s more); k_min = 8 pages so drafting is sparse. 12 new tokens: still 3
    or 4 verified rounds per request in every mode. No start-up calibration: aspire's sweep
    took 12 s of the test's 56, and exactness does not depend on the cost model's figures (the
    sweep itself: test_calibration.py); the drafted-token assertion below still holds."""
    tok = ar_llm.tokenizer
    prompts = [_real_text_ids(tok, 384, offset=o) for o in (0, 5000)] + [
        _real_text_ids(tok, 200, offset=9000)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in ar_llm.generate(prompts, params)]
    for mode in SPEC_MODES[1:]:
        llm = LLM(spec_mode=mode, num_pages=400, max_num_batched_tokens=512, k_min=8,
                  recent_pages=2, gamma=4, calibrate="off")
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected, mode
        assert sum(o.metrics.drafted for o in outs) > 0


def test_stop_conditions(ar_llm):
    tok = ar_llm.tokenizer
    prompt = "Count: one, two, three, four, five,"
    free = ar_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0))[0]
    assert free.finish_reason in ("length", "stop")
    word = free.text.strip().split()[1]  # a word the model will produce
    stopped = ar_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0,
                                                     stop=[word]))[0]
    assert stopped.finish_reason == "stop" and word not in stopped.text
    assert free.text.startswith(stopped.text)
    first = free.token_ids[2]
    by_id = ar_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0,
                                                   stop_token_ids=[first]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == first
    assert len(by_id.token_ids) <= 3
    length = ar_llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0))[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 5
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                   add_generation_prompt=True)
    eos = ar_llm.generate(chat, SamplingParams(max_tokens=200, temperature=0))[0]
    assert eos.finish_reason == "stop"


def test_over_long_prompt_is_rejected(ar_llm):
    from aspire_ray import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="exceeds"):
        ar_llm.generate([1] * 8190, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="empty"):
        ar_llm.generate("", SamplingParams(max_tokens=10))
    assert ar_llm.engine.blocks.num_used == 0


def test_cli_prints_a_completion(capsys):
    from aspire_ray.cli import main

    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "4",
                 "--spec-mode", "ar"]) == 0
    assert "Paris" in capsys.readouterr().out
