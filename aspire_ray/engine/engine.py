"""The engine loop: schedule -> execute on the workers -> the scheduler's update (tokens
committed, stops, pages freed) -> outputs.

``step()`` is the whole life of a step; the engine never touches model code or CUDA (it reaches
workers only through an Executor with plan/output data objects).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

import numpy as np

from aspire_ray.config import EngineConfig
from aspire_ray.executor import Executor, make_executor
from aspire_ray.executor.base import WorkerDiedError
from aspire_ray.model import registry
from aspire_ray.outputs import RequestOutput
from aspire_ray.plan import RowKind, RowPlan, SamplingSpec, StepOutput
from aspire_ray.process_memory import RSS_KEY
from aspire_ray.sampling_params import InvalidRequestError, SamplingParams
from aspire_ray.spec.cost_model import CollectiveCost, CostBounds, CostModel
from aspire_ray.spec.draft_policy import DraftPolicy

from . import heap
from .block_manager import BlockManager
from .calibration import calibrate
from .detokenizer import Detokenizer
from .request import Request, Status
from .scheduler import Scheduler


def load_tokenizer(cfg: EngineConfig):
    """The tokenizer of the model (or cfg.tokenizer); None for dummy models without one."""
    from transformers import AutoTokenizer

    name = cfg.tokenizer or cfg.model
    try:
        source = registry.resolve(name)
    except FileNotFoundError:
        if cfg.load_format == "dummy":
            return None
        raise
    if not source.has_tokenizer:
        return None
    return AutoTokenizer.from_pretrained(str(source.hf_dir))


def encode_text(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids: no special tokens added (a chat template writes its own)."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: pass token ids")
    return tokenizer.encode(text, add_special_tokens=False)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, executor: Executor | None = None,
                 tokenizer=None) -> None:
        self.cfg = cfg
        self.executor = executor or make_executor(cfg)
        info = self.executor.describe()
        self.info = info
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        self.detok = Detokenizer(self.tokenizer)
        # whether an unfinished request's outputs carry its text so far (decoded every step);
        # False: its final text only. LLM.generate returns finished outputs only, and a serving
        # replica decodes the token ids itself (async_engine): neither needs the step loop's
        # host time for it (~1 ms a plan of 64 requests, on the GPU's critical path)
        self.stream_text = True
        self.eos_token_ids = set(info.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_model_len = min(cfg.scheduler.max_model_len or info.max_position_embeddings,
                                 info.max_position_embeddings)
        self.blocks = BlockManager(info.num_pages, cfg.cache.page_size)
        # physics bounds from what the workers measured at start-up (absent: no bounds): one
        # shard's bytes over its bandwidth, and the TP group's all-reduces (0 at TP=1)
        collective = CollectiveCost.from_all_reduce(
            info.num_layers, info.all_reduce_latency, info.all_reduce_per_token)
        self.cost_model = CostModel(bounds=CostBounds.from_device(
            info.kv_bytes_per_token, info.weight_bytes, info.memory_bandwidth, collective))
        self.policy = DraftPolicy(cfg.spec, self.cost_model, cfg.cache.page_size,
                                  info.num_layers, info.query_tile_tokens)
        self.scheduler = Scheduler(cfg.scheduler, self.max_model_len, self.blocks, self.policy,
                                   self.detok, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random()
        self.step_count = 0
        self._steps_since_fit = 0  # decode steps measured since the cost model's last refit
        self.timings: dict[str, float] = defaultdict(float)  # seconds, summed over steps
        self.step_kinds: dict[str, int] = defaultdict(int)
        self.step_seconds: dict[str, float] = defaultdict(float)  # worker time per step kind
        # False once a worker died: every request then fails, new ones are refused.
        self.healthy = True
        self.error: str | None = None
        self.calibration = calibrate(self)  # cost model of this deployment (cfg.calibrate)
        if cfg.gc_freeze:  # built: what start-up left alive is out of every collection's way
            heap.freeze()

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, on the engine's tokenizer: only from the thread that steps
        the engine (it detokenizes with the same object; serving threads use copies)."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None) -> Request:
        params = params or SamplingParams()
        if not self.healthy:
            raise WorkerDiedError(f"the engine is unhealthy: {self.error}")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = _checked_ids(self.tokenize(prompt), self.info.vocab_size)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens")
        pool_tokens = self.blocks.num_pages * self.blocks.page_size
        if len(ids) + params.max_tokens + self.cfg.spec.d_max > pool_tokens:
            raise InvalidRequestError(
                f"prompt + max_tokens needs more KV than the whole pool ({pool_tokens} tokens)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        spec = SamplingSpec(float(params.temperature), int(params.top_k), float(params.top_p),
                            seed)
        req = Request(request_id, ids, params, spec, time.time())
        req.metrics.prompt_tokens = len(ids)
        req.metrics.arrival_time = req.arrival_time
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.status != Status.FINISHED:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that changed (new tokens or finished).

        If a worker dies (WorkerDiedError), every unfinished request is returned finished with
        finish_reason "error" and the error message, and the engine turns unhealthy (it
        refuses new requests); the error is not raised, so callers stream it to each client.
        """
        if not self.healthy:
            return []
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.rows and not plan.dropped_req_ids:
            return []
        t1 = time.perf_counter()
        try:
            out = self.executor.execute(plan)
        except WorkerDiedError as e:
            return self._fail_all(str(e))
        t2 = time.perf_counter()
        changed = self.scheduler.update(plan, out)
        t3 = time.perf_counter()
        self._record(plan.rows, out, schedule=t1 - t0, execute=t2 - t1, commit=t3 - t2)
        return [self._output(r) for r in changed]

    def _fail_all(self, message: str) -> list[RequestOutput]:
        self.healthy, self.error = False, message
        outputs = []
        for req in list(self.requests.values()):
            if req.status != Status.FINISHED:
                self.scheduler.end(req, "error")
            out = self._output(req)
            out.error = message
            outputs.append(out)
        return outputs

    def _record(self, rows: list[RowPlan], out: StepOutput, **driver_times: float) -> None:
        self.step_count += 1
        timed = out.timings  # StepTimings: the worker's seconds
        for k, v in {**driver_times, **timed.as_dict()}.items():
            self.timings[k] += v
        kinds = {row.kind for row in rows}
        label = "+".join(sorted(k.name.lower() for k in kinds)) or "empty"
        steps = max((row.num_steps for row in rows), default=1)  # a draft chain: its steps
        if any(row.async_gamma is not None for row in rows):  # an asynchronous run
            label = "async"
        elif any(row.verify_after is not None for row in rows):
            # a chain and the verification after it, one plan (or several rounds of them)
            label, steps = "round", max(row.num_rounds for row in rows)
        self.step_kinds[label] += steps
        self.step_seconds[label] += timed.total or 0.0
        # tau is the whole worker step: a draft step's page selection, refresh and sampling
        # are part of what drafting costs (~1.7 ms outside the forward at batch 64, H200)
        if rows and timed.measured and label != "round":
            # an asynchronous run: its mean step, a point on the same linear model
            n_tokens, kv = self.policy.run_features(rows) if label == "async" else \
                self.policy.step_features(rows)  # fmt: skip
            seconds = timed.total / steps
            model = self.cost_model
            kind = "mixed" if label == "async" else _cost_kind(kinds)
            model.errors.record(kind, model.predict(n_tokens, kv), seconds)
            # a prefill chunk's attention is compute-bound and grows with chunk x context,
            # which the linear model cannot follow: 133 chunks of 32k prompts in the window
            # pulled an H200's fit to r2 0.70 and it fell back to the built-in prior (and so
            # did every refit after). Decode steps are what the scheduler prices.
            if kind != "prefill":
                model.add_sample(n_tokens, kv, seconds)
                # every refit_every decode steps (an asynchronous run is num_steps of them:
                # counting plans would refit a 96-token run of 16-step runs once at most)
                self._steps_since_fit += steps
            if self._steps_since_fit >= self.cfg.spec.refit_every or model.wants_first_refit:
                model.fit()
                self._steps_since_fit = 0

    # ---- outputs and stats -------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        finished = req.status == Status.FINISHED
        if finished:
            self.requests.pop(req.req_id, None)
        elif self.stream_text and not req.params.stop:  # (stop strings: decoded at commit)
            req.text = self.detok.update(req.decode_state, req.output_token_ids)
        # the prompt a list once finished (one copy a request); while it runs, the request's
        # own tuple (no copy a step; engine_core hands a list with a stream's first output)
        prompt = list(req.prompt_token_ids) if finished else req.prompt_token_ids
        return RequestOutput(req.req_id, prompt, list(req.output_token_ids),
                             req.text, finished, req.finish_reason, req.metrics)

    def stats(self) -> dict:
        return {
            "steps": self.step_count,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_total": self.blocks.num_pages,
            "pages_used": self.blocks.num_used,
            "preemptions": self.scheduler.num_preemptions,
            "healthy": self.healthy,
            "timings": dict(self.timings),
            "step_kinds": dict(self.step_kinds),
            "step_seconds": dict(self.step_seconds),
            "probes": self.policy.num_probes,
            "cost_model": self.cost_model.summary(),
            # the shard processes' resident bytes by role, sampled at most once a second
            RSS_KEY: self.executor.resident_memory(),
        }

    def shutdown(self) -> None:
        """Release the workers (idempotent); steps after it fail every request. An in-process
        worker's GPU memory goes back to the device (``heap.return_device_memory``)."""
        self.executor.shutdown()
        if self.cfg.gc_freeze:  # what the engine held in cycles can be collected again
            heap.release()
        heap.return_device_memory()


def _cost_kind(kinds: set[RowKind]) -> str:
    """The step kind the cost model's prediction error is kept under."""
    if RowKind.PREFILL in kinds:
        return "prefill"
    if kinds == {RowKind.DRAFT}:
        return "draft"
    return "verify" if kinds == {RowKind.VERIFY} else "mixed"


def _checked_ids(ids: list, vocab: int) -> tuple[int, ...]:
    """A prompt's token ids as a tuple of Python ints (``Request.prompt_token_ids``), each in
    [0, vocab), or InvalidRequestError. One
    numpy pass: a Python check per id took ~3-7 ms for a 32k-token prompt on the thread that
    steps the engine (numpy integers pass, as the ints they hold)."""
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError):  # ragged nesting
        arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu" \
            or int(arr.min()) < 0 or int(arr.max()) >= vocab:  # fmt: skip
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
    return tuple(arr.tolist())
