"""OpenAI request and response shapes (pydantic), with the extras vLLM users expect.

Requests are parsed with ``model_validate_json(raw, strict=True)``: wrong JSON types are errors
(``"max_tokens": "16"`` is refused, not coerced), unknown fields are ignored, and fields that
would change the meaning of a request but are not implemented (logprobs, penalties, tools, ...)
are refused with a 400 naming the field instead of being silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_REQUEST_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)

Seed = Annotated[int, Field(ge=0, lt=2**63)]


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _REQUEST_CONFIG

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)  # capped by server.max_n (limits.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # capped by server.max_stop_strings (limits.py)
    seed: Seed | None = None
    user: str | None = None  # accepted and ignored
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Extras (vLLM names): top_k 0 or -1 disables; ignore_eos keeps going past EOS.
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for the first requested feature this server does not implement."""
        if self.presence_penalty or self.frequency_penalty:
            return ("presence_penalty" if self.presence_penalty else "frequency_penalty",
                    "penalties are not supported")
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated name of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only response_format type 'text' is supported"
        return super().unsupported()

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses (plain dicts built by helpers; the shapes below are what clients parse) --------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish_reason}


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "aspire_ray",
            "root": name, "parent": None, "max_model_len": max_model_len}
