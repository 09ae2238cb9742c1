"""The replica's side of the engine: an engine core stepped from a background thread,
asyncio outside.

Threads and ownership:
- The engine thread owns the engine core (``engine_core.py``: in-process, or a driver actor):
  it alone calls its ``submit``/``collect``, one call per engine step carrying every add and
  abort queued since the last one, up to the core's ``pipeline_depth`` calls in flight (a
  driver actor: two, so that the driver starts its next step without waiting for this thread
  to deliver the last one's outputs; an add or abort then reaches the engine a step later). It
  steps while there is work and sleeps on a condition variable otherwise.
- The HTTP side tokenizes (prompts, chat templates) in asyncio's thread pool on copies of the
  engine's tokenizer (``tokenizer_pool.py``), never on the engine thread's own.
- The event loop talks to it only through ``_commands`` (add/abort, applied between steps)
  under ``_cv``'s lock, and receives outputs through per-request ``asyncio.Queue``s filled with
  ``loop.call_soon_threadsafe``.

Invariants: a request's queue is registered before its add command is queued, so no output is
lost; a consumer that stops early (client disconnect, cancellation) queues an abort, so its
pages return to the pool; an exception from a step fails every in-flight request with
``EngineDeadError``, marks the engine unhealthy and ends the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aspire_ray.engine.detokenizer import DecodeState, Detokenizer
from aspire_ray.outputs import RequestOutput
from aspire_ray.sampling_params import SamplingParams

from .engine_core import EngineCore, NewRequest
from .errors import EngineDeadError
from .metrics import ServingMetrics
from .tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or one exception that ends the stream
    num_tokens: int = 0  # tokens already counted for metrics
    # the prompt's token ids: the core sends them with a request's first output only
    prompt_token_ids: list[int] = field(default_factory=list)
    # the output's token ids so far: the core sends each once (``EngineCore.step``)
    token_ids: list[int] = field(default_factory=list)
    # the text decoded here from the outputs' token ids (requests without stop strings: the
    # engine decodes those, to find the stops)
    decode: DecodeState | None = None


class AsyncLLMEngine:
    def __init__(self, engine, metrics: ServingMetrics | None = None, tokenizer=None) -> None:
        """engine: an ``LLMEngine`` (stepped in this process) or an engine core
        (``engine_core.ActorCore``: a driver actor; then ``tokenizer`` is the model's)."""
        from aspire_ray.engine.engine import LLMEngine

        if isinstance(engine, LLMEngine):
            self.engine, self.core = engine, EngineCore(engine)
            tokenizer = engine.tokenizer
        else:
            self.engine, self.core = None, engine  # the LLMEngine lives in the driver
        self.metrics = metrics
        self.facts = self.core.facts()
        self._cv = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._streams: dict[str, _Stream] = {}  # guarded by _cv's lock
        self._error: EngineDeadError | None = None
        self._core_error: str | None = None  # the core's own report after its last step
        self._closed = False
        self._busy = False  # engine thread only: the engine has unfinished requests
        self._stats = self.core.stats()  # snapshot taken by the engine thread after each step
        # copied before the engine thread starts: from then on it alone uses engine.tokenizer
        self.tokenizers = TokenizerPool(tokenizer)
        # the engine thread's own copy: it decodes the streams' text (``_deliver``)
        self._detok = Detokenizer(copy.deepcopy(tokenizer) if tokenizer is not None else None)
        self._thread = threading.Thread(target=self._run, name="aspire-engine", daemon=True)
        self._thread.start()

    # ---- facts for the HTTP layer ------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        # The engine's own flag turns first when a worker dies (set inside step()).
        return (self._error is None and self._core_error is None and not self._closed
                and self._thread.is_alive() and getattr(self.engine, "healthy", True))

    @property
    def error(self) -> str | None:
        if self._error is None and self.engine is not None and not self.engine.healthy:
            return f"engine unhealthy: {self.engine.error}"
        if self._error is None and self._core_error is not None:
            return f"engine unhealthy: {self._core_error}"
        return str(self._error) if self._error else None

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizers.has_chat_template

    def tokenize(self, prompt: str) -> list[int]:
        """A text prompt's token ids (blocking; any thread but the engine's)."""
        return self.tokenizers.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """A chat's prompt text (blocking; any thread but the engine's)."""
        return self.tokenizers.apply_chat_template(messages)

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + output tokens one request may have (context and KV pool limits)."""
        return self.facts.max_request_tokens

    def stats(self) -> dict:
        """``LLMEngine.stats()`` as of the end of the last step (safe from any thread)."""
        return self._stats

    def probe_workers(self, timeout_s: float = 1.0) -> None:
        """Idle health check (blocking, up to timeout_s): a shard worker (or the driver actor)
        that died while no step ran is otherwise found only by the next request's step. It
        fails the engine now, so that /health and Serve's health check see it before traffic
        does."""
        if not self.healthy or self._busy:
            return  # a running step notices a dead rank by itself
        message = self.core.dead(timeout_s)
        if message:
            logger.error("%s (found by the idle health check)", message)
            self._fail_all(EngineDeadError(message))

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; the last one has ``finished`` set.

        Raises ``InvalidRequestError`` (bad prompt or params) before the first output and
        ``EngineDeadError`` if the engine fails. Closing or cancelling the iterator early
        aborts the request.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), decode=None if params.stop else DecodeState())
        add = _Add(request_id, prompt, params)
        with self._cv:
            if self._error is not None:
                raise EngineDeadError(str(self._error))
            if self._closed:
                raise EngineDeadError("the engine is shut down")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already streaming")
            self._streams[request_id] = stream
            self._commands.append(add)
            self._cv.notify()
        finished = False
        try:
            await asyncio.wrap_future(add.done)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request (any thread); its pages are freed before the next step."""
        with self._cv:
            self._streams.pop(request_id, None)
            if self._error is None and not self._closed:
                self._commands.append(_Abort(request_id))
                self._cv.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine is shut down"))
        self.core.shutdown()

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        inflight: deque[tuple[object, list[_Add], list]] = deque()  # (handle, adds, commands)
        depth = getattr(self.core, "pipeline_depth", 1)
        while True:
            with self._cv:
                while not (self._commands or self._busy or inflight or self._closed):
                    self._cv.wait()
                if self._closed:  # steps in flight are not waited for: shutdown fails their adds
                    self._commands[:0] = [c for _, _, cmds in inflight for c in cmds]
                    return
                submit = len(inflight) < depth and bool(self._commands or self._busy)
                commands: list = []
                if submit:
                    commands, self._commands = self._commands, []
            try:
                if submit:
                    adds, aborts = self._batch(commands)
                    handle = self.core.submit([NewRequest(a.request_id, a.prompt, a.params)
                                               for a in adds], aborts)  # fmt: skip
                    inflight.append((handle, adds, commands))
                    self._busy = True  # until a result says otherwise: keep the pipeline full
                    if len(inflight) < depth:
                        continue  # queue the next step before waiting for this one
                handle, adds, commands = inflight.popleft()
                result = self.core.collect(handle)
                for add in adds:
                    exc = result.rejected.get(add.request_id)
                    if exc is None:
                        add.done.set_result(None)
                        continue
                    with self._cv:
                        self._streams.pop(add.request_id, None)
                    add.done.set_exception(exc)
                # the stats first: a caller woken by a step's outputs sees that step's stats
                self._busy = result.busy
                self._stats = result.stats
                self._deliver(result.outputs)
            except Exception as exc:  # noqa: BLE001 - any step failure ends the engine
                logger.exception("engine step failed; failing all in-flight requests")
                unapplied = commands + [c for _, _, cmds in inflight for c in cmds]
                self._fail_all(EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}"),
                               unapplied=unapplied)
                return
            if result.error is not None:  # a worker died; the engine said so
                logger.error("engine unhealthy: %s", result.error)
                self._core_error = result.error
                self._fail_all(EngineDeadError(f"engine unhealthy: {result.error}"),
                               unapplied=[c for _, _, cmds in inflight for c in cmds])
                return

    def _batch(self, commands: list[_Add | _Abort]) -> tuple[list[_Add], list[str]]:
        """The adds still wanted (their callers neither cancelled nor aborted them) and the
        aborts, of the commands queued since the last step."""
        adds, aborts = [], []
        for cmd in commands:
            if isinstance(cmd, _Abort):
                aborts.append(cmd.request_id)
                continue
            if not cmd.done.set_running_or_notify_cancel():
                continue  # the caller was cancelled before the request was added
            with self._cv:
                wanted = cmd.request_id in self._streams  # aborted before it was ever added?
            if wanted:
                adds.append(cmd)
            else:
                cmd.done.set_result(None)
        return adds, aborts

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        step_tokens = 0
        for out in outputs:
            with self._cv:
                stream = (self._streams.pop(out.request_id, None) if out.finished
                          else self._streams.get(out.request_id))
            if stream is None:
                continue  # aborted meanwhile
            if out.prompt_token_ids:  # its first output: the tokens so far, all of them
                stream.prompt_token_ids = out.prompt_token_ids
                stream.token_ids = list(out.token_ids)  # (the output handed out stays as is)
            else:  # later ones: the tokens new since the last
                out.prompt_token_ids = stream.prompt_token_ids
                stream.token_ids += out.token_ids
                out.token_ids = list(stream.token_ids)
            step_tokens += len(out.token_ids) - stream.num_tokens
            stream.num_tokens = len(out.token_ids)
            if stream.decode is not None and not out.finished:  # (finished: the engine's text)
                out.text = self._detok.update(stream.decode, out.token_ids)
            if out.finished and self.metrics is not None:
                self.metrics.on_finished(out)
            item = out
            if out.finish_reason == "error":  # the engine failed this request (worker died)
                item = EngineDeadError(f"engine unhealthy: {out.error or 'request failed'}")
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed
                if not out.finished:
                    with self._cv:  # dropped at the next step
                        self._commands.append(_Abort(out.request_id))
        if self.metrics is not None:
            self.metrics.on_tokens(step_tokens)

    def _fail_all(self, error: EngineDeadError, unapplied: list | None = None) -> None:
        with self._cv:
            if self._error is None and not self._closed:
                self._error = error
            streams, self._streams = self._streams, {}
            commands, self._commands = (unapplied or []) + self._commands, []
        for cmd in commands:
            if not isinstance(cmd, _Add) or cmd.done.done():
                continue
            if cmd.done.running() or cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(EngineDeadError(str(error)))
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                 EngineDeadError(str(error)))
            except RuntimeError:
                pass
