"""The offline Python API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .config import build_engine_config
from .engine.engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Offline batched generation.

    >>> with LLM(model="smollm2-135m-instruct", spec_mode="aspire") as llm:
    ...     out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))

    What it holds (the worker; at tp_size > 1 the shard actors and their placement group) is
    released by ``shutdown()``, on leaving a ``with`` block, or when it is garbage-collected
    (the executor's finalizer), so the next ``LLM`` can take the same devices.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", *, dtype: str = "float32",
                 device: str = "cpu", spec_mode: str = "ar", tp_size: int = 1,
                 load_format: str = "auto", page_size: int = 16, **kwargs) -> None:
        cfg = build_engine_config(model, spec_mode=spec_mode, dtype=dtype, device=device,
                                  tp_size=tp_size, load_format=load_format, page_size=page_size,
                                  **kwargs)
        self.engine = LLMEngine(cfg)
        self.engine.stream_text = False  # generate returns finished outputs, with their text
        self._ids = itertools.count()
        self._closed = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a string or a list of token ids."""
        if self._closed:
            raise RuntimeError("this LLM is shut down")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, prompt, params)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[rid] for rid in ids]

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Release the workers now (idempotent); ``generate`` raises afterwards."""
        self._closed = True
        self.engine.shutdown()
