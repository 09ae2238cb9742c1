"""OpenAI completions and chat completions on top of ``AsyncLLMEngine``.

A request becomes one engine request per choice (``n`` per prompt); their outputs are merged
into one response, or into one SSE stream of ``data: {...}`` chunks ending in ``data: [DONE]``.
Everything checkable is checked before the engine sees the request, so errors name the field.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from aspire_ray.outputs import RequestOutput
from aspire_ray.sampling_params import InvalidRequestError, SamplingParams

from . import limits
from . import protocol as P
from .async_engine import AsyncLLMEngine
from .errors import APIError, EngineDeadError, bad_request, engine_unavailable
from .settings import ServerArgs

_FINISH_REASONS = {"stop": "stop", "length": "length"}


@dataclass
class _Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams


class _TextStream:
    """Text deltas of one choice. Holds back what might still change: the tail that could be
    the start of a stop string (cut when the stop string completes) and an incomplete UTF-8
    character (decoded as U+FFFD until its last byte arrives)."""

    def __init__(self, stops: list[str]) -> None:
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def delta(self, out: RequestOutput) -> str:
        text = out.text
        safe = len(text)
        if not out.finished:
            safe -= self.hold
            while safe > self.sent and text[safe - 1] == "\ufffd":
                safe -= 1
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent:safe], safe
        return piece


# Characters that JSON leaves raw (ensure_ascii=False) but that lenient line splitters (Python's
# str.splitlines, as httpx's aiter_lines) take for line breaks, cutting an SSE data line in two:
# escaped, as JSON allows. Control characters below 0x20 json.dumps escapes itself.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _sse(obj: dict | str) -> str:
    if isinstance(obj, str):
        return f"data: {obj}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_name: str, aliases: tuple[str, ...] = (),
                 limits: ServerArgs | None = None):
        self.engine = engine
        self.limits = limits or ServerArgs()
        self.served_name = served_name
        self.accepted_names = {served_name, *aliases}
        self.created = P.now()

    # ---- endpoints ---------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list",
                "data": [P.model_card(self.served_name, self.engine.max_model_len, self.created)]}

    async def completions(self, req: P.CompletionRequest) -> dict | AsyncIterator[str]:
        self._check_common(req)
        prompts = req.prompts
        if not prompts:
            raise bad_request("prompt: must not be an empty list", param="prompt")
        limits.check_choices(self.limits, req.n, len(prompts), len(req.stop_list))
        max_tokens = req.max_tokens
        if "max_tokens" in req.model_fields_set:
            limits.check_max_tokens(self.limits, max_tokens, "max_tokens")
        elif max_tokens is not None:  # OpenAI's default (16) is the client's, not a request
            max_tokens = limits.default_max_tokens(self.limits, max_tokens)
        prompt_ids = [await self._tokenize(p, "prompt") for p in prompts]
        choices = self._choices(req, prompt_ids, max_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        outputs = await self._start(rid, choices)
        if req.stream:
            return self._stream(rid, req, choices, outputs, chat=False)
        finals = await self._collect(outputs, len(choices))
        return {"id": rid, "object": "text_completion", "created": P.now(),
                "model": self.served_name,
                "choices": [P.completion_choice(i, o.text, _finish(o))
                            for i, o in sorted(finals.items())],
                "usage": self._usage(prompt_ids, finals)}

    async def chat(self, req: P.ChatCompletionRequest) -> dict | AsyncIterator[str]:
        self._check_common(req)
        if not self.engine.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions",
                              param="messages")
        max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        limits.check_choices(self.limits, req.n, 1, len(req.stop_list))
        limits.check_max_tokens(self.limits, req.max_new_tokens, max_param)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = await asyncio.to_thread(self.engine.apply_chat_template, messages)
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise bad_request(f"messages: the chat template failed: {exc}",
                              param="messages") from None
        ids = await self._tokenize(text, "messages")
        choices = self._choices(req, [ids], req.max_new_tokens, "messages", max_param)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = await self._start(rid, choices)
        if req.stream:
            return self._stream(rid, req, choices, outputs, chat=True)
        finals = await self._collect(outputs, len(choices))
        return {"id": rid, "object": "chat.completion", "created": P.now(),
                "model": self.served_name,
                "choices": [P.chat_choice(i, o.text, _finish(o))
                            for i, o in sorted(finals.items())],
                "usage": self._usage([ids], finals)}

    # ---- request -> engine requests ----------------------------------------------------------
    def _check_common(self, req: P.CompletionRequest | P.ChatCompletionRequest) -> None:
        if req.model not in self.accepted_names:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                           f"{self.served_name!r}", param="model", code="model_not_found")
        bad = req.unsupported()
        if bad is not None:
            raise bad_request(f"{bad[0]}: {bad[1]}", param=bad[0])
        if not self.engine.healthy:
            raise engine_unavailable(self.engine.error or "not running")

    async def _tokenize(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request(f"{param}: must not be empty", param=param)
            try:
                ids = await asyncio.to_thread(self.engine.tokenize, prompt)
            except InvalidRequestError as exc:
                raise bad_request(f"{param}: {exc}", param=param) from None
        else:
            ids = list(prompt)
        if not ids:
            raise bad_request(f"{param}: must not be empty", param=param)
        limits.check_prompt(self.limits, len(ids), param)
        return ids

    def _choices(self, req, prompt_ids: list[list[int]], max_tokens: int | None,
                 prompt_param: str, max_param: str = "max_tokens") -> list[_Choice]:
        limit = self.engine.max_request_tokens
        choices = []
        for ids in prompt_ids:
            if len(ids) >= limit:
                raise bad_request(
                    f"{prompt_param}: {len(ids)} tokens leave no room to generate; this model "
                    f"takes at most {limit} tokens (prompt + output)", param=prompt_param,
                    code="context_length_exceeded")
            wanted = (max_tokens if max_tokens is not None
                      else limits.default_max_tokens(self.limits, limit - len(ids)))
            if len(ids) + wanted > limit:
                raise bad_request(
                    f"{max_param}: prompt ({len(ids)} tokens) + {max_param} ({wanted}) exceeds "
                    f"this model's limit of {limit} tokens", param=max_param,
                    code="context_length_exceeded")
            for j in range(req.n):
                try:
                    params = SamplingParams(
                        max_tokens=wanted,
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k,
                        seed=None if req.seed is None else (req.seed + j) % 2**63,
                        stop=req.stop_list, stop_token_ids=req.stop_token_ids or [],
                        ignore_eos=req.ignore_eos,
                        include_stop_str_in_output=req.include_stop_str_in_output)
                except InvalidRequestError as exc:
                    raise bad_request(str(exc), param=_param_of(str(exc))) from None
                choices.append(_Choice(len(choices), ids, params))
        return choices

    async def _start(self, rid: str, choices: list[_Choice]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit every choice and wait for the first output, so that a request the engine
        refuses becomes an HTTP error before any response (or stream) starts."""
        merged = self._merge(rid, choices)
        try:
            first = await merged.__anext__()
        except BaseException as exc:
            await merged.aclose()
            raise _api_error(exc) from None

        async def rest() -> AsyncIterator[tuple[int, RequestOutput]]:
            async with aclosing(merged):
                yield first
                async for item in merged:
                    yield item

        return rest()

    async def _merge(self, rid: str, choices: list[_Choice]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, cumulative output) from all choices, as they arrive."""
        if len(choices) == 1:
            c = choices[0]
            async with aclosing(self.engine.generate(f"{rid}-0", c.prompt_ids, c.params)) as g:
                async for out in g:
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                gen = self.engine.generate(f"{rid}-{c.index}", c.prompt_ids, c.params)
                async with aclosing(gen) as g:
                    async for out in g:
                        queue.put_nowait((c.index, out))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((c.index, exc))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(choices)
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield index, item
                remaining -= item.finished
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their aborts are queued

    async def _collect(self, outputs, n: int) -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(outputs):
            try:
                async for index, out in outputs:
                    if out.finished:
                        finals[index] = out
            except Exception as exc:  # noqa: BLE001
                raise _api_error(exc) from None
        return finals

    @staticmethod
    def _usage(prompt_ids: list[list[int]], finals: dict[int, RequestOutput]) -> dict:
        return P.usage(sum(len(p) for p in prompt_ids),
                       sum(len(o.token_ids) for o in finals.values()))

    # ---- streaming ---------------------------------------------------------------------------
    async def _stream(self, rid: str, req, choices: list[_Choice], outputs,
                      chat: bool) -> AsyncIterator[str]:
        """SSE chunks: text deltas per choice (chat: a role chunk first), the finish reason on
        each choice's last chunk, an optional usage chunk, then ``[DONE]``. An engine failure
        mid-stream becomes an error chunk (the status line is long sent)."""
        created = P.now()
        obj = "chat.completion.chunk" if chat else "text_completion"
        texts = [_TextStream(c.params.stop) for c in choices]
        extra = {"usage": None} if req.include_usage else {}
        finals: dict[int, RequestOutput] = {}

        def chunk(choices_: list[dict], **fields) -> str:
            return _sse({"id": rid, "object": obj, "created": created,
                         "model": self.served_name, "choices": choices_, **(fields or extra)})

        def choice(index: int, piece: str, reason: str | None) -> dict:
            if chat:
                return P.chat_delta_choice(index, {"content": piece} if piece else {}, reason)
            return P.completion_choice(index, piece, reason)

        if chat:
            for c in choices:
                yield chunk([P.chat_delta_choice(c.index, {"role": "assistant", "content": ""},
                                                 None)])
        async with aclosing(outputs):
            try:
                async for index, out in outputs:
                    piece = texts[index].delta(out)
                    if out.finished:
                        finals[index] = out
                    if piece or out.finished:
                        yield chunk([choice(index, piece, _finish(out))])
            except Exception as exc:  # noqa: BLE001 - reported inside the stream
                yield _sse(_api_error(exc).body())
                yield _sse("[DONE]")
                return
        if req.include_usage:
            prompts = [c.prompt_ids for c in choices[:: req.n]]  # n choices per prompt
            yield chunk([], usage=self._usage(prompts, finals))
        yield _sse("[DONE]")


def _param_of(message: str) -> str | None:
    """The SamplingParams field an InvalidRequestError message is about."""
    for name in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "stop",
                 "prompt"):
        if name in message:
            return name
    return None


def _finish(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return _FINISH_REASONS.get(out.finish_reason or "", out.finish_reason)


def _api_error(exc: BaseException) -> BaseException:
    """Engine-side exceptions -> APIError; anything else (cancellation included) unchanged."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=_param_of(str(exc)))
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    return exc
